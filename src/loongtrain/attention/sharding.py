"""Zigzag sequence sharding over the sequence-parallel group (causal load balance).

The sequence is cut into ``2*cp`` equal chunks; context index ``c`` owns chunks ``c``
and ``2*cp - 1 - c`` (its "zigzag content", ``S/cp`` tokens). The head all-to-all gathers
sequence pieces in head order, so before it the rank with coordinates ``(h, c)`` holds the
``h``-th of ``hp`` equal contiguous pieces of that content. The index maps are pure
functions; ``shard_sequence`` / ``unshard_sequence`` apply them to tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loongtrain.attention.comm import all_gather_flat
from loongtrain.attention.schedule import zigzag_chunks
from loongtrain.parallel.layout import check_sequence_length  # the rule lives with the layout (pure)

if TYPE_CHECKING:
    from loongtrain.parallel.state import ParallelState


def shard_ranges(seq_len: int, hp: int, cp: int, head: int, context: int) -> list[tuple[int, int]]:
    """Global ``(start, length)`` token ranges held by rank ``(head, context)``, in order.

    At most two ranges (a piece can straddle the two zigzag chunks when ``hp`` is odd).
    """
    check_sequence_length(seq_len, hp, cp)
    chunk = seq_len // (2 * cp)
    piece = seq_len // (hp * cp)
    first, second = zigzag_chunks(context, cp)
    lo, hi = head * piece, (head + 1) * piece  # offsets inside the 2*chunk content
    ranges: list[tuple[int, int]] = []
    if lo < chunk:
        ranges.append((first * chunk + lo, min(hi, chunk) - lo))
    if hi > chunk:
        start = max(lo, chunk) - chunk
        ranges.append((second * chunk + start, hi - max(lo, chunk)))
    return ranges


def shard_positions(seq_len: int, hp: int, cp: int, head: int, context: int) -> list[int]:
    """Global token positions held by rank ``(head, context)``, in local order."""
    return [p for s, n in shard_ranges(seq_len, hp, cp, head, context) for p in range(s, s + n)]


def take_ranges(x: torch.Tensor, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The ``(start, length)`` ranges of ``x`` along ``dim``, concatenated (a new tensor)."""
    parts = [x.narrow(dim, start, length) for start, length in ranges]
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0].contiguous()


def restore_order(shards: torch.Tensor, dim: int, members: list[tuple[int, int]], hp: int, cp: int) -> torch.Tensor:
    """Inverse of sharding: ``shards`` holds the shards of the ``(head, context)`` ranks
    ``members`` one after another along ``dim``; returns the sequence in global order."""
    seq_len = shards.shape[dim]
    segments: list[tuple[int, int, int]] = []  # (global start, offset in shards, length)
    offset = 0
    for head, context in members:
        for start, length in shard_ranges(seq_len, hp, cp, head, context):
            segments.append((start, offset, length))
            offset += length
    segments.sort()
    return take_ranges(shards, dim, [(off, n) for _, off, n in segments])


def _normalize_dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def shard_sequence(x: torch.Tensor, state: ParallelState, dim: int = 1) -> torch.Tensor:
    """Return this rank's zigzag shard of the full-sequence tensor ``x`` along ``dim``.

    ``x`` must be the same full tensor on every rank of the sequence-parallel group
    (inputs, labels and RoPE position ids are all sharded with this function). The
    result is a new contiguous tensor of length ``S / sp`` along ``dim``.
    """
    dim = _normalize_dim(x, dim)
    coords = state.coords
    return take_ranges(
        x, dim, shard_ranges(x.shape[dim], state.config.hp, state.config.cp, coords.head, coords.context)
    )


def unshard_sequence(x_local: torch.Tensor, state: ParallelState, dim: int = 1) -> torch.Tensor:
    """Gather the shards of the sp group and return the full sequence in original order.

    Every rank of the sequence-parallel group receives the full tensor. Collective over
    the sp group (all ranks must call it); not differentiable (for evaluation and tests).
    """
    dim = _normalize_dim(x_local, dim)
    layout = state.layout
    local_len = x_local.shape[dim]
    check_sequence_length(local_len * layout.sp, layout.hp, layout.cp)
    moved = x_local.detach().movedim(dim, 0).contiguous()
    if state.sp_group is None:
        gathered = moved
    else:
        gathered = moved.new_empty((layout.sp * local_len, *moved.shape[1:]))
        all_gather_flat(gathered, moved, group=state.sp_group)
    members = [(c.head, c.context) for c in map(layout.coords, layout.sp_group(state.rank))]
    return restore_order(gathered, 0, members, layout.hp, layout.cp).movedim(0, dim).contiguous()
