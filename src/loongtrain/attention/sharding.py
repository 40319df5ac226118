"""Sequence sharding over the sequence-parallel group: which tokens each rank holds.

Every context index ``c`` holds ``S/cp`` tokens, its *content*: equal-length chunks of
the global sequence in ascending order. ``balance="zigzag"`` cuts the sequence into
``2*cp`` chunks and gives ``c`` chunks ``c`` and ``2*cp - 1 - c`` (causal load balance
for one document); ``balance="documents"`` and ``balance="locality"`` take the
document-aware assignments of :mod:`loongtrain.attention.balance` computed from
``cu_seqlens`` (the second keeps documents on few ring-adjacent ranks, so the ring
carries little). The head all-to-all
gathers sequence pieces in head order, so before it the rank with coordinates ``(h, c)``
holds the ``h``-th of ``hp`` equal contiguous pieces of that content.

That gives one permutation of token positions for the whole sp group; inputs, labels and
RoPE position ids are all sharded with it, and the attention derives its masks from the
same map. The maps are pure functions; a
:class:`~loongtrain.attention.layout.SequenceLayout` holds the one of a batch and
``shard_sequence`` / ``unshard_sequence`` apply it to tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loongtrain.attention.balance import balance_documents, balance_locality
from loongtrain.attention.documents import Boundaries, range_work
from loongtrain.attention.schedule import zigzag_chunks
from loongtrain.options import BALANCES
from loongtrain.parallel.layout import check_sequence_length  # the rule lives with the layout (pure)

Ranges = tuple[tuple[int, int], ...]  # (global start, length), in local order


def check_balance(balance: str) -> None:
    if balance not in BALANCES:
        raise ValueError(f"balance={balance!r} is not known; choose one of {list(BALANCES)}")


def _take(ranges: Ranges, lo: int, hi: int) -> list[tuple[int, int]]:
    """Offsets ``[lo, hi)`` of the concatenation of ``ranges``, as global ranges."""
    out = []
    offset = 0
    for start, length in ranges:
        a, b = max(lo, offset), min(hi, offset + length)
        if a < b:
            out.append((start + a - offset, b - a))
        offset += length
    return out


@dataclass(frozen=True)
class SequenceSharding:
    """The token ranges held by every rank ``(head, context)`` of one sp group. Pure.

    ``content[c]`` lists context index ``c``'s chunks, ascending; ``head`` rank ``h`` of
    that context index holds the ``h``-th of ``hp`` equal pieces of their concatenation.
    """

    seq_len: int
    hp: int
    cp: int
    content: tuple[Ranges, ...]
    balance: str = "zigzag"

    def ranges(self, head: int, context: int) -> list[tuple[int, int]]:
        """Global ``(start, length)`` ranges held by rank ``(head, context)``, in local order."""
        piece = self.seq_len // (self.hp * self.cp)
        return _take(self.content[context], head * piece, (head + 1) * piece)

    def work(self, boundaries: Boundaries | None, causal: bool = True, sliding_window: int | None = None) -> list[int]:
        """Attention work (keys its queries see) of each context index's content."""
        bounds = boundaries or (0, self.seq_len)
        return [
            sum(range_work(bounds, s, s + n, causal, sliding_window) for s, n in content) for content in self.content
        ]


def zigzag_sharding(seq_len: int, hp: int, cp: int) -> SequenceSharding:
    """Context index ``c`` holds chunks ``c`` and ``2*cp - 1 - c`` of ``2*cp``."""
    check_sequence_length(seq_len, hp, cp)
    chunk = seq_len // (2 * cp)
    content = tuple(tuple((i * chunk, chunk) for i in zigzag_chunks(c, cp)) for c in range(cp))
    return SequenceSharding(seq_len, hp, cp, content, "zigzag")


def sequence_sharding(
    seq_len: int, hp: int, cp: int, boundaries: Boundaries | None = None, balance: str = "zigzag"
) -> SequenceSharding:
    """The sharding for ``balance``: ``"zigzag"``, ``"documents"`` (chunks assigned from the
    validated document ``boundaries``; ``None``: one document) or ``"locality"`` (documents
    whole or on runs of ring-adjacent ranks, :func:`balance_locality`). Pure; a
    :class:`~loongtrain.attention.layout.SequenceLayout` holds the one it uses."""
    check_balance(balance)
    if hp * cp == 1:  # one device: the whole sequence in order (any length)
        return SequenceSharding(seq_len, 1, 1, (((0, seq_len),),), balance)
    if balance == "zigzag" or cp == 1:
        return zigzag_sharding(seq_len, hp, cp)
    check_sequence_length(seq_len, hp, cp)
    assign = balance_locality if balance == "locality" else balance_documents
    found = assign(seq_len, cp, boundaries or (0, seq_len))
    return SequenceSharding(seq_len, hp, cp, found.chunks, balance)


def take_ranges(x: torch.Tensor, dim: int, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The ``(start, length)`` ranges of ``x`` along ``dim``, concatenated (a new tensor)."""
    parts = [x.narrow(dim, start, length) for start, length in ranges]
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0].contiguous()


def restore_order(
    shards: torch.Tensor, dim: int, members: list[tuple[int, int]], sharding: SequenceSharding
) -> torch.Tensor:
    """Inverse of sharding: ``shards`` holds the shards of the ``(head, context)`` ranks
    ``members`` one after another along ``dim``; returns the sequence in global order."""
    segments: list[tuple[int, int, int]] = []  # (global start, offset in shards, length)
    offset = 0
    for head, context in members:
        for start, length in sharding.ranges(head, context):
            segments.append((start, offset, length))
            offset += length
    segments.sort()
    return take_ranges(shards, dim, [(off, n) for _, off, n in segments])
