"""Double-Ring-Attention over the context group (causal load balanced by the sequence layout:
zigzag, or the ``documents`` / ``locality`` balance).

The context group of ``cp`` ranks is cut into ``n = cp // ring_window`` ring windows. For each
outer step ``j`` a rank first holds the key/value block that arrived over the outer ring
(from the same position of the previous window), then passes blocks around its inner
ring for ``ring_window`` steps. The outer transfer for step ``j+1`` starts at the beginning of
step ``j`` and hides behind ``ring_window`` block computations; each inner transfer hides
behind one. ``ring_window == 1`` (outer ring only) and ``ring_window == cp`` (inner ring
only) are the plain ring.

Backward replays the same KV movement. Query gradients accumulate locally in fp32; a
key/value block's gradient stays with its owner for its own queries, and the other ranks
that read it pass one float32 partial per ring window along their chain and send the
window's total to the owner (:mod:`~loongtrain.attention.routes`).

Each step runs the calls of its (query block, key/value block) pair from the layout's pure
:class:`MaskPlan` (``RingSetup.masks``): for one zigzag document, the plain causal ring's one
kernel per block; under documents or a sliding window, a pair with nothing visible runs no
kernel (``*.block_skipped`` in ``state.stats``; ``*.step_skipped`` when
the step is empty for every rank of the context group). Transfers follow the mask's
routes: a block travels only as far as its farthest reader, a partial only between ranks
that read the block, so a microbatch whose documents each lie on one rank sends nothing.

A sliding window whose halo (:mod:`~loongtrain.attention.halo`) moves fewer key/value columns
than these routes runs :func:`halo_forward` / :func:`halo_backward` instead: each block's
columns that another rank's window reaches go straight to it, and their dK/dV straight back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from loongtrain.attention.blocks import (
    BlockWork,
    OutputAccumulator,
    accum_dtype,
    add_kv_grads,
    backward_work,
    forward_work,
    whole_block,
)
from loongtrain.attention.comm import Pending, post_p2p, ring_exchange
from loongtrain.attention.halo import HaloPlan
from loongtrain.attention.kernels import block_backward
from loongtrain.attention.mask_plan import MaskPlan
from loongtrain.attention.routes import RingRoutes
from loongtrain.attention.schedule import ring_source
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
    masks: MaskPlan  # the kernel calls of every block pair under the layout's documents and window
    sliding_window: int | None = None
    dkv_group: dist.ProcessGroup | None = None  # the context group's dK/dV communicator
    context_ranks: tuple[int, ...] = ()  # global rank of each context index

    @property
    def routes(self) -> RingRoutes:
        """Which transfers this call makes (every one for a document that spans the ring)."""
        return self.masks.routes(self.config)

    @classmethod
    def from_state(
        cls,
        state: ParallelState,
        *,
        causal: bool,
        scale: float,
        masks: MaskPlan,
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
            dkv_group=state.dkv_group,
            context_ranks=state.context_ranks,
        )

    @property
    def halo(self) -> HaloPlan | None:
        """The halo a sliding window exchanges instead of the ring (None: the ring)."""
        return self.masks.halo(self.config)

    def work(self, outer_step: int, inner_step: int) -> BlockWork:
        """The block work at step ``(outer_step, inner_step)``."""
        return self.masks.calls(self.context, ring_source(self.context, self.config, outer_step, inner_step))

    def count(self, phase: str, ran: bool, outer_step: int, inner_step: int) -> None:
        if ran:
            self.stats.add(f"{phase}.block")
            return
        self.stats.add(f"{phase}.block_skipped")
        if (outer_step, inner_step) in self.masks.empty_steps(self.config):
            self.stats.add(f"{phase}.step_skipped")

    def exchange_kv(self, block: Tensor | None, hop, inner: bool, kind: str, like: Tensor) -> Pending:
        """Send ``block`` on (if ``hop.send``) and receive the next one (if ``hop.recv``)."""
        link = self.inner if inner else self.outer
        return ring_exchange(block if hop.send else None, link, self.stats, kind, recv=hop.recv, like=like)


def ring_forward(plan: RingSetup, q: Tensor, kv: Tensor) -> tuple[Tensor, Tensor]:
    """Attention of the local ``q`` [B, Sc, H, d] over the whole context group.

    ``kv`` is [2, B, Sc, G, d]. Returns ``out`` (q's dtype) and fp32 ``lse`` [B, Sc, H].
    """
    if (halo := plan.halo) is not None:
        return halo_forward(plan, halo, q, kv)
    n, w = plan.config.n_ring_windows, plan.config.ring_window
    routes, c = plan.routes, plan.context
    acc = OutputAccumulator(q)
    base = kv
    for j in range(n):
        outer = plan.exchange_kv(base, routes.kv_outer(c, j), False, "fwd.ring_kv", kv) if j + 1 < n else None
        cur = base
        for s in range(w):
            inner = plan.exchange_kv(cur, routes.kv_inner(c, j, s), True, "fwd.ring_kv", kv) if s + 1 < w else None
            work = plan.work(j, s) if cur is not None else ()
            ran = forward_work(q, cur, work, plan.causal, plan.sliding_window, plan.scale, acc)
            plan.count("fwd", ran, j, s)
            if inner is not None:
                cur = inner.wait()
        if outer is not None:
            base = outer.wait()
    return acc.result(q.dtype)


class _Gradients:
    """The dK/dV side of one rank's backward: its own block's float32 gradient, the partials
    it passes on, and the window totals it receives (:mod:`~loongtrain.attention.routes`)."""

    def __init__(self, plan: RingSetup, kv: Tensor) -> None:
        self.plan, self.routes = plan, plan.routes
        self.own = torch.zeros(kv.shape, dtype=accum_dtype(kv.dtype), device=kv.device)
        self.partials: dict[int, Pending] = {}  # block -> partial of this window's earlier readers
        self.totals: list[tuple[int, Pending]] = []  # (slot posted, window total of the own block)
        self.sent: Pending | None = None  # the last transfers posted (their buffers stay alive until done)

    def step(self, slot: int, j: int, s: int, grads) -> None:
        """After the compute of step ``(j, s)``: add or pass on its gradient, post the slot's transfers."""
        plan, c = self.plan, self.plan.context
        role = self.routes.dkv_role(c, j, s)
        sends = []
        if role.owner:
            add_kv_grads(self.own, grads)
        elif role.writes:
            block = self.routes.source(c, j, s)
            partial = self.partials.pop(block).wait() if role.incoming else torch.zeros_like(self.own)
            add_kv_grads(partial, grads)
            sends.append((partial, plan.context_ranks[role.send_to]))
        arriving = self.routes.dkv_arrivals(c, slot)
        # a window's total is added once a window's compute has hidden it, or before a chain
        # partial is received (so at most one of the two buffers exists at a time)
        wait = 1 if any(not t.home for t in arriving) else plan.config.ring_window
        while self.totals and self.totals[0][0] + wait <= slot:
            self.own += self.totals.pop(0)[1].wait()
        if sends or arriving:
            if self.sent is not None:  # the previous slot's partial is delivered: its buffer goes
                self.sent.wait()
            peers = [plan.context_ranks[t.src] for t in arriving]
            works, buffers = post_p2p(sends, peers, self.own, plan.dkv_group, plan.stats, "bwd.ring_dkv")
            for t, buffer in zip(arriving, buffers):
                pending = Pending(works, buffer)
                if t.home:
                    self.totals.append((slot, pending))
                else:
                    self.partials[t.block] = pending
            self.sent = Pending(works, None)

    def result(self) -> Tensor:
        for _, pending in self.totals:
            self.own += pending.wait()
        if self.sent is not None:
            self.sent.wait()
        return self.own


def ring_backward(
    plan: RingSetup, dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Gradients ``(dq, dkv)`` of :func:`ring_forward`, in the dtypes of ``q`` and ``kv``.

    One rank of context (``cp == 1``) whose block is one unmasked call is that call, whose
    gradients are the result: no fp32 accumulators (they would hold the same values).
    """
    n, w = plan.config.n_ring_windows, plan.config.ring_window
    if n * w == 1 and (causal := whole_block(plan.work(0, 0), q.shape[1])) is not None:
        plan.count("bwd", True, 0, 0)
        return block_backward(dout, q, kv[0], kv[1], out, lse, causal=causal, scale=plan.scale, stacked=True)
    if (halo := plan.halo) is not None:
        return halo_backward(plan, halo, dout, q, kv, out, lse)
    routes, c = plan.routes, plan.context
    dq = torch.zeros(q.shape, dtype=accum_dtype(q.dtype), device=q.device)
    grads_of = _Gradients(plan, kv)
    base = kv
    for j in range(n):
        outer_kv = plan.exchange_kv(base, routes.kv_outer(c, j), False, "bwd.ring_kv", kv) if j + 1 < n else None
        cur = base
        for s in range(w):
            inner_kv = plan.exchange_kv(cur, routes.kv_inner(c, j, s), True, "bwd.ring_kv", kv) if s + 1 < w else None
            work = plan.work(j, s) if cur is not None else ()
            grads = backward_work(dout, q, cur, out, lse, work, plan.causal, plan.sliding_window, plan.scale, dq)
            plan.count("bwd", bool(grads), j, s)
            grads_of.step(j * w + s, j, s, grads)
            if inner_kv is not None:
                cur = inner_kv.wait()
        if outer_kv is not None:
            base = outer_kv.wait()
    return dq.to(q.dtype), grads_of.result().to(kv.dtype)


# -- the halo of a sliding window (:mod:`~loongtrain.attention.halo`) -----------------------
def _piece_shape(kv: Tensor, length: int) -> tuple[int, ...]:
    return (2, kv.shape[1], length, *kv.shape[3:])


def _columns(kv: Tensor, ranges) -> Tensor:
    """The columns ``ranges`` of ``kv`` [2, B, Sc, G, d], one after another."""
    parts = [kv[:, :, a:b] for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _exchange_halo(plan: RingSetup, halo: HaloPlan, kv: Tensor, kind: str):
    """Post this rank's columns to their readers and the receives of the pieces it reads;
    returns the transfers (wait them before reading) and ``(piece, buffer)`` per piece read."""
    c, ranks = plan.context, plan.context_ranks
    sends = [(_columns(kv, p.ranges), ranks[p.reader]) for p in halo.outgoing(c)]
    incoming = halo.incoming(c)
    works, buffers = post_p2p(
        sends, [ranks[p.owner] for p in incoming], kv, plan.dkv_group, plan.stats, kind,
        [_piece_shape(kv, p.length) for p in incoming],
    )  # fmt: skip
    return Pending(works, sends), list(zip(incoming, buffers))


def _count_halo(plan: RingSetup, phase: str, ran: int) -> None:
    for _ in range(ran):
        plan.stats.add(f"{phase}.block")
    for _ in range(plan.config.cp - ran):
        plan.stats.add(f"{phase}.block_skipped")


def halo_forward(plan: RingSetup, halo: HaloPlan, q: Tensor, kv: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`ring_forward` of a sliding window by its halo: the own block while the pieces
    other ranks' windows reach arrive, then each piece."""
    c, masks = plan.context, plan.masks
    transfers, pieces = _exchange_halo(plan, halo, kv, "fwd.ring_kv")
    acc = OutputAccumulator(q)
    ran = int(forward_work(q, kv, masks.calls(c, c), plan.causal, plan.sliding_window, plan.scale, acc))
    transfers.wait()
    for piece, buffer in pieces:
        work = piece.renumber(masks.calls(c, piece.owner))
        ran += forward_work(q, buffer, work, plan.causal, plan.sliding_window, plan.scale, acc)
    _count_halo(plan, "fwd", ran)
    return acc.result(q.dtype)


def halo_backward(
    plan: RingSetup, halo: HaloPlan, dout: Tensor, q: Tensor, kv: Tensor, out: Tensor, lse: Tensor
) -> tuple[Tensor, Tensor]:
    """:func:`ring_backward` by the halo: the pieces again, each reader's float32 dK/dV of a
    piece straight back to its owner, added into the owner's columns."""
    c, masks, ranks = plan.context, plan.masks, plan.context_ranks
    window, scale = plan.sliding_window, plan.scale
    transfers, pieces = _exchange_halo(plan, halo, kv, "bwd.ring_kv")
    dq = torch.zeros(q.shape, dtype=accum_dtype(q.dtype), device=q.device)
    own = torch.zeros(kv.shape, dtype=accum_dtype(kv.dtype), device=kv.device)
    grads = backward_work(dout, q, kv, out, lse, masks.calls(c, c), plan.causal, window, scale, dq)
    add_kv_grads(own, grads)
    ran = int(bool(grads))
    transfers.wait()
    partials = []
    for piece, buffer in pieces:
        work = piece.renumber(masks.calls(c, piece.owner))
        partial = own.new_zeros(_piece_shape(kv, piece.length))
        add_kv_grads(partial, backward_work(dout, q, buffer, out, lse, work, plan.causal, window, scale, dq))
        partials.append((partial, ranks[piece.owner]))
        ran += 1
    del pieces
    readers = halo.outgoing(c)
    works, buffers = post_p2p(
        partials, [ranks[p.reader] for p in readers], own, plan.dkv_group, plan.stats, "bwd.ring_dkv",
        [_piece_shape(kv, p.length) for p in readers],
    )  # fmt: skip
    Pending(works, None).wait()
    for piece, buffer in zip(readers, buffers):
        at = 0
        for a, b in piece.ranges:
            own[:, :, a:b] += buffer[:, :, at : at + b - a]
            at += b - a
    _count_halo(plan, "bwd", ran)
    return dq.to(q.dtype), own.to(kv.dtype)
