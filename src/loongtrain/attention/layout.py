"""How one global sequence lies on the sequence-parallel group: :class:`SequenceLayout`.

A layout is made once per batch (:func:`sequence_layout`) from the sequence length, the
degrees and balance of a :class:`~loongtrain.parallel.ParallelConfig`, and the document
boundaries ``cu_seqlens`` (validated here, and only here). It holds what every later stage
needs, worked out once: the sharding (which tokens each rank holds), the boundaries as a
tuple and as a CPU tensor, and the attention's mask plans. ``shard_sequence``,
``head_context_attention`` and ``unshard_sequence`` all take the same layout, and the
balance is the state's, so shards and attention cannot disagree about how the sequence
was cut.

The attention's custom ops receive the boundaries as a tensor (so ``torch.compile`` sees a
tensor, not a Python object, per batch) and find the same layout again in the one cache
below, keyed by ``(seq_len, hp, cp, balance, boundaries)``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from loongtrain.attention.comm import all_gather_flat
from loongtrain.attention.documents import Boundaries, as_boundaries
from loongtrain.attention.mask_plan import MAX_BAND_TILE, MaskPlan
from loongtrain.attention.sharding import SequenceSharding, restore_order, sequence_sharding, take_ranges
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.layout import check_sequence_length

if TYPE_CHECKING:
    from loongtrain.parallel.state import ParallelState

#: Layouts kept (a step uses one per microbatch; evaluation a few more).
CACHE_SIZE = 64


@dataclass(frozen=True, eq=False)
class SequenceLayout:
    """One global sequence of ``seq_len`` tokens on ``hp x cp`` ranks: its documents and the
    balance that cut its shards. Build it with :func:`sequence_layout`; read-only."""

    seq_len: int
    hp: int
    cp: int
    balance: str
    boundaries: Boundaries | None  # validated document boundaries (0, ..., seq_len), None: one sequence
    sharding: SequenceSharding = field(repr=False)
    cu_seqlens: torch.Tensor | None = field(repr=False)  # the boundaries as a CPU int64 tensor (the ops' argument)
    _plans: dict = field(default_factory=dict, repr=False)

    @property
    def sp(self) -> int:
        return self.hp * self.cp

    def ranges(self, head: int, context: int) -> list[tuple[int, int]]:
        """Global ``(start, length)`` token ranges of rank ``(head, context)``, in local order."""
        return self.sharding.ranges(head, context)

    def mask_plan(self, causal: bool, sliding_window: int | None, band_tile: int = MAX_BAND_TILE) -> MaskPlan:
        """The ring's kernel calls under this layout's documents and ``sliding_window`` (cached;
        a window as long as the sequence is none), band calls in row tiles of ``band_tile`` (0:
        untiled, for kernels that take a window). For one zigzag document they are the plain
        causal (or full) ring's: one kernel per block."""
        sliding = sliding_window if sliding_window and sliding_window < self.seq_len else None
        key = (causal, sliding, band_tile if sliding else MAX_BAND_TILE)
        if key not in self._plans:
            self._plans[key] = MaskPlan(self.sharding, self.boundaries or (0, self.seq_len), causal, sliding, key[2])
        return self._plans[key]

    def check_matches(self, config: ParallelConfig, seq_len: int, where: str) -> None:
        """Raise ValueError unless this layout was made for ``config``'s degrees and balance and
        a sequence of ``seq_len`` tokens (a layout of another state or batch)."""
        mine = (self.hp, self.cp, self.balance, self.seq_len)
        theirs = (config.hp, config.cp, config.balance, seq_len)
        if mine != theirs:
            raise ValueError(
                f"{where}: the layout was made for hp={self.hp}, cp={self.cp}, balance={self.balance!r}, "
                f"S={self.seq_len} but is used with hp={config.hp}, cp={config.cp}, balance={config.balance!r}, "
                f"S={seq_len}; make it with sequence_layout(S, state, cu_seqlens) for the state and batch it serves"
            )


_CACHE: OrderedDict[tuple, SequenceLayout] = OrderedDict()


def _config(state_or_config) -> ParallelConfig:
    if state_or_config is None:
        return ParallelConfig()
    return state_or_config if isinstance(state_or_config, ParallelConfig) else state_or_config.config


def _cached(key: tuple) -> SequenceLayout | None:
    found = _CACHE.get(key)
    if found is not None:
        _CACHE.move_to_end(key)
    return found


def _build(seq_len: int, config: ParallelConfig, boundaries: Boundaries | None) -> SequenceLayout:
    key = (seq_len, config.hp, config.cp, config.balance, boundaries)
    layout = _cached(key)
    if layout is None:
        cu = None if boundaries is None else torch.tensor(boundaries, dtype=torch.int64)
        sharding = sequence_sharding(seq_len, config.hp, config.cp, boundaries, config.balance)
        layout = SequenceLayout(seq_len, config.hp, config.cp, config.balance, boundaries, sharding, cu)
        _CACHE[key] = layout
        if len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return layout


