"""The Llama model on one device: presets, RoPE, init, bad configuration."""

from __future__ import annotations

import pytest
import torch

from loongtrain.apply import check_model_fits, materialize
from loongtrain.model import PRESETS, build_model, model_config
from loongtrain.model.lean import tiled_rope
from loongtrain.model.llama import apply_rope, rope_tables
from loongtrain.options import check_activation_checkpoint, check_zero_scope
from loongtrain.parallel.state import zero_mesh_ranks


@pytest.mark.parametrize(
    "name, billions",
    [("7b-mha", 6.74), ("7b-gqa", 5.93), ("13b", 13.02), ("llama3-8b", 8.03)],
)
def test_preset_sizes(name, billions):
    cfg = PRESETS[name]
    model = build_model(cfg)  # meta: no memory
    counted = sum(p.numel() for p in model.parameters())
    assert counted == cfg.num_params()
    assert abs(counted / 1e9 - billions) < 0.01
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize("rope", [apply_rope, tiled_rope], ids=["plain", "tiled"])
def test_rope_matches_complex_rotation(rope):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 3, 8)
    pos = torch.tensor([[0, 7, 3, 100, 2], [1, 1, 1, 1, 1]])
    cos, sin = rope_tables(pos, 8, 10000.0)
    got = rope(x, cos, sin)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    angle = pos.double()[..., None] * inv  # [B, S, 4]
    z = torch.view_as_complex(x.double().reshape(2, 5, 3, 4, 2).contiguous())
    ref = torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)[:, :, None]).reshape(2, 5, 3, 8)
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rope", [apply_rope, tiled_rope], ids=["plain", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rope_has_the_gradient_of_the_complex_rotation(dtype, rope):
    """Through torch.compile (aot_eager: the autograd.Function as compiled, no code generation),
    RoPE's gradient is the inverse rotation; torch 2.11 once compiled the tiled one to zeros in float32."""
    torch.manual_seed(0)
    x = torch.randn(1, 6, 2, 8).to(dtype).requires_grad_()
    pos = torch.tensor([[0, 7, 3, 100, 2, 5]])
    cos, sin = rope_tables(pos, 8, 10000.0)
    weight = torch.randn(1, 6, 2, 8)

    def loss(x):
        return (rope(x * 2, cos, sin).float() * weight).sum()

    torch._dynamo.reset()
    (got,) = torch.autograd.grad(torch.compile(loss, backend="aot_eager")(x), x)
    # d/dx of <R(2x), w> = 2 R^T w = 2 R(-angle) w, written with complex numbers in float64
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    angle = pos.double()[..., None] * inv
    w = torch.view_as_complex(weight.double().reshape(1, 6, 2, 4, 2).contiguous())
    ref = torch.view_as_real(2 * w * torch.polar(torch.ones_like(angle), -angle)[:, :, None]).reshape(1, 6, 2, 8)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)


def test_materialize_is_deterministic_and_trains():
    cfg = model_config("debug")
    a, b = build_model(cfg), build_model(cfg)
    materialize(a, torch.device("cpu"), seed=5)
    materialize(b, torch.device("cpu"), seed=5)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    assert torch.equal(a.layers[0].attention_norm.weight, torch.ones(cfg.dim))
    c = build_model(cfg)
    materialize(c, torch.device("cpu"), seed=6)
    assert not torch.equal(a.tok_embeddings.weight, c.tok_embeddings.weight)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    logits = a(tokens, torch.arange(16))
    assert logits.shape == (2, 16, cfg.vocab_size) and torch.isfinite(logits).all()


def test_tied_embeddings_share_the_matrix():
    cfg = model_config("debug", tie_embeddings=True)
    model = build_model(cfg)
    materialize(model, torch.device("cpu"))
    assert model.output is None
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_zero_mesh_grids():
    # world 8 = dp 2 x sp 4; global rank = d * sp + local
    ranks, names = zero_mesh_ranks(8, 2, "sp")
    assert names == ("replicate", "shard") and ranks.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    ranks, _ = zero_mesh_ranks(8, 2, "dp")
    assert ranks.tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    ranks, names = zero_mesh_ranks(8, 2, "dp_sp")
    assert names == ("shard",) and ranks.tolist() == list(range(8))
    ranks, _ = zero_mesh_ranks(8, 2, "none")
    assert ranks.shape == (8, 1)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: model_config("70b"), "unknown model preset '70b'; choose one of"),
        (lambda: model_config("debug", n_head=3), "unknown ModelConfig field(s) ['n_head']"),
        (lambda: model_config("debug", n_heads=3, dim=64), "dim=64 is not divisible by n_heads=3"),
        (lambda: model_config("debug", n_heads=4, n_kv_heads=3), "n_heads=4 is not a multiple of n_kv_heads=3"),
        (lambda: check_zero_scope("zero3"), "unknown ZeRO scope 'zero3'; choose one of"),
        (lambda: check_activation_checkpoint("selective"), "unknown activation checkpoint mode 'selective'"),
        (lambda: check_activation_checkpoint("full", 0), "activation checkpoint every=0 must be a positive integer"),
    ],
)
def test_bad_model_configuration(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value)


