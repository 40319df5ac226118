"""Block kernels, the lse merge and the single-process ring replay against float64."""

from __future__ import annotations

import pytest
import torch

from loongtrain.attention.kernels import block_backward, block_forward
from loongtrain.attention.merge import merge_into
from loongtrain.attention.replay import RingReplay

from reference import attention_with_grads, reference_attention, reference_lse, rel_errors


def _qkv(batch=2, sq=24, sk=24, heads=4, groups=2, dim=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, sq, heads, dim, generator=g).to(dtype)
    k = torch.randn(batch, sk, groups, dim, generator=g).to(dtype)
    v = torch.randn(batch, sk, groups, dim, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("groups", [4, 2, 1])
def test_block_forward_and_lse(causal, groups):
    q, k, v = _qkv(groups=groups)
    scale = 0.3
    out, lse = block_forward(q, k, v, causal=causal, scale=scale)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert rel_errors(out, reference_attention(q, k, v, causal, scale))[1] < 1e-5
    assert rel_errors(lse, reference_lse(q, k, causal, scale))[1] < 1e-5


@pytest.mark.parametrize("causal", [True, False])
def test_block_backward(causal):
    q, k, v = _qkv(groups=2)
    dout = torch.randn_like(q)
    scale = 0.25
    out, lse = block_forward(q, k, v, causal=causal, scale=scale)
    got = block_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    _, *ref = attention_with_grads(q, k, v, dout, causal, scale)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        assert rel_errors(g, r)[1] < 1e-5


def test_merge_of_two_key_halves_equals_full_attention():
    q, k, v = _qkv(sk=40)
    scale = 0.2
    out_a, lse_a = block_forward(q, k[:, :17], v[:, :17], causal=False, scale=scale)
    out_b, lse_b = block_forward(q, k[:, 17:], v[:, 17:], causal=False, scale=scale)
    merge_into(out_a, lse_a, out_b, lse_b)
    assert rel_errors(out_a, reference_attention(q, k, v, False, scale))[1] < 1e-5
    assert rel_errors(lse_a, reference_lse(q, k, False, scale))[1] < 1e-6


def test_merge_is_stable_for_huge_lse_gaps():
    out = torch.randn(1, 3, 2, 4)
    other = torch.randn(1, 3, 2, 4)
    lse = torch.tensor([[[0.0, 5e4], [-5e4, 1.0], [80.0, -80.0]]])
    lse_b = torch.tensor([[[5e4, 0.0], [1.0, -5e4], [-80.0, 80.0]]])
    expected_lse = torch.logaddexp(lse.double(), lse_b.double())
    w = torch.sigmoid(lse_b.double() - lse.double()).unsqueeze(-1)
    expected_out = out.double() * (1 - w) + other.double() * w
    merge_into(out, lse, other, lse_b)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out.double(), expected_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse.double(), expected_lse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cp, window", [(1, 1), (2, 1), (4, 1), (4, 2), (4, 4), (8, 2), (6, 3)])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_replay_matches_float64(cp, window, causal):
    seq = 2 * cp * 5
    q, k, v = _qkv(batch=2, sq=seq, sk=seq, heads=4, groups=2, dim=8)
    dout = torch.randn_like(q)
    scale = 8**-0.5
    replay = RingReplay(cp, window, causal)
    qs = replay.shard(q)
    kvs = [torch.stack(kv) for kv in zip(replay.shard(k), replay.shard(v))]
    outs, lses = replay.forward(qs, kvs, scale)
    dqs, dkvs = replay.backward(replay.shard(dout), qs, kvs, outs, lses, scale)
    ref_out, ref_dq, ref_dk, ref_dv = attention_with_grads(q, k, v, dout, causal, scale)
    dkv = replay.unshard([d.permute(1, 2, 0, 3, 4) for d in dkvs])  # [B, S, 2, G, d]
    checks = {
        "out": (replay.unshard(outs), ref_out),
        "lse": (replay.unshard(lses), reference_lse(q, k, causal, scale)),
        "dq": (replay.unshard(dqs), ref_dq),
        "dk": (dkv[:, :, 0], ref_dk),
        "dv": (dkv[:, :, 1], ref_dv),
    }
    for name, (got, ref) in checks.items():
        assert rel_errors(got, ref)[0] < 1e-5, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_backend_calls_match_the_op_schemas(dtype):
    """The CUDA SDPA path cannot run here, but PyTorch's meta kernels check that the
    arguments fit the aten ops and give the output shapes (GQA: fewer key/value heads)."""
    from loongtrain.attention.kernels import CudaSdpaBackend

    backend = CudaSdpaBackend()
    q = torch.empty(2, 64, 8, 64, device="meta", dtype=dtype)
    k = torch.empty(2, 48, 2, 64, device="meta", dtype=dtype)
    out, lse = backend.forward(q, k, k, True, 0.125)
    assert out.shape == q.shape and lse.shape == (2, 64, 8) and lse.dtype == torch.float32
    dq, dk, dv = backend.backward(out, q, k, k, out, lse, True, 0.125)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_backend_masked_calls_match_the_op_schemas(dtype):
    """Masked (band) calls go to the efficient kernel with an aligned additive bias."""
    from loongtrain.attention.kernels import CudaSdpaBackend

    backend = CudaSdpaBackend()
    q = torch.empty(2, 40, 8, 64, device="meta", dtype=dtype)
    k = torch.empty(2, 56, 2, 64, device="meta", dtype=dtype)
    mask = torch.empty(40, 56, device="meta", dtype=dtype)
    out, lse = backend.forward(q, k, k, False, 0.125, mask)
    assert out.shape == q.shape and lse.shape == (2, 40, 8) and lse.dtype == torch.float32
    dq, dk, dv = backend.backward(out, q, k, k, out, lse, False, 0.125, mask)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_backend_calls_obey_the_cuda_kernels_argument_rules(monkeypatch, dtype, masked):
    """What the CUDA kernels check and neither the CPU nor the meta kernels do (tests/cuda_rules.py):
    the dense flash backward takes no offsets, the efficient backward an aligned lse and a
    contiguous ``out``. Query rows (50) and batch (2) make an unpadded lse misaligned; a small
    per-call limit runs the backward over head groups (the views a call gets are not contiguous)."""
    import loongtrain.attention.kernels as kernels
    import loongtrain.attention.workspace as workspace
    from cuda_rules import CudaArgumentRules

    monkeypatch.setattr(kernels, "backend_for", lambda device, dtype: kernels.CudaSdpaBackend())
    q = torch.empty(2, 50, 8, 64, device="meta", dtype=dtype)
    k = torch.empty(2, 70, 2, 64, device="meta", dtype=dtype)
    band = kernels.Band(offset=20, window=30, causal=True) if masked else None
    for limit in (workspace.BACKWARD_ROW_HEADS, 2 * 50 * 4, 2 * 50 * 2):
        per_call = lambda rows, h, g, limit=limit: max(1, min(h, limit // rows))  # noqa: E731
        monkeypatch.setattr(kernels, "backward_heads_per_call", per_call)
        with CudaArgumentRules() as rules:
            out, lse = block_forward(q, k, k, causal=False, scale=0.125, band=band)
            dq, dk, dv = block_backward(out, q, k, k, out, lse, causal=False, scale=0.125, band=band)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape
        kernel = "flash" if dtype != torch.float32 and not masked else "efficient"
        assert any(kernel in call and "backward" in call for call in rules.calls), rules.calls


def test_cuda_argument_rules_catch_what_the_first_gpu_run_found():
    """The rules fail the calls of 844df7e's code (checked against the errors the GPU gave)."""
    from cuda_rules import check_call

    aten = torch.ops.aten
    q = torch.empty(2, 8, 50, 64, device="meta")
    empty = torch.empty(0, dtype=torch.int64, device="meta")
    flash_args = (q, q, q, q, q, torch.empty(2, 8, 50, device="meta"), empty, empty, 50, 50, 0.0, True, empty, empty)
    assert "cum_seq" in check_call(aten._scaled_dot_product_flash_attention_backward.default, flash_args, {})
    lse = torch.empty(2, 8, 50, device="meta")  # [B, H, Sq] contiguous: strideH 50
    bshd = torch.empty(2, 50, 8, 64, device="meta").transpose(1, 2)
    args = (bshd, bshd, bshd, bshd, None, bshd, lse, empty, empty, 0.0, [True] * 3 + [False], False)
    assert "strideH" in check_call(aten._scaled_dot_product_efficient_attention_backward.default, args, {})
    split = torch.empty(2, 50, 16, 64, device="meta")[:, :, :8].transpose(1, 2)  # a head group's out
    aligned = torch.empty(2, 8, 64, device="meta")
    args = (bshd, bshd, bshd, bshd, None, split, aligned, empty, empty, 0.0, [True] * 3 + [False], False)
    assert "row stride" in check_call(aten._scaled_dot_product_efficient_attention_backward.default, args, {})


@pytest.mark.parametrize("causal", [True, False])
def test_masked_block_equals_float64_with_the_same_mask(causal):
    q, k, v = _qkv(sq=20, sk=28)
    keep = torch.rand(20, 28, generator=torch.Generator().manual_seed(1)) < 0.6
    keep[:, 0] = True  # every row sees a key
    if causal:
        keep &= torch.ones(20, 28, dtype=torch.bool).tril()
    mask = torch.zeros(20, 28).masked_fill(~keep, float("-inf"))
    dout = torch.randn_like(q)
    out, lse = block_forward(q, k, v, causal=False, scale=0.3, mask=mask)
    grads = block_backward(dout, q, k, v, out, lse, causal=False, scale=0.3, mask=mask)
    ref = attention_with_grads(q, k, v, dout, False, 0.3, keep)
    for got, want in zip((out, *grads), ref):
        assert rel_errors(got, want)[1] < 1e-5


def test_backward_heads_per_call_bounds_each_call():
    from loongtrain.attention import workspace
    from loongtrain.attention.workspace import BACKWARD_ROW_HEADS, backward_heads_per_call

    limit = BACKWARD_ROW_HEADS
    assert backward_heads_per_call(1024, 32, 8) == 32  # fits: one call
    assert backward_heads_per_call(limit // 8, 32, 8) == 8  # two whole groups of 4 query heads
    assert backward_heads_per_call(limit // 4, 32, 8) == 4  # one group
    assert backward_heads_per_call(limit // 2, 32, 8) == 2  # half a group
    assert backward_heads_per_call(limit * 4, 32, 8) == 1  # one head, more rows than the limit
    assert backward_heads_per_call(limit // 3, 6, 2) == 3  # divisors only
    assert backward_heads_per_call(limit // 2, 6, 2) == 1
    with pytest.raises(ValueError, match="not a multiple"):
        backward_heads_per_call(10, 6, 4)
    # FlashAttention-2's backward: fp32 dq accumulator, and dk/dv at the query heads with GQA
    assert workspace.backward_workspace_bytes(10, 12, 8, 2, 128, 2) == 4 * 10 * 8 * 128 + 2 * 2 * 12 * 8 * 128
    assert workspace.backward_workspace_bytes(10, 12, 8, 8, 128, 2) == 4 * 10 * 8 * 128


@pytest.mark.parametrize("limit_heads", [8, 4, 2, 1])
@pytest.mark.parametrize("masked", [False, True])
def test_backward_over_head_groups_equals_one_call_and_float64(monkeypatch, limit_heads, masked):
    """A block's backward split over heads (whole key/value groups, or part of one group with
    its dk/dv summed) gives the gradients of one call, and float64's; stacked or not."""
    from loongtrain.attention import workspace

    q, k, v = _qkv(batch=2, sq=20, sk=20, heads=8, groups=2)
    dout = torch.randn_like(q)
    mask = keep = None
    if masked:
        keep = torch.rand(20, 20, generator=torch.Generator().manual_seed(1)) < 0.6
        keep[:, 0] = True
        mask = torch.zeros(20, 20).masked_fill(~keep, float("-inf"))
    out, lse = block_forward(q, k, v, causal=not masked, scale=0.3, mask=mask)
    whole = block_backward(dout, q, k, v, out, lse, causal=not masked, scale=0.3, mask=mask)
    monkeypatch.setattr(workspace, "BACKWARD_ROW_HEADS", 2 * 20 * limit_heads)  # rows x heads of one call
    assert workspace.backward_heads_per_call(40, 8, 2) == limit_heads
    split = block_backward(dout, q, k, v, out, lse, causal=not masked, scale=0.3, mask=mask)
    ref = attention_with_grads(q, k, v, dout, not masked, 0.3, keep)[1:]
    for got, one, want in zip(split, whole, ref):
        assert got.shape == one.shape
        assert rel_errors(got, one)[1] < 1e-6
        assert rel_errors(got, want)[1] < 1e-5
    # stacked: dk and dv in one [2, ...] tensor (written in place over head groups), same values
    dq, dkv = block_backward(dout, q, k, v, out, lse, causal=not masked, scale=0.3, mask=mask, stacked=True)
    assert dkv.shape == (2, *k.shape)
    for got, want in zip((dq, dkv[0], dkv[1]), split):
        assert torch.equal(got, want)


def _flash_attn_visible(sq: int, sk: int, left: int, right: int) -> torch.Tensor:
    """flash_attn's documented window: query ``i`` sees keys in ``[i + sk - sq - left, i + sk - sq + right]``
    (bottom-right aligned; a negative size is unbounded)."""
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None]
    lo = (j >= i - left) if left >= 0 else torch.ones(sq, sk, dtype=torch.bool)
    hi = (j <= i + right) if right >= 0 else torch.ones(sq, sk, dtype=torch.bool)
    return lo & hi


def test_every_band_call_of_the_mask_plans_is_a_flash_attn_window():
    import itertools

    from loongtrain.attention.blocks import call_band
    from loongtrain.attention.layout import sequence_layout
    from loongtrain.attention.mask_plan import BAND
    from loongtrain.parallel.config import ParallelConfig

    seen = 0
    grid = itertools.product([1, 2, 4], ["zigzag", "documents", "locality"], [True, False], [7, 64, 300],
                             [None, [0, 500, 900, 1024]])  # fmt: skip
    for cp, balance, causal, window, docs in grid:
        plan = sequence_layout(1024, ParallelConfig(cp=cp, balance=balance), docs).mask_plan(causal, window)
        for a, b in itertools.product(range(cp), repeat=2):
            for call in plan.calls(a, b):
                if call.kind != BAND:
                    continue
                sq, sk = call.row1 - call.row0, call.col1 - call.col0
                band = call_band(call, causal, plan.sliding_window)
                # the band as written out from global positions
                i = call.q_start + torch.arange(sq)[:, None]
                j = call.k_start + torch.arange(sk)[None]
                want = (i - j < window) & ((j <= i) if causal else (j - i < window))
                assert torch.equal(band.visible(sq, sk, torch.device("cpu")), want)
                left, right = band.flash_window(sq, sk)
                assert torch.equal(_flash_attn_visible(sq, sk, left, right), want), (call, left, right)
                seen += 1
    assert seen > 1000
    # a band no window expresses (its rows start beyond the diagonal): None, so the mask is used
    from loongtrain.attention.kernels import Band

    assert Band(offset=-5, window=3, causal=True).flash_window(4, 8) is None


def _fake_flash_attn():
    """flash_attn 2.7's interface as custom ops with its parameter names (its kernels need CUDA),
    computing the documented semantics in float64: what FlashAttnBackend's keyword calls bind to."""
    import types

    from reference import reference_attention

    def keep(q, k, left, right, causal):
        if causal:
            right = 0
        return _flash_attn_visible(q.shape[1], k.shape[1], left, right)

    @torch.library.custom_op("lt_test::flash_fwd", mutates_args=())
    def _flash_attn_forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float, causal: bool,
        window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: torch.Tensor | None,
        return_softmax: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        seen = keep(q, k, window_size_left, window_size_right, causal)
        out = reference_attention(q, k, v, False, softmax_scale, seen).to(q.dtype)
        rep = q.shape[2] // k.shape[2]
        s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double().repeat_interleave(rep, 2)) * softmax_scale
        lse = s.masked_fill(~seen, float("-inf")).logsumexp(-1).float()
        return out, lse, q.new_empty(0), q.new_empty(0)

    @torch.library.custom_op("lt_test::flash_bwd", mutates_args=("dq", "dk", "dv"))
    def _flash_attn_backward(
        dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        softmax_lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, dropout_p: float,
        softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int, softcap: float,
        alibi_slopes: torch.Tensor | None, deterministic: bool, rng_state: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        seen = keep(q, k, window_size_left, window_size_right, causal)
        # by hand (a custom op runs below autograd): P = softmax(S), dS = P * (dP - rowsum(dO * O))
        b, sq, h, d = q.shape
        g = k.shape[2]
        qd, kd, vd, od = (
            q.double(),
            k.double().repeat_interleave(h // g, 2),
            v.double().repeat_interleave(h // g, 2),
            dout.double(),
        )
        p = (torch.einsum("bqhd,bkhd->bhqk", qd, kd) * softmax_scale).masked_fill(~seen, float("-inf")).softmax(-1)
        o = torch.einsum("bhqk,bkhd->bqhd", p, vd)
        dp = torch.einsum("bqhd,bkhd->bhqk", od, vd)
        ds = p * (dp - (od * o).sum(-1).transpose(1, 2)[..., None])
        dq.copy_(torch.einsum("bhqk,bkhd->bqhd", ds, kd) * softmax_scale)
        dk.copy_((torch.einsum("bhqk,bqhd->bkhd", ds, qd) * softmax_scale).view(b, -1, g, h // g, d).sum(3))
        dv.copy_(torch.einsum("bhqk,bqhd->bkhd", p, od).view(b, -1, g, h // g, d).sum(3))
        return softmax_lse.new_empty(0)

    return types.SimpleNamespace(_flash_attn_forward=_flash_attn_forward, _flash_attn_backward=_flash_attn_backward)


def test_flash_attn_backend_binds_by_keyword_and_runs_bands_as_windows():
    from loongtrain.attention.kernels import Band, FlashAttnBackend, band_inputs, flash_attn_incompatibility

    fake = _fake_flash_attn()
    assert flash_attn_incompatibility(fake) is None  # the custom op's wrapped signature is read
    old = types_with(fake, "_flash_attn_forward", lambda q, k, v, dropout_p, softmax_scale, causal, window_size: 0)
    assert "window_size_left" in flash_attn_incompatibility(old)  # flash_attn 2.6's signature: refused
    backend = FlashAttnBackend(fake)
    q, k, v = _qkv(sq=20, sk=36, heads=4, groups=2)
    dout = torch.randn_like(q)
    for band in (Band(offset=16, window=9, causal=True), Band(offset=10, window=12, causal=False)):
        mask, window = band_inputs(backend, band, 20, 36, q.dtype, q.device)
        assert mask is None and window is not None
        out, lse = backend.forward(q, k, v, False, 0.3, mask, window)
        grads = backend.backward(dout, q, k, v, out, lse, False, 0.3, mask, window)
        keep = band.visible(20, 36, q.device)
        ref = attention_with_grads(q, k, v, dout, False, 0.3, keep)
        scores = torch.einsum("bqhd,bkhd->bqhk", q.double(), k.double().repeat_interleave(2, 2)) * 0.3
        want_lse = scores.masked_fill(~keep[:, None], float("-inf")).logsumexp(-1)
        assert lse.shape == q.shape[:3] and rel_errors(lse, want_lse)[1] < 1e-6
        for got, want in zip((out, *grads), ref):
            assert rel_errors(got, want)[1] < 1e-5
    out, _ = backend.forward(q, k[:, :20], v[:, :20], True, 0.3)  # no band: the causal kernel, unbounded window
    assert rel_errors(out, reference_attention(q, k[:, :20], v[:, :20], True, 0.3))[1] < 1e-5


def types_with(module, name: str, fn):
    import types

    return types.SimpleNamespace(**{**vars(module), name: fn})
