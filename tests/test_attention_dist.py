"""2D head-context attention on several ranks against float64 full attention.

Each case builds full q/k/v on every rank (same seed within a data-parallel replica,
different across replicas), runs the distributed attention on zigzag shards, gathers out
and the gradients with ``unshard_sequence`` and compares them with float64 attention on
the unsharded tensors.
"""

from __future__ import annotations

import pytest
import torch

import loongtrain as lt

from dist_pool import cached_state
from reference import attention_with_grads, rel_errors

TOL = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 2e-2, "float16": 4e-3}


def _attention_case(
    cfg: dict,
    batch: int,
    heads: int,
    groups: int,
    head_dim: int,
    tokens_per_rank: int,
    causal: bool,
    dtype_name: str,
    seed: int,
) -> dict:
    state = cached_state(**cfg)
    dtype = getattr(torch, dtype_name)
    seq = tokens_per_rank * state.sp
    gen = torch.Generator().manual_seed(seed + 1000 * state.coords.dp)
    q = torch.randn(batch, seq, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, seq, groups, head_dim, generator=gen).to(dtype)
    v = torch.randn(batch, seq, groups, head_dim, generator=gen).to(dtype)
    dout = torch.randn(batch, seq, heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    ref = attention_with_grads(q, k, v, dout, causal, scale)

    q_l, k_l, v_l = (lt.shard_sequence(x, state).requires_grad_() for x in (q, k, v))
    out_l = lt.head_context_attention(q_l, k_l, v_l, state, causal=causal)
    out_l.backward(lt.shard_sequence(dout, state))
    got = [lt.unshard_sequence(t, state) for t in (out_l, q_l.grad, k_l.grad, v_l.grad)]
    errors = {name: rel_errors(g, r) for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}
    errors["dtypes"] = [str(t.dtype) for t in (out_l, q_l.grad, k_l.grad, v_l.grad)]
    errors["shape"] = tuple(out_l.shape)
    return errors


# (world, config, heads, groups, causal, dtype, batch)
CASES = [
    # world 1: local kernel path, MHA / GQA / MQA, odd head count
    (1, {}, 4, 4, True, "float32", 2),
    (1, {}, 4, 2, False, "float32", 1),
    (1, {}, 3, 1, True, "float32", 2),
    # world 2: pure ring (outer / inner), pure Ulysses, KV replication hp > G
    (2, {"cp": 2}, 4, 2, True, "float32", 2),
    (2, {"cp": 2, "ring_window": 2}, 4, 4, True, "float32", 1),
    (2, {"cp": 2}, 4, 1, False, "float32", 1),
    (2, {"hp": 2}, 4, 4, True, "float32", 2),
    (2, {"hp": 2}, 4, 1, True, "float32", 1),
    (2, {"hp": 2}, 6, 2, True, "float32", 1),  # 3 query heads per rank
    # world 4: ring with window 1 / 2 / 4, Ulysses with G = 4, 2, 1, 2x2 both placements
    (4, {"cp": 4}, 4, 2, True, "float32", 1),
    (4, {"cp": 4, "ring_window": 2}, 4, 2, True, "float32", 2),
    (4, {"cp": 4, "ring_window": 4}, 4, 4, True, "float32", 1),
    (4, {"cp": 4, "ring_window": 2}, 4, 1, False, "float32", 1),
    (4, {"cp": 4, "ring_window": 2, "context_order": "interleaved"}, 4, 2, True, "float32", 1),
    (4, {"hp": 4}, 8, 4, True, "float32", 1),
    (4, {"hp": 4}, 8, 2, True, "float32", 2),
    (4, {"hp": 4}, 4, 1, True, "float32", 1),
    (4, {"hp": 2, "cp": 2}, 4, 2, True, "float32", 2),
    (4, {"hp": 2, "cp": 2, "placement": "context_first"}, 4, 1, True, "float32", 1),
    (4, {"hp": 2, "cp": 2, "ring_window": 2, "placement": "context_first"}, 6, 6, False, "float32", 1),
    (4, {"hp": 2, "dp": 2}, 4, 2, True, "float32", 1),
    (4, {"cp": 2, "ring_window": 2, "dp": 2}, 4, 2, True, "float32", 1),
    (4, {"hp": 2, "cp": 2}, 4, 2, True, "bfloat16", 1),
    (4, {"cp": 4, "ring_window": 2}, 4, 2, True, "float16", 1),
    (4, {"hp": 2, "cp": 2, "ring_window": 2}, 4, 1, True, "float64", 2),
]

SLOW_CASES = [
    # world 8: 2x4 and 4x2 with double rings, both placements, interleaved windows,
    # dp=2 x sp=4, Ulysses with KV replication (hp=8 > G=2), bf16
    (8, {"hp": 2, "cp": 4, "ring_window": 2}, 4, 2, True, "float32", 1),
    (8, {"hp": 2, "cp": 4, "ring_window": 2, "placement": "context_first"}, 4, 1, True, "float32", 2),
    (8, {"hp": 4, "cp": 2, "ring_window": 2}, 8, 4, True, "float32", 1),
    (8, {"hp": 4, "cp": 2, "placement": "context_first"}, 4, 2, False, "float32", 1),
    (8, {"cp": 8, "ring_window": 2}, 4, 2, True, "float32", 1),
    (8, {"cp": 8, "ring_window": 4, "context_order": "interleaved"}, 4, 4, True, "float32", 1),
    (8, {"cp": 8}, 2, 1, False, "float32", 1),
    (8, {"hp": 2, "cp": 2, "ring_window": 2, "dp": 2, "placement": "context_first"}, 4, 2, True, "float32", 2),
    (8, {"hp": 8}, 8, 2, True, "float32", 1),
    (8, {"hp": 2, "cp": 4, "ring_window": 2}, 4, 2, True, "bfloat16", 1),
]


def _case_id(case) -> str:
    world, cfg, heads, groups, causal, dtype, batch = case
    parts = [f"w{world}"] + [f"{k}={v}" for k, v in cfg.items()]
    parts += [f"H{heads}G{groups}", "causal" if causal else "full", dtype, f"B{batch}"]
    return "-".join(parts)


def _run_case(dist_pool, case) -> None:
    world, cfg, heads, groups, causal, dtype, batch = case
    results = dist_pool(world).run(_attention_case, cfg, batch, heads, groups, 16, 4, causal, dtype, 7)
    tol = TOL[dtype]
    for rank, errs in enumerate(results):
        assert errs["dtypes"] == [f"torch.{dtype}"] * 4, errs["dtypes"]
        for name in ("out", "dq", "dk", "dv"):
            norm_err, max_err = errs[name]
            assert norm_err <= tol and max_err <= 4 * tol, f"rank {rank} {name}: {errs[name]} > {tol}"


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_head_context_attention_matches_float64(dist_pool, case):
    _run_case(dist_pool, case)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=_case_id)