def sequence_layout(
    seq_len: int,
    state=None,
    cu_seqlens: torch.Tensor | Sequence[int] | None = None,
) -> SequenceLayout:
    """The layout of a global sequence of ``seq_len`` tokens on ``state`` (a ``ParallelState``
    or ``ParallelConfig``; None: one device), with packed documents ``cu_seqlens``
    (``[0, ..., S]``, FlashAttention's varlen convention, the same on every rank; None: one
    sequence). Validates everything here, before any communication; cached."""
    config = _config(state)
    if config.sp > 1:
        check_sequence_length(seq_len, config.hp, config.cp)
    return _build(seq_len, config, as_boundaries(cu_seqlens, seq_len))


def layout_of_op(config: ParallelConfig, seq_len: int, cu_seqlens: torch.Tensor | None) -> SequenceLayout:
    """The layout an attention op was called with (its boundaries tensor): the cached value
    the caller made, found again without validating; built and validated on a cache miss."""
    boundaries = None if cu_seqlens is None else tuple(cu_seqlens.tolist())
    found = _cached((seq_len, config.hp, config.cp, config.balance, boundaries))
    return found if found is not None else sequence_layout(seq_len, config, boundaries)


def _normalize_dim(x: torch.Tensor, dim: int) -> int:
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def check_layout(state: ParallelState, seq_len: int, layout: SequenceLayout | None, where: str) -> None:
    """Raise unless ``layout`` (None: one plain sequence) can serve ``state`` and ``seq_len``.

    Under ``balance="documents"`` or ``"locality"`` the layout must be given: shards cut by a
    batch's documents and an attention (or unsharding) that assumed one document would disagree.
    """
    if layout is None:
        if state.config.balance != "zigzag":
            raise ValueError(
                f"{where}: balance={state.config.balance!r} lays each batch out by its document boundaries; pass "
                f"layout=sequence_layout(S, state, cu_seqlens) (the same one to shard_sequence, "
                f"head_context_attention and unshard_sequence)"
            )
        return
    if not isinstance(layout, SequenceLayout):
        raise TypeError(f"{where}: layout must be a SequenceLayout (from sequence_layout), got {type(layout).__name__}")
    layout.check_matches(state.config, seq_len, where)


def layout_for(state: ParallelState, seq_len: int, layout: SequenceLayout | None, where: str) -> SequenceLayout:
    """``layout`` checked against ``state`` and ``seq_len`` (:func:`check_layout`), or the layout
    of one plain sequence."""
    check_layout(state, seq_len, layout, where)
    return layout if layout is not None else sequence_layout(seq_len, state)


def shard_sequence(
    x: torch.Tensor, state: ParallelState, dim: int = 1, layout: SequenceLayout | None = None
) -> torch.Tensor:
    """Return this rank's shard of the full-sequence tensor ``x`` along ``dim``.

    ``x`` must be the same full tensor on every rank of the sequence-parallel group
    (inputs, labels and RoPE position ids are all sharded with this function). The
    result is a new contiguous tensor of length ``S / sp`` along ``dim``. ``layout``
    (from :func:`sequence_layout`) carries packed documents and the state's balance; pass
    the same one to :func:`~loongtrain.attention.head_context.head_context_attention` and
    :func:`unshard_sequence`. None: one causal sequence (not allowed under
    a document balance).
    """
    dim = _normalize_dim(x, dim)
    layout = layout_for(state, x.shape[dim], layout, "shard_sequence")
    coords = state.coords
    return take_ranges(x, dim, layout.ranges(coords.head, coords.context))


def unshard_sequence(
    x_local: torch.Tensor, state: ParallelState, dim: int = 1, layout: SequenceLayout | None = None
) -> torch.Tensor:
    """Gather the shards of the sp group and return the full sequence in original order.

    Every rank of the sequence-parallel group receives the full tensor. Collective over
    the sp group (all ranks must call it); not differentiable (for evaluation and tests).
    ``layout`` must be the one the shards were made with.
    """
    dim = _normalize_dim(x_local, dim)
    rank_layout = state.layout
    local_len = x_local.shape[dim]
    layout = layout_for(state, local_len * rank_layout.sp, layout, "unshard_sequence")
    moved = x_local.detach().movedim(dim, 0).contiguous()
    if state.sp_group is None:
        gathered = moved
    else:
        gathered = moved.new_empty((rank_layout.sp * local_len, *moved.shape[1:]))
        all_gather_flat(gathered, moved, group=state.sp_group)
    members = [(c.head, c.context) for c in map(rank_layout.coords, rank_layout.sp_group(state.rank))]
    return restore_order(gathered, 0, members, layout.sharding).movedim(0, dim).contiguous()