@pytest.mark.parametrize(
    "heads, kv_heads, message",
    [
        (6, 6, "query heads H=6 are not divisible by hp=4"),
        (12, 3, "hp=4 exceeds the key/value heads G=3 but is not a multiple of G"),
        (24, 6, "key/value heads G=6 are not divisible by hp=4"),
    ],
)
def test_model_must_fit_the_layout(heads, kv_heads, message):
    cfg = model_config("debug", dim=16 * heads, n_heads=heads, n_kv_heads=kv_heads)
    with pytest.raises(ValueError, match=message):
        check_model_fits(cfg, 4)


@pytest.mark.parametrize("tile", [4096, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_normed_projections_equal_autograd_of_norm_then_linears(monkeypatch, tile, bias, dtype):
    """RMSNorm + the q/k/v projections as one function that keeps only the norm's input (its
    forward and backward in one tile of the 5 tokens, or three): output and every gradient equal autograd
    through the plain formula (float64 reference)."""
    from loongtrain.model import norm
    from loongtrain.model.lean import NormedProjections

    monkeypatch.setattr(norm, "TOKEN_TILE", tile)

    g = torch.Generator().manual_seed(0)
    d, eps = 16, 1e-5
    x = torch.randn(2, 5, d, generator=g)
    norm_w = 1 + 0.1 * torch.randn(d, generator=g)
    ws = [torch.randn(o, d, generator=g) / 4 for o in (16, 8, 8)]
    bs = [torch.randn(o, generator=g) if bias else None for o in (16, 8, 8)]
    douts = [torch.randn(2, 5, o, generator=g) for o in (16, 8, 8)]
    inputs = [x, norm_w, *ws, *(b for b in bs if b is not None)]

    def leaves(dt):
        return [t.detach().to(dt).requires_grad_() for t in inputs]

    got = leaves(dtype)
    bias_of = iter(got[5:])
    gb = [next(bias_of) if bias else None for _ in range(3)]
    outs = NormedProjections.apply(got[0], got[1], eps, got[2], gb[0], got[3], gb[1], got[4], gb[2])
    torch.autograd.backward(outs, [t.to(dtype) for t in douts])

    ref = leaves(torch.float64)
    xr = ref[0]
    h = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + eps) * ref[1]
    bias_of = iter(ref[5:])
    rb = [next(bias_of) if bias else None for _ in range(3)]
    want = [torch.nn.functional.linear(h, w, b) for w, b in zip(ref[2:5], rb)]
    torch.autograd.backward(want, [t.double() for t in douts])

    tol = 1e-6 if dtype == torch.float64 else 2e-2  # the norm statistics are float32 by design
    for a, b in zip(outs, want):
        assert ((a.double() - b).norm() / b.norm()).item() < tol
    for a, b in zip(got, ref):
        assert ((a.grad.double() - b.grad).norm() / b.grad.norm()).item() < tol


@pytest.mark.parametrize("tile", [4096, 2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_tiled_rms_norm_and_rope_equal_autograd_of_their_formulas(monkeypatch, tile, dtype):
    """The RMSNorm and RoPE functions, in one tile of the 5 tokens or three: output and every
    gradient equal float64 autograd through the plain formulas (the norm over [B, S, dim] and
    over heads [B, S, H, d] as Qwen3's q/k norms; RoPE as a complex rotation)."""
    from loongtrain.model import norm
    from loongtrain.model.norm import RMSNorm

    monkeypatch.setattr(norm, "TOKEN_TILE", tile)
    g = torch.Generator().manual_seed(1)
    tol = 1e-6 if dtype == torch.float64 else 2e-2  # the norm statistics and the rotation are float32 by design
    for shape in ((2, 5, 16), (2, 5, 3, 8)):
        x = torch.randn(shape, generator=g)
        w = 1 + 0.1 * torch.randn(shape[-1], generator=g)
        dout = torch.randn(shape, generator=g)
        norm = RMSNorm(shape[-1], 1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(w)
        xg = x.to(dtype).requires_grad_()
        out = norm(xg)
        out.backward(dout.to(dtype))
        xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
        want = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-5) * wr
        want.backward(dout.double())
        for a, b in ((out, want), (xg.grad, xr.grad), (norm.weight.grad, wr.grad)):
            assert ((a.double() - b).norm() / b.norm()).item() < tol

    pos = torch.tensor([[0, 7, 3, 100, 2], [1, 1, 1, 1, 1]])
    cos, sin = rope_tables(pos, 8, 10000.0)
    x = torch.randn(2, 5, 3, 8, generator=g)
    dout = torch.randn(2, 5, 3, 8, generator=g)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    angle = pos.double()[..., None] * inv
    xr = x.double().requires_grad_()
    z = torch.view_as_complex(xr.reshape(2, 5, 3, 4, 2))
    want = torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)[:, :, None]).reshape(2, 5, 3, 8)
    want.backward(dout.double())
    for rope in (apply_rope, tiled_rope):
        xg = x.to(dtype).requires_grad_()
        out = rope(xg, cos, sin)
        out.backward(dout.to(dtype))
        for a, b in ((out, want), (xg.grad, xr.grad)):
            assert ((a.double() - b).norm() / b.norm()).item() < tol, rope


@pytest.mark.parametrize("qwen", [False, True], ids=["llama", "qwen3-like"])
def test_the_pieces_parallelize_swaps_in_train_like_the_plain_model(monkeypatch, qwen):
    """``apply_memory_options`` swaps the lean norm + projections, the tiled RoPE and the tiled
    MLP into the plain model (tiles of 8 of 24 tokens here): loss and every gradient equal the
    plain formulas' (float64 weights; the norm statistics are float32 by design, and the lean
    pieces recompute the normalised input from them: ~3e-8 apart, measured)."""
    from loongtrain.apply import apply_memory_options, materialize
    from loongtrain.model import build_model, model_config, norm
    from loongtrain.options import MemoryOptions

    monkeypatch.setattr(norm, "TOKEN_TILE", 8)
    cfg = model_config("debug", qkv_bias=qwen, qk_norm=qwen)
    models = []
    for lean in (False, True):
        model = build_model(cfg)
        materialize(model, torch.device("cpu"), seed=3)
        model.double()
        if lean:
            apply_memory_options(model, MemoryOptions(loss_chunk=0, mlp_tile=8))
            assert model.layers[0].attention.rope is not apply_rope
        models.append(model)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 25), generator=g)
    results = []
    for model in models:
        loss, _ = model(tokens[:, :-1], torch.arange(24), labels=tokens[:, 1:])
        loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    (plain_loss, plain_grads), (lean_loss, lean_grads) = results
    assert abs(lean_loss.item() / plain_loss.item() - 1) < 1e-9
    for name, grad in plain_grads.items():
        assert ((lean_grads[name] - grad).norm() / grad.norm()).item() < 1e-6, name


