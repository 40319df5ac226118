"""Double-Ring-Attention over the context group (zigzag, causal load balanced).

The context group of ``cp`` ranks is cut into ``n = cp // ring_window`` ring windows. For each
outer step ``j`` a rank first holds the key/value block that arrived over the outer ring
(from the same position of the previous window), then passes blocks around its inner
ring for ``ring_window`` steps. The outer transfer for step ``j+1`` starts at the beginning of
step ``j`` and hides behind ``ring_window`` block computations; each inner transfer hides
behind one. ``ring_window == 1`` (outer ring only) and ``ring_window == cp`` (inner ring
only) are the plain ring.

Backward replays the same KV movement. Key/value gradients accumulate around the inner
ring (one hop behind their block), arrive at their inner-ring position after the last inner
hop, are added to what the previous ring windows accumulated (which came over the outer ring
while the inner loop ran) and hop the outer ring; after the last outer step they are
home. Query gradients accumulate locally in fp32.

Under a document / sliding-window mask (``RingSetup.masks``) each step runs the calls of its
(query block, key/value block) pair from the pure :class:`MaskPlan`; a pair with nothing
visible runs no kernel (``*.block_skipped`` in ``state.stats``; ``*.step_skipped`` when
the step is empty for every rank of the context group). Transfers always run: a block
still travels on to the ranks that need it later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongtrain.attention.blocks import (
    BlockWork,
    OutputAccumulator,
    accum_dtype,
    add_kv_grads,
    backward_work,
    forward_work,
)
from loongtrain.attention.comm import Pending, Ready, ring_exchange
from loongtrain.attention.kernels import block_backward
from loongtrain.attention.mask_plan import MaskPlan
from loongtrain.attention.schedule import BlockKind, block_kind, ring_source
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.state import ParallelState, RingLink
from loongtrain.parallel.stats import AttentionStats

Tensor = torch.Tensor


@dataclass(frozen=True)
class RingSetup:
    """What one rank needs to run the double ring: its index, the rings, the options."""

    context: int
    config: ParallelConfig  # the degrees: cp, ring_window, n_ring_windows
    inner: RingLink | None
    outer: RingLink | None
    causal: bool
    scale: float
    stats: AttentionStats
    masks: MaskPlan | None = None  # document / sliding-window mask; None: plain causal or full zigzag ring
    sliding_window: int | None = None

    @classmethod
    def from_state(
        cls,
        state: ParallelState,
        *,
        causal: bool,
        scale: float,
        masks: MaskPlan | None = None,
        sliding_window: int | None = None,
    ) -> RingSetup:
        return cls(
            context=state.coords.context,
            config=state.config,
            inner=state.inner_ring,
            outer=state.outer_ring,
            causal=causal,
            scale=scale,
            stats=state.stats,
            masks=masks,
            sliding_window=sliding_window,
        )

    def work(self, outer_step: int, inner_step: int) -> BlockWork:
        """The block work at step ``(outer_step, inner_step)``."""
        src = ring_source(self.context, self.config, outer_step, inner_step)
        if self.masks is None:
            return block_kind(src, self.context, self.causal)
        return self.masks.calls(self.context, src)

    def count(self, phase: str, ran: bool, outer_step: int, inner_step: int) -> None:
        if ran:
            self.stats.add(f"{phase}.block")
            return
        self.stats.add(f"{phase}.block_skipped")
        if (outer_step, inner_step) in self.masks.empty_steps(self.config):
            self.stats.add(f"{phase}.step_skipped")

    def exchange(self, tensor: Tensor, inner: bool, kind: str, dkv: bool = False) -> Pending:
        link = self.inner if inner else self.outer
        return ring_exchange(tensor, link, self.stats, kind, dkv=dkv)


def ring_forward(plan: RingSetup, q: Tensor, kv: Tensor) -> tuple[Tensor, Tensor]:
    """Attention of the local ``q`` [B, Sc, H, d] over the whole context group.

    ``kv`` is [2, B, Sc, G, d]. Returns ``out`` (q's dtype) and fp32 ``lse`` [B, Sc, H].
    """
    n, w = plan.config.n_ring_windows, plan.config.ring_window
    acc = OutputAccumulator(q)
    base = kv
    for j in range(n):
        outer = plan.exchange(base, inner=False, kind="fwd.ring_kv") if j + 1 < n else None
        cur = base
        for s in range(w):
            inner = plan.exchange(cur, inner=True, kind="fwd.ring_kv") if s + 1 < w else None
            ran = forward_work(q, cur, plan.work(j, s), plan.causal, plan.sliding_window, plan.scale, acc)
            plan.count("fwd", ran, j, s)
            if inner is not None:
                cur = inner.wait()
        if outer is not None:
            base = outer.wait()
    return acc.result(q.dtype)


def ring_backward(
    plan: RingSetup, dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Gradients ``(dq, dkv)`` of :func:`ring_forward`, in the dtypes of ``q`` and ``kv``.

    One rank of context (``cp == 1``) without a mask is one kernel call, whose gradients are
    the result: no fp32 accumulators (they would hold the same values).
    """
    n, w = plan.config.n_ring_windows, plan.config.ring_window
    if n * w == 1 and (work := plan.work(0, 0)) in (BlockKind.DIAGONAL, BlockKind.FULL):
        plan.count("bwd", True, 0, 0)
        causal = work is BlockKind.DIAGONAL
        return block_backward(dout, q, kv[0], kv[1], out, lse, causal=causal, scale=plan.scale, stacked=True)
    dq = torch.zeros(q.shape, dtype=accum_dtype(q.dtype), device=q.device)
    base = kv
    tail: tuple[int, Pending] | None = None  # (outer step, its window total in flight)
    outer_in: Pending | None = None  # gradient sum of earlier windows for the next block
    inner_dkv: Pending | None = None
    for j in range(n):
        outer_kv = plan.exchange(base, inner=False, kind="bwd.ring_kv") if j + 1 < n else None
        cur = base
        for s in range(w):
            inner_kv = plan.exchange(cur, inner=True, kind="bwd.ring_kv") if s + 1 < w else None
            grads = backward_work(
                dout, q, cur, out, lse, plan.work(j, s), plan.causal, plan.sliding_window, plan.scale, dq
            )
            plan.count("bwd", bool(grads), j, s)
            if s == 0:
                partial = torch.zeros(kv.shape, dtype=accum_dtype(kv.dtype), device=kv.device)
            else:
                partial = inner_dkv.wait()
            add_kv_grads(partial, grads)
            if tail is not None:  # finish the previous outer step behind this block's compute
                outer_in = _finish_outer_step(plan, *tail, outer_in)
                tail = None
            if w > 1:
                # For s == w-1 this hop brings each block's window total to its position.
                inner_dkv = plan.exchange(partial, inner=True, kind="bwd.ring_dkv", dkv=True)
            if inner_kv is not None:
                cur = inner_kv.wait()
        tail = (j, inner_dkv if w > 1 else Ready(partial))
        if outer_kv is not None:
            base = outer_kv.wait()
    dkv = _finish_outer_step(plan, *tail, outer_in).wait()
    return dq.to(q.dtype), dkv.to(kv.dtype)


def _finish_outer_step(plan: RingSetup, j: int, window_total: Pending, outer_in: Pending | None) -> Pending:
    """Add earlier ring windows' sum to this ring window's and pass it on the outer ring.

    At outer step ``j`` window ``o`` worked on the blocks of window ``o - j``; the
    returned transfer carries this rank's block total to window ``o + 1`` and receives
    the next one (after the last step: this rank's own, complete gradient).
    """
    total = window_total.wait()
    if j > 0:
        total += outer_in.wait()
    if plan.config.n_ring_windows == 1:
        return Ready(total)
    return plan.exchange(total, inner=False, kind="bwd.ring_dkv", dkv=True)
