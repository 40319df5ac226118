"""Single-process replay of the double ring: every context rank's blocks and merges, run
one after another in one process, with no communication.

It runs the same block functions in the same schedule as :mod:`double_ring`, so it
measures the cost of the decomposition itself (smaller kernels, fp32 merges) against one
fused attention call, and lets the schedule be checked without processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongtrain.attention.blocks import OutputAccumulator, accum_dtype, add_kv_grad, backward_block, forward_block
from loongtrain.attention.schedule import block_kind, ring_source
from loongtrain.attention.sharding import restore_order, shard_ranges, take_ranges

Tensor = torch.Tensor


@dataclass(frozen=True)
class RingReplay:
    """The double ring over ``cp`` context ranks (``hp = 1``) replayed in one process."""

    cp: int
    window: int = 1
    causal: bool = True

    def shard(self, x: Tensor) -> list[Tensor]:
        """Zigzag shards of full-sequence ``x`` [*, S, ...] (dim 1), one per context rank."""
        return [take_ranges(x, 1, shard_ranges(x.shape[1], 1, self.cp, 0, c)) for c in range(self.cp)]

    def unshard(self, shards: list[Tensor]) -> Tensor:
        """Inverse of :meth:`shard` along dim 1."""
        return restore_order(torch.cat(shards, dim=1), 1, [(0, c) for c in range(self.cp)], 1, self.cp)

    def _schedule(self, c: int):
        n = self.cp // self.window
        for j in range(n):
            for s in range(self.window):
                src = ring_source(c, self.cp, self.window, j, s)
                yield src, block_kind(src, c, self.causal)

    def forward(self, qs: list[Tensor], kvs: list[Tensor], scale: float) -> tuple[list[Tensor], list[Tensor]]:
        """Per-rank ``(out, lse)`` from per-rank ``q`` [B,Sc,H,d] and ``kv`` [2,B,Sc,G,d]."""
        outs, lses = [], []
        for c in range(self.cp):
            acc = OutputAccumulator()
            for src, kind in self._schedule(c):
                forward_block(qs[c], kvs[src], kind, scale, acc)
            outs.append(acc.out.to(qs[c].dtype))
            lses.append(acc.lse)
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
        for c in range(self.cp):
            for src, kind in self._schedule(c):
                rows, dk, dv = backward_block(douts[c], qs[c], kvs[src], outs[c], lses[c], kind, scale, dqs[c])
                add_kv_grad(dkvs[src], rows, dk, dv)
        return [d.to(q.dtype) for d, q in zip(dqs, qs)], [d.to(kv.dtype) for d, kv in zip(dkvs, kvs)]
