"""Packed documents and sliding windows as variable-length calls (the CUDA path), run here on a
CPU stand-in for FlashAttention (tests/varlen_emulation.py) against float64, their grouping
checked pair by pair, and the CUDA kernels' calls checked on the meta device."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cuda_rules import CudaArgumentRules
from loongtrain.attention.local import masked_attention
from loongtrain.attention.mask_plan import MAX_BAND_TILE, MaskPlan
from loongtrain.attention.sharding import sequence_sharding
from loongtrain.attention.varlen_plan import varlen_calls
from replay_check import check_masked_replay
from varlen_emulation import flash_visible, use_emulated_flash

from reference import attention_with_grads, rel_errors, visibility


def _random_documents(rng: random.Random, seq: int) -> tuple[int, ...]:
    cuts = sorted(rng.sample(range(1, seq), rng.randint(1, min(8, seq - 1))))
    return (0, *cuts, seq)


def _check_replay(monkeypatch, cp, ring_window, seq, cu, sliding, causal, balance, band_tile, seed=0):
    backend = use_emulated_flash(monkeypatch)
    plan = MaskPlan(sequence_sharding(seq, 1, cp, cu, balance), cu, causal, sliding, band_tile)
    check_masked_replay(plan, ring_window, batch=1, seed=seed)
    if len(cu) > 3 or sliding:
        assert backend.varlen.calls, "packed documents ran no variable-length call"


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("band_tile", [MAX_BAND_TILE, 0])
def test_ring_replay_on_variable_length_calls_matches_float64(monkeypatch, seed, band_tile):
    """The double ring's blocks under documents and windows, every block with more than one call or
    a band run as variable-length calls (batch 1), forward and backward against float64; bands
    tiled (as for masked kernels) or one per segment pair (as for a kernel's window)."""
    rng = random.Random(seed)
    cp = rng.choice([1, 2, 3, 4])
    ring_window = rng.choice([w for w in range(1, cp + 1) if cp % w == 0])
    seq = 2 * cp * rng.choice([6, 10, 16])
    cu = _random_documents(rng, seq)
    sliding = rng.choice([None, 3, 7, seq // 2])
    balance = rng.choice(["zigzag", "documents"])
    _check_replay(monkeypatch, cp, ring_window, seq, cu, sliding, seed % 4 != 3, balance, band_tile, seed)


def test_ring_replay_where_pieces_of_one_call_share_keys(monkeypatch):
    """Rank 3's block against rank 0's: one call's two pieces read the same keys (one document's
    query segments in both zigzag chunks), whose gradients add up row by row."""
    cu = (0, 41, 46, 52, 62, 76, 80)
    plan = MaskPlan(sequence_sharding(80, 1, 4, cu, "zigzag"), cu, True, 40, 0)
    shared = [
        c for c in varlen_calls(plan.calls(3, 0), True, 40)
        if len({i for p in c.pieces for i in range(p.col0, p.col1)}) < c.cols
    ]  # fmt: skip
    assert shared
    _check_replay(monkeypatch, 4, 1, 80, cu, 40, True, "zigzag", 0)


@pytest.mark.parametrize("sliding", [None, 5, 16])
def test_one_device_masked_attention_on_variable_length_calls(monkeypatch, sliding):
    """One device's whole sequence of many documents: one variable-length call (a window that cuts
    some documents too), forward and backward against float64."""
    from loongtrain.attention.layout import sequence_layout

    backend = use_emulated_flash(monkeypatch)
    seq, cu = 96, (0, 3, 20, 21, 40, 64, 70, 96)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, seq, 4, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, seq, 2, 8, generator=gen, requires_grad=True) for _ in range(2))
    dout = torch.randn(1, seq, 4, 8, generator=gen)
    out = masked_attention(q, k, v, layout=sequence_layout(seq, None, cu), sliding_window=sliding)
    out.backward(dout)
    ref = attention_with_grads(
        q.detach(), k.detach(), v.detach(), dout, True, 8**-0.5, visibility(seq, cu, True, sliding)
    )
    for got, want in zip((out, q.grad, k.grad, v.grad), ref):
        assert rel_errors(got.detach(), want)[0] < 1e-5
    assert backend.varlen.calls == [len(cu) - 1] and backend.dense_calls == 0


def _pairs_of_varlen_calls(calls, rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] int: how often each (row, col) pair of a block is computed by ``calls``."""
    cover = torch.zeros(rows, cols, dtype=torch.int)
    for call in calls:
        seen = set()
        for p in call.pieces:
            assert not seen & set(range(p.row0, p.row1)), "two pieces of one call share a row"
            seen |= set(range(p.row0, p.row1))
            sub = flash_visible(p.row1 - p.row0, p.col1 - p.col0, call.causal, call.window)
            assert sub.any(dim=1).all(), "a piece has a row that sees nothing"
            cover[p.row0 : p.row1, p.col0 : p.col1] += sub.int()
    return cover


def _pairs_of_plan_calls(calls, causal, window, rows: int, cols: int) -> torch.Tensor:
    from loongtrain.attention.blocks import call_band

    cover = torch.zeros(rows, cols, dtype=torch.int)
    for call in calls:
        band = call_band(call, causal, window)
        r, c = call.row1 - call.row0, call.col1 - call.col0
        if band is not None:
            sub = band.visible(r, c, torch.device("cpu"))
        elif call.kind == "causal":
            sub = torch.ones(r, c, dtype=torch.bool).tril()
        else:
            sub = torch.ones(r, c, dtype=torch.bool)
        cover[call.row0 : call.row1, call.col0 : call.col1] += sub.int()
    return cover


def test_variable_length_calls_compute_every_pair_of_the_plan_once():
    rng = random.Random(0)
    for _ in range(150):
        cp = rng.choice([1, 2, 3, 4])
        seq = 2 * cp * rng.choice([4, 7, 12])
        cu = _random_documents(rng, seq)
        window = rng.choice([None, 1, 2, 5, 9])
        causal = rng.random() < 0.7
        tile = rng.choice([MAX_BAND_TILE, 2, 0])
        plan = MaskPlan(
            sequence_sharding(seq, 1, cp, cu, rng.choice(["zigzag", "documents"])), cu, causal, window, tile
        )
        sc = seq // cp
        for c in range(cp):
            for src in range(cp):
                calls = plan.calls(c, src)
                want = _pairs_of_plan_calls(calls, causal, plan.sliding_window, sc, sc)
                got = _pairs_of_varlen_calls(varlen_calls(calls, causal, plan.sliding_window), sc, sc)
                assert torch.equal(got, want), (cp, seq, cu, window, causal, tile, c, src)


def test_launches_per_block_do_not_grow_with_the_number_of_documents():
    """One device: one call for any number of documents (with a window too); a ring of 4: the most
    calls any block makes is the same for 8 and for 200 documents."""

    def most_calls(seq: int, cp: int, docs: int, window) -> int:
        rng = random.Random(docs)
        cu = (0, *sorted(rng.sample(range(1, seq), docs - 1)), seq)
        plan = MaskPlan(sequence_sharding(seq, 1, cp, cu, "zigzag"), cu, True, window, 0)
        return max(len(varlen_calls(plan.calls(c, s), True, plan.sliding_window)) for c in range(cp) for s in range(cp))

    for window in (None, 64):
        assert most_calls(4096, 1, 8, window) == most_calls(4096, 1, 200, window) == 1
    assert most_calls(4096, 4, 8, None) == most_calls(4096, 4, 200, None) <= 3


class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_packed_documents_calls_fit_the_kernels_and_build_no_mask(monkeypatch, kernel, dtype):
    """The CUDA path of a block of packed documents under a window, on the meta device: the
    kernels' argument rules hold (int32 offsets, no offsets for dense calls), the variable-length
    kernel runs, and no mask tensor is built (no bias on CUDA)."""
    import loongtrain.attention.blocks as blocks
    import loongtrain.attention.kernels as kernels
    from loongtrain.attention.backends import CudnnBackend, Fa2Backend
    from loongtrain.attention.blocks import OutputAccumulator, backward_calls, forward_calls

    backend = Fa2Backend() if kernel == "flash" else CudnnBackend()
    monkeypatch.setattr(kernels, "backend_for", lambda device, dtype: backend)
    monkeypatch.setattr(blocks, "backend_for", lambda device, dtype: backend)
    seq, cu, window = 4096, (0, 100, 1500, 1600, 4000, 4096), 512
    plan = MaskPlan(sequence_sharding(seq, 1, 1, cu, "zigzag"), cu, True, window, 0)
    calls = plan.calls(0, 0)
    q = torch.empty(1, seq, 16, 128, device="meta", dtype=dtype)
    kv = torch.empty(2, 1, seq, 4, 128, device="meta", dtype=dtype)
    with CudaArgumentRules() as rules, _Record() as record:
        acc = OutputAccumulator(q)
        forward_calls(q, kv, calls, True, window, 0.1, acc)
        out, lse = acc.result(dtype)
        dq = torch.zeros(q.shape, dtype=torch.float32, device="meta")
        backward_calls(out, q, kv, out, lse, calls, True, window, 0.1, dq)
    assert rules.calls.count("_flash_attention_forward") == 1 and rules.calls.count("_flash_attention_backward") == 1
    assert "masked_fill" not in record.ops and "masked_fill_" not in record.ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_dense_blocks_on_cudnn_and_bands_on_the_flash_window(monkeypatch, dtype):
    """cuDNN runs the dense calls of a block's standard shapes (the causal square, the whole block
    against its first key half, its second query half against the whole block; GQA) with its lse
    layout; any other dense shape (a rectangle of 200 x 300, a decoded token) and a band go to
    FlashAttention (its window for the band); all within the kernels' argument rules (meta device)."""
    import loongtrain.attention.kernels as kernels
    from loongtrain.attention.backends import Band, CudnnBackend
    from loongtrain.attention.kernels import block_backward, block_forward

    monkeypatch.setattr(kernels, "backend_for", lambda device, dtype: CudnnBackend())
    q = torch.empty(2, 200, 16, 128, device="meta", dtype=dtype)
    k = torch.empty(2, 300, 4, 128, device="meta", dtype=dtype)
    half = q[:, 100:, :4]
    cases = (  # (q, k, causal, band, block, kernel)
        (q, q[:, :, :4], True, None, None, "_scaled_dot_product_cudnn_attention"),
        (q, half, False, None, None, "_scaled_dot_product_cudnn_attention"),
        (q[:, 100:], q[:, :, :4], False, None, 200, "_scaled_dot_product_cudnn_attention"),
        (q, k, False, None, None, "_flash_attention"),
        (q[:, :1], k, False, None, None, "_flash_attention"),
        (q, k, False, Band(100, 64, True), None, "_flash_attention"),
    )
    for qq, kk, causal, band, block, expected in cases:
        with CudaArgumentRules() as rules:
            out, lse = block_forward(qq, kk, kk, causal=causal, scale=0.1, band=band, block=block)
            assert out.shape == qq.shape and lse.shape == qq.shape[:3] and lse.dtype == torch.float32
            dq, dk, dv = block_backward(out, qq, kk, kk, out, lse, causal=causal, scale=0.1, band=band, block=block)
            assert dq.shape == qq.shape and dk.shape == kk.shape == dv.shape
        assert rules.calls[0].startswith(expected) and rules.calls[1].startswith(expected), (qq.shape, kk.shape)
        assert rules.calls[0].endswith(("_forward", "_attention")) and rules.calls[1].endswith("_backward")
