"""A block's kernel calls as few variable-length calls (packed documents on CUDA). Pure.

The mask plan (:mod:`~loongtrain.attention.mask_plan`) cuts a block into calls on contiguous
row and column ranges: at least one per document the block holds. A variable-length kernel
(FlashAttention's ``cu_seqlens``) runs many such ranges, "pieces", in one launch, provided they
share its ``causal`` flag and its window, and their query rows do not overlap (each row's output
and log-sum-exp come from one piece). So the calls are grouped by kind:

- ``causal`` squares: one causal call (FlashAttention's bottom-right causal mask is the
  top-left one on a square); under a sliding window ``W`` a square of at most ``W`` rows also
  joins the band pieces whose window is ``(W - 1, 0)``;
- ``full`` rectangles: one call without a mask;
- ``band`` calls (sliding-window edges): the band as the kernel's window, which depends only on
  how far the piece's last key lies from its last query, so every piece whose keys end on its
  queries' diagonal (a document's own band) shares ``(W - 1, 0)``, and off-diagonal ones group
  by that distance.

A group whose pieces overlap in rows is split into layers of row-disjoint pieces (interval
partitioning, fewest layers). The number of calls a block makes is then set by its geometry
(its kinds, windows and overlaps), not by how many documents it holds.
"""

from __future__ import annotations

import functools

from loongtrain.attention.backends.base import Band, Piece, VarlenCall, Window
from loongtrain.attention.mask_plan import BAND, CAUSAL, Call


def _key(call: Call, causal: bool, sliding_window: int | None) -> tuple[bool, Window | None]:
    """``(causal flag, window)`` of the variable-length call a plan call joins."""
    rows, cols = call.row1 - call.row0, call.col1 - call.col0
    if call.kind == CAUSAL:
        if sliding_window is not None and rows <= sliding_window:
            return False, (sliding_window - 1, 0)  # within the window: the band of a document's own diagonal
        return True, None
    if call.kind != BAND:
        return False, None
    window = Band(call.q_start - call.k_start, sliding_window, causal).flash_window(rows, cols)
    if window is None:  # the mask plan's bands always have one (tests/test_kernels.py)
        raise ValueError(f"band call {call} has no FlashAttention window")
    return False, window


def _layers(pieces: list[Piece]) -> list[list[Piece]]:
    """``pieces`` in the fewest lists of row-disjoint pieces, each sorted by rows."""
    layers: list[list[Piece]] = []
    for piece in sorted(pieces):
        for layer in layers:
            if layer[-1].row1 <= piece.row0:
                layer.append(piece)
                break
        else:
            layers.append([piece])
    return layers


@functools.lru_cache(maxsize=4096)
def varlen_calls(calls: tuple[Call, ...], causal: bool, sliding_window: int | None) -> tuple[VarlenCall, ...]:
    """The variable-length calls that compute the same as ``calls`` (a block's plan calls under
    ``causal`` and ``sliding_window``), in a deterministic order."""
    groups: dict[tuple[bool, Window | None], list[Piece]] = {}
    for call in calls:
        groups.setdefault(_key(call, causal, sliding_window), []).append(
            Piece(call.row0, call.row1, call.col0, call.col1)
        )
    out = []
    for (is_causal, window), pieces in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or (-1, -1))):
        out += [VarlenCall(tuple(layer), is_causal, window) for layer in _layers(pieces)]
    return tuple(out)


def contiguous_span(ranges: list[tuple[int, int]]) -> tuple[int, int] | None:
    """``(start, stop)`` when the ranges, in order, tile one contiguous range; else None."""
    for (_, stop), (start, _) in zip(ranges, ranges[1:]):
        if stop != start:
            return None
    return ranges[0][0], ranges[-1][1]
