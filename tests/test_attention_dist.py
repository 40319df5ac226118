"""2D head-context attention on several ranks against float64 full attention, with and
without packed documents and sliding windows: one module, so both harnesses share one
spawned pool per world size.

Each case builds full q/k/v on every rank (same seed within a data-parallel replica,
different across replicas), runs the distributed attention on its shards, gathers out
and the gradients with ``unshard_sequence`` and compares them with float64 attention on
the unsharded tensors. The masked cases use the same document / window mask in the
reference, :func:`reference.visibility`, written out independently of the library.
"""

from __future__ import annotations

import random

import pytest
import torch

import loongtrain as lt

from dist_pool import cached_state
from reference import attention_with_grads, rel_errors, visibility

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
        # 2x2 plain ring: 3 all-to-alls each way, cp-1 KV hops, cp-1 dKV partials (the owner's stays)
        (
            {"hp": 2, "cp": 2},
            {"fwd.all_to_all": 3, "fwd.ring_kv": 1, "fwd.block": 2},
            {"bwd.all_to_all": 3, "bwd.ring_kv": 1, "bwd.ring_dkv": 1, "bwd.block": 2},
        ),
        # double ring cp=4, ring_window=2: KV makes 1 outer + 2 inner hops; dKV one partial per
        # remote reader: 1 inside the window, 1 + 1 from the other window (chain, then home)
        (
            {"cp": 4, "ring_window": 2},
            {"fwd.ring_kv": 3, "fwd.block": 4},
            {"bwd.ring_kv": 3, "bwd.ring_dkv": 3, "bwd.block": 4},
        ),
        ({"hp": 4}, {"fwd.all_to_all": 3, "fwd.block": 1}, {"bwd.all_to_all": 3, "bwd.block": 1}),
    ],
)
def test_transfer_and_block_counts(dist_pool, cfg, forward, backward):
    for counts in dist_pool(4).run(_count_work, cfg):
        assert counts == {"forward": forward, "backward": backward}


