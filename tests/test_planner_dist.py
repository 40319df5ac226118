"""The planner's communication volumes per scheme equal what the real attention sends:
``state.stats`` after one forward + backward on 4 gloo ranks, per rank and kind."""

from __future__ import annotations

import pytest
import torch

import loongtrain as lt
from loongtrain.model.config import ModelConfig
from loongtrain.parallel.config import ParallelConfig
from loongtrain.planner.cost import Workload, comm_volume

from dist_pool import cached_state

KINDS = ("fwd.all_to_all", "bwd.all_to_all", "fwd.ring_kv", "bwd.ring_kv", "bwd.ring_dkv")


def _stats_case(cfg: dict, heads: int, groups: int, head_dim: int, seq: int) -> dict:
    state = cached_state(**cfg)
    gen = torch.Generator().manual_seed(state.coords.dp)
    q = torch.randn(1, seq, heads, head_dim, generator=gen)
    k, v = (torch.randn(1, seq, groups, head_dim, generator=gen) for _ in range(2))
    ql, kl, vl = (lt.shard_sequence(x, state).requires_grad_() for x in (q, k, v))
    state.stats.reset()
    out = lt.head_context_attention(ql, kl, vl, state, causal=True)
    out.backward(torch.ones_like(out))
    return {kind: (state.stats.get(kind), state.stats.bytes.get(kind, 0)) for kind in KINDS}


@pytest.mark.dist
@pytest.mark.parametrize(
    "cfg, heads, groups",
    [
        (dict(cp=4), 4, 2),  # ring
        (dict(cp=4, ring_window=2), 4, 2),  # double ring
        (dict(hp=4), 4, 4),  # Ulysses
        (dict(hp=4), 4, 2),  # Ulysses with KV replication (hp > G)
        (dict(hp=2, cp=2, placement="context_first"), 4, 2),  # 2D
        (dict(hp=2, cp=2, ring_window=2), 4, 1),  # 2D, MQA replicated to hp
        (dict(cp=2, dp=2), 2, 2),  # data parallel x ring
    ],
    ids=str,
)
def test_comm_volume_matches_attention_stats(dist_pool, cfg, heads, groups):
    head_dim, seq = 8, 64
    per_rank = dist_pool(4).run(_stats_case, cfg, heads, groups, head_dim, seq)
    model = ModelConfig(dim=heads * head_dim, n_heads=heads, n_kv_heads=groups)
    expected = comm_volume(Workload(model, seq, dtype_bytes=4), ParallelConfig(**cfg))
    for stats in per_rank:
        assert stats == {kind: (expected.count(kind), expected.bytes(kind)) for kind in KINDS}