def test_head_context_attention_matches_float64_world8(dist_pool, case):
    _run_case(dist_pool, case)


def _count_work(cfg: dict) -> dict:
    state = cached_state(**cfg)
    q = torch.randn(1, 8, 4, 8, requires_grad=True)
    kv = torch.randn(1, 8, 2, 8, requires_grad=True)
    state.stats.reset()
    out = lt.head_context_attention(q, kv, kv, state)
    forward = state.stats.snapshot()
    state.stats.reset()
    out.sum().backward()
    return {"forward": forward, "backward": state.stats.snapshot()}


@pytest.mark.dist
@pytest.mark.parametrize(
    "cfg, forward, backward",
    [
        # 2x2 plain ring: 3 all-to-alls each way, cp-1 KV hops, cp dKV hops (the last one home)
        (
            {"hp": 2, "cp": 2},
            {"fwd.all_to_all": 3, "fwd.ring_kv": 1, "fwd.block": 2},
            {"bwd.all_to_all": 3, "bwd.ring_kv": 1, "bwd.ring_dkv": 2, "bwd.block": 2},
        ),
        # double ring cp=4, ring_window=2: KV makes 1 outer + 2 inner hops; dKV 4 inner + 2 outer
        (
            {"cp": 4, "ring_window": 2},
            {"fwd.ring_kv": 3, "fwd.block": 4},
            {"bwd.ring_kv": 3, "bwd.ring_dkv": 6, "bwd.block": 4},
        ),
        ({"hp": 4}, {"fwd.all_to_all": 3, "fwd.block": 1}, {"bwd.all_to_all": 3, "bwd.block": 1}),
    ],
)
def test_transfer_and_block_counts(dist_pool, cfg, forward, backward):
    for counts in dist_pool(4).run(_count_work, cfg):
        assert counts == {"forward": forward, "backward": backward}
