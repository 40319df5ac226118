"""The double ring replayed in one process under a mask plan, checked against float64 attention."""

from __future__ import annotations

import torch

from loongtrain.attention.mask_plan import MaskPlan
from loongtrain.attention.replay import RingReplay

from reference import attention_with_grads, rel_errors, visibility


def check_masked_replay(plan: MaskPlan, ring_window: int, batch: int, seed: int, bound: float = 1e-5) -> None:
    """Forward and backward of ``plan``'s ring (cp from its sharding) on random inputs of ``batch``
    rows: out, dq, dk and dv within ``bound`` (norm-relative) of float64 under the plan's mask."""
    seq, cp, cu, causal = plan.sharding.seq_len, plan.sharding.cp, plan.boundaries, plan.causal
    gen = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(batch, seq, 4, 8, generator=gen), *torch.randn(2, batch, seq, 2, 8, generator=gen)
    dout = torch.randn_like(q)
    replay = RingReplay(cp, ring_window, causal, plan)
    qs = replay.shard(q)
    kvs = [torch.stack(kv) for kv in zip(replay.shard(k), replay.shard(v))]
    outs, lses = replay.forward(qs, kvs, 0.3)
    dqs, dkvs = replay.backward(replay.shard(dout), qs, kvs, outs, lses, 0.3)
    ref = attention_with_grads(q, k, v, dout, causal, 0.3, visibility(seq, cu, causal, plan.sliding_window))
    dkv = replay.unshard([d.permute(1, 2, 0, 3, 4) for d in dkvs])
    for got, want in zip((replay.unshard(outs), replay.unshard(dqs), dkv[:, :, 0], dkv[:, :, 1]), ref):
        assert rel_errors(got, want)[0] < bound
