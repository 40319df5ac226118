"""The halo of a sliding window (attention/halo.py, pure): each piece holds exactly the key
columns of the owner's block that some query of the reader sees (brute force over every token
pair), and the halo is taken only where it moves fewer columns than the ring."""

from __future__ import annotations

import pytest

from loongtrain.attention.layout import sequence_layout
from loongtrain.parallel.config import ParallelConfig


def _visible_columns(layout, reader: int, owner: int, window: int, cu) -> set[int]:
    """Local columns of ``owner``'s block that a query of ``reader`` sees: causal, one document, window."""

    def positions(context):
        return [p for h in range(layout.hp) for start, n in layout.ranges(h, context) for p in range(start, start + n)]

    doc = {p: d for d, (a, b) in enumerate(zip(cu, cu[1:])) for p in range(a, b)}
    queries, keys = positions(reader), positions(owner)
    return {j for j, k in enumerate(keys) if any(doc[q] == doc[k] and 0 <= q - k < window for q in queries)}


@pytest.mark.parametrize(
    "config, cu",
    [
        (ParallelConfig(cp=4), None),
        (ParallelConfig(cp=4, ring_window=2, balance="documents"), [0, 7, 40, 41, 90, 128]),
        (ParallelConfig(hp=2, cp=2), [0, 50, 128]),
    ],
)
def test_halo_pieces_are_the_columns_some_query_sees(config, cu):
    seq, window = 128, 5
    layout = sequence_layout(seq, config, cu)
    masks = layout.mask_plan(True, window)
    halo = masks.halo(config)
    assert halo is not None  # a window below a chunk: fewer columns than the ring's blocks
    bounds = cu or [0, seq]
    pieces = {(p.owner, p.reader): p for p in halo.pieces}
    for owner in range(config.cp):
        for reader in range(config.cp):
            if owner == reader:
                continue
            want = _visible_columns(layout, reader, owner, window, bounds)
            piece = pieces.get((owner, reader))
            got = {j for a, b in piece.ranges for j in range(a, b)} if piece else set()
            assert got == want, (owner, reader)
    assert layout.mask_plan(True, None).halo(config) is None  # full attention keeps the ring
