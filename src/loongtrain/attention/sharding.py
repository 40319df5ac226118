"""Sequence sharding over the sequence-parallel group: which tokens each rank holds.

Every context index ``c`` holds ``S/cp`` tokens, its *content*: equal-length chunks of
the global sequence in ascending order. ``balance="zigzag"`` cuts the sequence into
``2*cp`` chunks and gives ``c`` chunks ``c`` and ``2*cp - 1 - c`` (causal load balance
for one document); ``balance="documents"`` takes the document-aware assignment of
:mod:`loongtrain.attention.balance` computed from ``cu_seqlens``. The head all-to-all
gathers sequence pieces in head order, so before it the rank with coordinates ``(h, c)``
holds the ``h``-th of ``hp`` equal contiguous pieces of that content.

That gives one permutation of token positions for the whole sp group; inputs, labels and
RoPE position ids are all sharded with it, and the attention derives its masks from the
same map. The maps are pure functions; ``shard_sequence`` / ``unshard_sequence`` apply
them to tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loongtrain.attention.balance import balance_documents
from loongtrain.attention.comm import all_gather_flat
from loongtrain.attention.documents import Boundaries, as_boundaries
from loongtrain.attention.schedule import zigzag_chunks
from loongtrain.options import BALANCES
from loongtrain.parallel.layout import check_sequence_length  # the rule lives with the layout (pure)

if TYPE_CHECKING:
    from loongtrain.parallel.state import ParallelState


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

    def positions(self, head: int, context: int) -> list[int]:
        """Global token positions held by rank ``(head, context)``, in local order."""
        return [p for s, n in self.ranges(head, context) for p in range(s, s + n)]


@functools.lru_cache(maxsize=64)
def zigzag_sharding(seq_len: int, hp: int, cp: int) -> SequenceSharding:
    """Context index ``c`` holds chunks ``c`` and ``2*cp - 1 - c`` of ``2*cp``."""
    check_sequence_length(seq_len, hp, cp)
    chunk = seq_len // (2 * cp)
    content = tuple(tuple((i * chunk, chunk) for i in zigzag_chunks(c, cp)) for c in range(cp))
    return SequenceSharding(seq_len, hp, cp, content, "zigzag")


@functools.lru_cache(maxsize=64)
def _sharding(seq_len: int, hp: int, cp: int, boundaries: Boundaries | None, balance: str) -> SequenceSharding:
    check_balance(balance)
    if balance == "zigzag" or cp == 1:
        return zigzag_sharding(seq_len, hp, cp)
    check_sequence_length(seq_len, hp, cp)
    found = balance_documents(seq_len, cp, boundaries or (0, seq_len))
    return SequenceSharding(seq_len, hp, cp, found.chunks, "documents")


def sequence_sharding(
    seq_len: int,
    hp: int,
    cp: int,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    balance: str = "zigzag",
) -> SequenceSharding:
    """The sharding for ``balance`` (``"zigzag"`` or ``"documents"``); pure and cached.

    ``"documents"`` assigns chunks from the document boundaries ``cu_seqlens`` (``None``:
    one document); ``"zigzag"`` ignores them.
    """
    check_balance(balance)
    check_sequence_length(seq_len, hp, cp)
    boundaries = as_boundaries(cu_seqlens, seq_len)  # validated even where the balance ignores it
    return _sharding(seq_len, hp, cp, boundaries if balance == "documents" else None, balance)


def shard_ranges(seq_len: int, hp: int, cp: int, head: int, context: int) -> list[tuple[int, int]]:
    """Zigzag ``(start, length)`` ranges held by rank ``(head, context)``, in order.

    At most two ranges (a piece can straddle the two zigzag chunks when ``hp`` is odd).
    """
    return zigzag_sharding(seq_len, hp, cp).ranges(head, context)


def shard_positions(seq_len: int, hp: int, cp: int, head: int, context: int) -> list[int]:
    """Zigzag global token positions held by rank ``(head, context)``, in local order."""
    return zigzag_sharding(seq_len, hp, cp).positions(head, context)


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


def _normalize_dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def shard_sequence(
    x: torch.Tensor,
    state: ParallelState,
    dim: int = 1,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    balance: str | None = None,
) -> torch.Tensor:
    """Return this rank's shard of the full-sequence tensor ``x`` along ``dim``.

    ``x`` must be the same full tensor on every rank of the sequence-parallel group
    (inputs, labels and RoPE position ids are all sharded with this function). The
    result is a new contiguous tensor of length ``S / sp`` along ``dim``.
    ``balance="documents"`` assigns tokens from the document boundaries ``cu_seqlens``
    (see :mod:`loongtrain.attention.balance`); ``None`` takes ``state.config.balance``.
    Pass the same ``cu_seqlens`` and ``balance`` to :func:`head_context_attention` and
    :func:`unshard_sequence`.
    """
    dim = _normalize_dim(x, dim)
    coords = state.coords
    sharding = sequence_sharding(x.shape[dim], state.hp, state.cp, cu_seqlens, balance or state.config.balance)
    return take_ranges(x, dim, sharding.ranges(coords.head, coords.context))


def unshard_sequence(
    x_local: torch.Tensor,
    state: ParallelState,
    dim: int = 1,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    balance: str | None = None,
) -> torch.Tensor:
    """Gather the shards of the sp group and return the full sequence in original order.

    Every rank of the sequence-parallel group receives the full tensor. Collective over
    the sp group (all ranks must call it); not differentiable (for evaluation and tests).
    ``cu_seqlens``/``balance`` must be those the shards were made with.
    """
    dim = _normalize_dim(x_local, dim)
    layout = state.layout
    local_len = x_local.shape[dim]
    sharding = sequence_sharding(
        local_len * layout.sp, layout.hp, layout.cp, cu_seqlens, balance or state.config.balance
    )
    moved = x_local.detach().movedim(dim, 0).contiguous()
    if state.sp_group is None:
        gathered = moved
    else:
        gathered = moved.new_empty((layout.sp * local_len, *moved.shape[1:]))
        all_gather_flat(gathered, moved, group=state.sp_group)
    members = [(c.head, c.context) for c in map(layout.coords, layout.sp_group(state.rank))]
    return restore_order(gathered, 0, members, sharding).movedim(0, dim).contiguous()
