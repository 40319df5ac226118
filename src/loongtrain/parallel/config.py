"""The user-facing description of a parallel layout: ``ParallelConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from loongtrain.options import BALANCES, CONTEXT_ORDERS, PLACEMENTS, Balance, ContextOrder, Placement, option


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ParallelConfig: {name}={value!r} must be a positive integer")


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees and placement of the 2D (head x context) sequence parallelism.

    The world is ``dp x hp x cp`` ranks, data parallel outermost. The ``sp = hp * cp``
    ranks of one replica are consecutive global ranks. The context group of ``cp`` ranks
    is split into ``n_ring_windows = cp // ring_window`` windows (inner rings) of ``ring_window``
    ranks joined by an outer ring (Double-Ring-Attention); ``ring_window=1`` and
    ``ring_window=cp`` are a plain ring.

    Each field's help says what it holds (the ``[parallel]`` keys of a training config are
    made from these fields); ``balance`` is also the default layout of ``shard_sequence``,
    ``unshard_sequence`` and ``head_context_attention``.
    """

    hp: int = option(1, "head-parallel degree (Ulysses all-to-all group)", bound="positive")
    cp: int = option(1, "context-parallel degree (ring group)", bound="positive")
    ring_window: int = option(
        1, "Double-Ring-Attention inner ring size; divides cp (1 or cp: plain ring)", bound="positive"
    )
    placement: Placement = option(
        "head_first",
        "rank placement: head_first (a head group on consecutive ranks, the context group strided by hp) or "
        "context_first (the reverse)",
        choices=PLACEMENTS,
    )
    dp: int | None = option(
        None, "data-parallel degree (0 in a config, None here: world size // (hp*cp))", bound="positive", none_as=0
    )
    context_order: ContextOrder = option(
        "contiguous",
        "ring window membership in the context group: contiguous (windows of consecutive members) or "
        "interleaved (window o takes every n-th member, n = cp // ring_window)",
        choices=CONTEXT_ORDERS,
    )
    balance: Balance = option(
        "zigzag",
        "sequence layout over the sp group: zigzag (balanced for one document), documents (from each packed "
        "batch) or locality (documents whole or on runs of adjacent ranks: the ring carries only what they need)",
        choices=BALANCES,
    )

    def __post_init__(self) -> None:
        _check_positive_int("hp", self.hp)
        _check_positive_int("cp", self.cp)
        _check_positive_int("ring_window", self.ring_window)
        if self.dp is not None:
            _check_positive_int("dp", self.dp)
        if self.cp % self.ring_window != 0:
            divisors = [d for d in range(1, self.cp + 1) if self.cp % d == 0]
            raise ValueError(
                f"ParallelConfig: cp={self.cp} is not divisible by ring_window={self.ring_window}; "
                f"choose ring_window among the divisors of cp: {divisors}"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(f"ParallelConfig: unknown placement={self.placement!r}; use one of {list(PLACEMENTS)}")
        if self.balance not in BALANCES:
            raise ValueError(f"ParallelConfig: unknown balance={self.balance!r}; use one of {list(BALANCES)}")
        if self.context_order not in CONTEXT_ORDERS:
            raise ValueError(
                f"ParallelConfig: unknown context_order={self.context_order!r}; use one of {list(CONTEXT_ORDERS)}"
            )

    @property
    def sp(self) -> int:
        """Sequence-parallel degree ``hp * cp``."""
        return self.hp * self.cp

    @property
    def n_ring_windows(self) -> int:
        """Number of ring windows (the outer ring's size), ``cp // ring_window``."""
        return self.cp // self.ring_window

    def resolve_dp(self, world_size: int) -> int:
        """Return the data-parallel degree for ``world_size``, checking the product."""
        _check_positive_int("world_size", world_size)
        sp = self.sp
        if self.dp is None:
            if world_size % sp != 0:
                raise ValueError(
                    f"ParallelConfig: world size {world_size} is not divisible by "
                    f"sp = hp*cp = {self.hp}*{self.cp} = {sp}; choose hp and cp whose "
                    f"product divides {world_size}, or launch a multiple of {sp} ranks"
                )
            return world_size // sp
        if self.dp * sp != world_size:
            raise ValueError(
                f"ParallelConfig: dp*hp*cp = {self.dp}*{self.hp}*{self.cp} = "
                f"{self.dp * sp} does not equal the world size {world_size}; set dp=None "
                f"to derive it, or change the degrees so that they multiply to {world_size}"
            )
        return self.dp
