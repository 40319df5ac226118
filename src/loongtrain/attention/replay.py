"""Single-process replay of the double ring: every context rank's blocks and merges, run
one after another in one process, with no communication.

It runs the same block functions in the same schedule as :mod:`double_ring`, so it
measures the cost of the decomposition itself (smaller kernels, fp32 merges) against one
fused attention call, and lets the schedule be checked without processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongtrain.attention.blocks import OutputAccumulator, accum_dtype, add_kv_grads, backward_work, forward_work
from loongtrain.attention.mask_plan import MaskPlan
from loongtrain.attention.schedule import ring_source
from loongtrain.attention.sharding import SequenceSharding, restore_order, take_ranges, zigzag_sharding
from loongtrain.parallel.config import ParallelConfig

Tensor = torch.Tensor


@dataclass(frozen=True)
class RingReplay:
    """The double ring over ``cp`` context ranks (``hp = 1``) replayed in one process.

    ``masks`` (a :class:`MaskPlan` with ``hp = 1``) replays a document / sliding-window mask on its
    sharding; without it, the plan of one zigzag document (the plain ring).
    """

    cp: int
    ring_window: int = 1
    causal: bool = True
    masks: MaskPlan | None = None

    def _plan(self, seq_len: int) -> MaskPlan:
        if self.masks is not None:
            return self.masks
        return MaskPlan(zigzag_sharding(seq_len, 1, self.cp), (0, seq_len), self.causal, None)

    def _sharding(self, seq_len: int) -> SequenceSharding:
        return self._plan(seq_len).sharding

    def shard(self, x: Tensor) -> list[Tensor]:
        """Shards of full-sequence ``x`` [*, S, ...] (dim 1), one per context rank."""
        sharding = self._sharding(x.shape[1])
        return [take_ranges(x, 1, sharding.ranges(0, c)) for c in range(self.cp)]

    def unshard(self, shards: list[Tensor]) -> Tensor:
        """Inverse of :meth:`shard` along dim 1."""
        sharding = self._sharding(sum(x.shape[1] for x in shards))
        return restore_order(torch.cat(shards, dim=1), 1, [(0, c) for c in range(self.cp)], sharding)

    def _schedule(self, plan: MaskPlan, c: int):
        config = ParallelConfig(cp=self.cp, ring_window=self.ring_window)
        for j in range(config.n_ring_windows):
            for s in range(config.ring_window):
                src = ring_source(c, config, j, s)
                yield src, plan.calls(c, src)

    def forward(self, qs: list[Tensor], kvs: list[Tensor], scale: float) -> tuple[list[Tensor], list[Tensor]]:
        """Per-rank ``(out, lse)`` from per-rank ``q`` [B,Sc,H,d] and ``kv`` [2,B,Sc,G,d]."""
        outs, lses = [], []
        plan = self._plan(sum(q.shape[1] for q in qs))
        for c in range(self.cp):
            acc = OutputAccumulator(qs[c])
            for src, work in self._schedule(plan, c):
                forward_work(qs[c], kvs[src], work, self.causal, plan.sliding_window, scale, acc)
            out, lse = acc.result(qs[c].dtype)
            outs.append(out)
            lses.append(lse)
        return outs, lses

    def backward(
        self,
        douts: list[Tensor],
        qs: list[Tensor],
        kvs: list[Tensor],
        outs: list[Tensor],
        lses: list[Tensor],
        scale: float,
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Per-rank ``(dq, dkv)`` of :meth:`forward`."""
        dqs = [torch.zeros(q.shape, dtype=accum_dtype(q.dtype), device=q.device) for q in qs]
        dkvs = [torch.zeros(kv.shape, dtype=accum_dtype(kv.dtype), device=kv.device) for kv in kvs]
        plan = self._plan(sum(q.shape[1] for q in qs))
        for c in range(self.cp):
            for src, work in self._schedule(plan, c):
                grads = backward_work(
                    douts[c], qs[c], kvs[src], outs[c], lses[c], work, self.causal, plan.sliding_window, scale, dqs[c]
                )
                add_kv_grads(dkvs[src], grads)
        return [d.to(q.dtype) for d, q in zip(dqs, qs)], [d.to(kv.dtype) for d, kv in zip(dkvs, kvs)]