def _ring_bytes(cfg: dict, cu: list[int] | None) -> dict:
    """Bytes this rank sent and received per kind in one forward + backward, and what the pure
    routes of the batch's layout say they must be."""
    from loongtrain.attention.routes import full_routes

    state = cached_state(**cfg)
    seq, heads, groups, d, batch = 64 * state.sp, 4, 2, 8, 2
    layout = lt.sequence_layout(seq, state, cu)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(batch, seq, h, d, generator=gen) for h in (heads, groups, groups))
    q_l, k_l, v_l = (lt.shard_sequence(x, state, layout=layout).requires_grad_() for x in (q, k, v))
    state.stats.reset()
    lt.head_context_attention(q_l, k_l, v_l, state, layout=layout).sum().backward()
    # one zigzag document reads every block (every transfer); documents: the plan's routes
    plain = layout.boundaries is None and layout.balance == "zigzag"
    routes = full_routes(state.config) if plain else layout.mask_plan(True, None).routes(state.config)
    c = state.coords.context
    block = 2 * batch * (seq // state.cp) * (max(groups, state.hp) // state.hp) * d * 4  # stacked K/V, fp32
    expected = {
        "fwd.ring_kv": (routes.kv_hops(c) * block, routes.kv_received(c) * block),
        "bwd.ring_kv": (routes.kv_hops(c) * block, routes.kv_received(c) * block),
        "bwd.ring_dkv": (routes.dkv_partials(c) * block, routes.dkv_received(c) * block),
    }
    stats = state.stats
    measured = {kind: (stats.bytes.get(kind, 0), stats.received.get(kind, 0)) for kind in expected}
    return {"measured": measured, "expected": expected, "minimum": routes.minimum_transfers() * block}


@pytest.mark.dist
@pytest.mark.parametrize("cfg", [{"cp": 4, "ring_window": 2}, {"hp": 2, "cp": 2, "ring_window": 2}, {"cp": 4}])
def test_ring_bytes_follow_the_documents(dist_pool, cfg):
    cfg = {**cfg, "balance": "locality"}
    sp = cfg.get("hp", 1) * cfg["cp"]
    seq = 64 * sp
    # (a) documents of 32 tokens, each inside one rank's shard: no ring traffic at all
    for r in dist_pool(4).run(_ring_bytes, cfg, list(range(0, seq + 1, 32))):
        assert r["measured"] == r["expected"] == {k: (0, 0) for k in r["expected"]}
    # (b) a document over half the sequence, then short ones: the bytes the routes give, and
    # in total the minimum (one block per remote reader and pass)
    rows = dist_pool(4).run(_ring_bytes, cfg, [0, *range(seq // 2, seq, 48), seq])
    for r in rows:
        assert r["measured"] == r["expected"]
    hp = cfg.get("hp", 1)  # every head rank of a context index runs the same ring
    sent = sum(r["measured"]["fwd.ring_kv"][0] for r in rows) // hp
    assert sum(r["measured"]["bwd.ring_dkv"][0] for r in rows) // hp == rows[0]["minimum"]
    assert 0 < sent <= 1.1 * rows[0]["minimum"]


def _window_bytes(cfg: dict, seq: int, window: int | None) -> dict:
    from loongtrain.tools.bench.layer_kinds import COUNTERS, layer_bytes

    state = cached_state(**cfg)
    return {"bytes": dict(zip(COUNTERS, layer_bytes(state, seq, window, 2, 2, 8))), "context": state.coords.context}


@pytest.mark.dist
def test_a_sliding_layer_sends_its_windows_halo_whatever_the_length(dist_pool):
    """cp = 4, zigzag, window w below a chunk: rank c's chunk k (c and 2cp-1-c) needs the w - 1
    keys before it, from chunk k - 1's rank when that is another; each such piece travels once
    per pass, and its float32 dK/dV once back. The same bytes at 256 and 1024 tokens; a full
    layer's grow with the length."""
    cp, w, column = 4, 9, 2 * 2 * 8 * 4  # k and v, G = 2 heads of 8, float32

    def owner(k: int) -> int:
        return k if k < cp else 2 * cp - 1 - k

    for seq in (256, 1024):
        for r in dist_pool(4).run(_window_bytes, {"cp": cp}, seq, w):
            c = r["context"]
            chunks = (c, 2 * cp - 1 - c)
            received = sum(w - 1 for k in chunks if k > 0 and owner(k - 1) != c)
            sent = sum(w - 1 for k in chunks if k < 2 * cp - 1 and owner(k + 1) != c)
            want = {"fwd.ring_kv": sent * column, "bwd.ring_kv": sent * column, "bwd.ring_dkv": received * column}
            assert r["bytes"] == want, (seq, c, r, want)
    small, large = (dist_pool(4).run(_window_bytes, {"cp": cp}, seq, None)[1]["bytes"] for seq in (256, 1024))
    assert all(large[k] == 4 * small[k] > 0 for k in small)


# -- packed documents and sliding windows ----------------------------------------------
def boundaries(kind: str, seq: int, sp: int, cp: int, seed: int) -> list[int]:
    """Document boundaries of one test family (deterministic in ``seed``)."""
    rng = random.Random(seed)
    chunk, shard = seq // (2 * cp), seq // sp
    if kind == "single":
        return [0, seq]
    if kind == "chunk_edges":  # every chunk edge, so no document spans two ranks' chunks
        return list(range(0, seq + 1, chunk))
    if kind == "inside":  # cuts strictly inside chunks
        cuts = {rng.randrange(1, seq) for _ in range(5)} - set(range(0, seq, chunk))
        return [0, *sorted(cuts), seq]
    if kind == "long":  # one document longer than a rank's shard, starting mid-chunk
        start = max(1, chunk // 2)
        end = min(seq - 1, start + shard + chunk + 1)
        return [0, start, end, seq] if end < seq else [0, start, seq]
    if kind == "tiny":  # hundreds of 1-4 token documents
        cuts, pos = [0], 0
        while pos < seq:
            pos = min(seq, pos + rng.randint(1, 4))
            cuts.append(pos)
        return cuts
    raise ValueError(kind)


def window_size(kind: str | None, seq: int, sp: int, cp: int) -> int | None:
    chunk, shard = seq // (2 * cp), seq // sp
    return {None: None, "lt_chunk": max(1, chunk // 2 - 1), "gt_shard": shard + 3, "gt_seq": 2 * seq}[kind]


def _masked_case(
    cfg: dict,
    heads: int,
    groups: int,
    tokens_per_rank: int,
    docs: str,
    window: str | None,
    causal: bool,
    balance: str,
    dtype_name: str,
    seed: int,
) -> dict:
    state = cached_state(**cfg, balance=balance)
    dtype = getattr(torch, dtype_name)
    seq = tokens_per_rank * state.sp
    cu = boundaries(docs, seq, state.sp, state.cp, seed + 1000 * state.coords.dp)
    win = window_size(window, seq, state.sp, state.cp)
    gen = torch.Generator().manual_seed(seed + 1000 * state.coords.dp)
    q = torch.randn(2, seq, heads, 8, generator=gen).to(dtype)
    k = torch.randn(2, seq, groups, 8, generator=gen).to(dtype)
    v = torch.randn(2, seq, groups, 8, generator=gen).to(dtype)
    dout = torch.randn(2, seq, heads, 8, generator=gen).to(dtype)
    scale = 8**-0.5
    ref = attention_with_grads(q, k, v, dout, causal, scale, visibility(seq, cu, causal, win))

    keys = {"layout": lt.sequence_layout(seq, state, cu)}
    q_l, k_l, v_l = (lt.shard_sequence(x, state, **keys).requires_grad_() for x in (q, k, v))
    state.stats.reset()
    out_l = lt.head_context_attention(q_l, k_l, v_l, state, causal=causal, sliding_window=win, **keys)
    out_l.backward(lt.shard_sequence(dout, state, **keys))
    got = [lt.unshard_sequence(t, state, **keys) for t in (out_l, q_l.grad, k_l.grad, v_l.grad)]
    errors = {}
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        # gradients of single-token documents are exactly zero in the reference
        errors[name] = rel_errors(g, r) if r.norm() > 0 else ((g.double() - r).abs().max().item(),) * 2
    errors["dtypes"] = [str(t.dtype) for t in (out_l, q_l.grad, k_l.grad, v_l.grad)]
    errors["stats"] = state.stats.snapshot()
    errors["documents"] = len(cu) - 1
    return errors


# (world, layout, heads, groups, tokens per rank, documents, window, causal, balance, dtype)
MASK_CASES = [
    # world 1: the local kernel path
    (1, {}, 4, 2, 32, "inside", "lt_chunk", True, "zigzag", "float32"),
    (1, {}, 4, 4, 256, "tiny", None, False, "zigzag", "float32"),
    (1, {}, 4, 1, 32, "long", "gt_seq", True, "zigzag", "float32"),
    # world 2: ring (outer / inner), Ulysses, KV replication
    (2, {"cp": 2}, 4, 2, 16, "chunk_edges", None, True, "zigzag", "float32"),
    (2, {"cp": 2, "ring_window": 2}, 4, 2, 16, "inside", "gt_shard", True, "documents", "float32"),
    (2, {"cp": 2}, 4, 2, 16, "long", "lt_chunk", False, "documents", "float32"),
    (2, {"hp": 2}, 4, 2, 16, "inside", None, True, "zigzag", "float32"),
    (2, {"hp": 2}, 4, 1, 16, "long", "lt_chunk", True, "documents", "float32"),
    # world 4: double ring (contiguous, interleaved), 2D both placements, replication, dp > 1
    (4, {"cp": 4, "ring_window": 2}, 4, 2, 16, "inside", None, True, "zigzag", "float32"),
    (4, {"cp": 4, "ring_window": 2}, 4, 2, 16, "long", "gt_shard", True, "documents", "float32"),
    (4, {"cp": 4, "ring_window": 2, "context_order": "interleaved"}, 4, 2, 16, "chunk_edges", "lt_chunk", True,
     "documents", "float32"),
    (4, {"cp": 4}, 4, 2, 128, "tiny", None, True, "zigzag", "float32"),
    (4, {"cp": 4, "ring_window": 4}, 4, 4, 128, "tiny", "lt_chunk", True, "documents", "float32"),
    (4, {"hp": 2, "cp": 2}, 4, 2, 16, "long", None, True, "documents", "float32"),
    (4, {"hp": 2, "cp": 2, "placement": "context_first"}, 4, 1, 16, "inside", "lt_chunk", True, "zigzag", "float32"),
    (4, {"hp": 2, "cp": 2, "ring_window": 2, "placement": "context_first"}, 6, 6, 16, "long", "gt_shard", False,
     "zigzag", "float32"),
    (4, {"hp": 4}, 8, 2, 16, "inside", "gt_seq", True, "documents", "float32"),
    (4, {"hp": 2, "dp": 2}, 4, 2, 16, "long", "lt_chunk", True, "documents", "float32"),
    (4, {"cp": 2, "ring_window": 2, "dp": 2}, 4, 2, 16, "inside", None, False, "documents", "float32"),
    (4, {"hp": 2, "cp": 2}, 4, 2, 16, "inside", "lt_chunk", True, "documents", "bfloat16"),
    (4, {"cp": 4, "ring_window": 2}, 4, 2, 16, "long", None, True, "zigzag", "float16"),
    (4, {"hp": 2, "cp": 2, "ring_window": 2}, 4, 1, 16, "inside", "gt_shard", True, "documents", "float64"),
    # the locality balance: documents whole or on runs of adjacent ranks, trimmed routes
    (2, {"cp": 2}, 4, 2, 128, "tiny", None, True, "locality", "float32"),
    (4, {"cp": 4, "ring_window": 2}, 4, 2, 32, "long", "lt_chunk", True, "locality", "float32"),
    (4, {"hp": 2, "cp": 2, "ring_window": 2}, 4, 2, 32, "inside", None, True, "locality", "float32"),
    (4, {"cp": 4}, 4, 1, 64, "tiny", "gt_shard", True, "locality", "float64"),
]  # fmt: skip

MASK_SLOW_CASES = [
    (8, {"hp": 2, "cp": 4, "ring_window": 2}, 4, 2, 16, "long", "lt_chunk", True, "documents", "float32"),
    (8, {"hp": 2, "cp": 4, "ring_window": 2, "placement": "context_first"}, 4, 1, 16, "inside", None, True, "zigzag",
     "float32"),
    (8, {"cp": 8, "ring_window": 4, "context_order": "interleaved"}, 4, 4, 16, "chunk_edges", "gt_shard", True,
     "documents", "float32"),
    (8, {"cp": 8, "ring_window": 2}, 4, 2, 64, "tiny", None, True, "documents", "float32"),
    (8, {"hp": 4, "cp": 2, "ring_window": 2}, 8, 4, 16, "inside", "lt_chunk", False, "documents", "float32"),
    (8, {"hp": 8}, 8, 2, 16, "long", "gt_shard", True, "zigzag", "float32"),
    (8, {"hp": 2, "cp": 2, "ring_window": 2, "dp": 2}, 4, 2, 16, "long", None, True, "documents", "float32"),
]  # fmt: skip


def _mask_case_id(case) -> str:
    world, cfg, heads, groups, tokens, docs, window, causal, balance, dtype = case
    parts = [f"w{world}"] + [f"{k}={v}" for k, v in cfg.items()]
    parts += [f"H{heads}G{groups}", docs, f"win={window}", "causal" if causal else "full", balance, dtype]
    return "-".join(parts)


def _run_masked(dist_pool, case) -> list[dict]:
    world, cfg, heads, groups, tokens, docs, window, causal, balance, dtype = case
    results = dist_pool(world).run(_masked_case, cfg, heads, groups, tokens, docs, window, causal, balance, dtype, 11)
    tol = TOL[dtype]
    for rank, errs in enumerate(results):
        assert errs["dtypes"] == [f"torch.{dtype}"] * 4, errs["dtypes"]
        for name in ("out", "dq", "dk", "dv"):
            norm_err, max_err = errs[name]
            assert norm_err <= tol and max_err <= 4 * tol, f"rank {rank} {name}: {errs[name]} > {tol}"
    return results


@pytest.mark.dist
@pytest.mark.parametrize("case", MASK_CASES, ids=_mask_case_id)
def test_masked_attention_matches_float64(dist_pool, case):
    results = _run_masked(dist_pool, case)
    if case[5] == "tiny":
        assert results[0]["documents"] >= 100  # really hundreds of documents


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", MASK_SLOW_CASES, ids=_mask_case_id)
def test_masked_attention_matches_float64_world8(dist_pool, case):
    _run_masked(dist_pool, case)


def _single_document_vs_plain(cfg: dict) -> dict:
    zigzag = cached_state(**cfg)
    docs = cached_state(**cfg, balance="documents")
    seq = 16 * zigzag.sp
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, seq, 4, 8, generator=gen), *torch.randn(2, 1, seq, 2, 8, generator=gen)
    results = {}
    for name, state, keys in (
        ("plain", zigzag, {}),
        ("zigzag", zigzag, {"layout": lt.sequence_layout(seq, zigzag, [0, seq])}),
        ("documents", docs, {"layout": lt.sequence_layout(seq, docs, [0, seq])}),
    ):
        shards = [lt.shard_sequence(x, state, **keys).requires_grad_() for x in (q, k, v)]
        out = lt.head_context_attention(*shards, state, **keys)
        out.square().sum().backward()
        results[name] = [lt.unshard_sequence(t, state, **keys) for t in (out, *(s.grad for s in shards))]
    return {
        "zigzag_equal": all(torch.equal(a, b) for a, b in zip(results["plain"], results["zigzag"])),
        "documents_err": max((a - b).abs().max().item() for a, b in zip(results["plain"], results["documents"])),
    }


@pytest.mark.dist
def test_one_document_equals_the_plain_causal_result(dist_pool):
    for result in dist_pool(4).run(_single_document_vs_plain, {"hp": 2, "cp": 2, "ring_window": 2}):
        assert result["zigzag_equal"]  # the very same kernels: bit for bit
        assert result["documents_err"] < 1e-5


def _skipped_work() -> dict:
    state = cached_state(cp=4)
    seq = 64
    cu = list(range(0, seq + 1, seq // 8))  # documents on chunk edges: no block but a rank's own has work
    q = torch.randn(1, seq // 4, 2, 8, requires_grad=True)
    state.stats.reset()
    out = lt.head_context_attention(q, q, q, state, layout=lt.sequence_layout(seq, state, cu))
    forward = state.stats.snapshot()
    state.stats.reset()
    out.sum().backward()
    return {"forward": forward, "backward": state.stats.snapshot()}


@pytest.mark.dist
def test_empty_blocks_run_no_kernel_and_are_counted(dist_pool):
    for counts in dist_pool(4).run(_skipped_work):
        fwd, bwd = counts["forward"], counts["backward"]
        assert (fwd["fwd.block"], fwd["fwd.block_skipped"], fwd["fwd.step_skipped"]) == (1, 3, 3)
        assert "fwd.ring_kv" not in fwd  # nobody reads another rank's block: nothing travels
        assert (bwd["bwd.block"], bwd["bwd.block_skipped"], bwd["bwd.step_skipped"]) == (1, 3, 3)
        assert "bwd.ring_kv" not in bwd and "bwd.ring_dkv" not in bwd