def test_layer_kinds_match_a_float64_model_written_out():
    """Each layer reads its own kind: a sliding layer with its own RoPE base, a NoPE layer, a full
    layer on the model's linearly scaled RoPE: the float64 model written out layer by layer."""
    from loongtrain.model.config import LayerKind, RopeScaling

    from reference import reference_logits

    kinds = (LayerKind(5, rope_theta=100.0), LayerKind(rope=False), LayerKind())
    cfg = model_config("debug", n_layers=3, layer_kinds=kinds, rope_theta=1e5,
                       rope_scaling=RopeScaling("linear", 4.0))  # fmt: skip
    model = build_model(cfg)
    materialize(model, torch.device("cpu"), 0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(24).unsqueeze(0)
    want = reference_logits(model, tokens, positions, (5, 0, 0), ((100.0, 1.0), None, (1e5, 4.0)))
    got = model(tokens, positions)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-5
    # the same weights with one kind everywhere are another model
    plain = build_model(model_config("debug", n_layers=3))
    materialize(plain, torch.device("cpu"), 0)  # the same weights: a function of (seed, name)
    assert ((plain(tokens, positions).double() - want).norm() / want.norm()).item() > 1e-3
    assert [k.name for k in cfg.kinds] == ["sliding 5 rope 100", "full nope", "full rope 100000"]


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"layer_kinds": (1,) * 2}, "layer kind must be a LayerKind"),
        ({"n_layers": 3, "layer_kinds": ({},) * 2}, "2 layer_kinds for n_layers=3"),
        ({"max_positions": 64, "layer_kinds": ({"sliding_window": 128}, {})}, "larger than the model's positions"),
        ({"layer_kinds": ({"sliding_window": -1}, {})}, "must be 0"),
    ],
)
def test_bad_layer_kinds_are_refused(overrides, match):
    with pytest.raises((ValueError, TypeError), match=match):
        model_config("debug", **overrides)


def test_a_window_on_a_model_with_layer_kinds_sets_its_sliding_layers():
    from loongtrain.model.config import LayerKind, ModelConfig

    with pytest.raises(ValueError, match="both set"):
        ModelConfig(sliding_window=4, layer_kinds=(LayerKind(), LayerKind()))
    cfg = model_config("debug", layer_kinds=({"sliding_window": 3}, {}), sliding_window=9)
    assert cfg.windows == (9, 0) and cfg.sliding_window == 0
