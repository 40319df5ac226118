"""FP8 training's options, filter, refusals and single-process properties (no processes).

The layout invariance on process groups is tests/test_float8_dist.py."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from torch import nn

from loongtrain.apply import materialize
from loongtrain.apply.float8 import (
    apply_float8,
    auto_filter_keeps,
    exclusion_reason,
    float8_modules,
    float8_plan,
    require_torchao,
)
from loongtrain.config import ConfigError, load_config
from loongtrain.model import build_model, model_config
from loongtrain.options import Float8Options, check_float8_device
from loongtrain.train.preflight import preflight

pytest.importorskip("torchao", reason="FP8 training needs torchao: pip install -e '.[fp8]'")

ON = ["float8.enabled=true"]


def _cfg(tmp_path, *overrides: str):
    return load_config(None, [f"run.output_dir={tmp_path / 'run'}", "run.device=cpu", *overrides])


def test_off_by_default_and_keys_beside_the_other_sections():
    cfg = load_config(None)
    assert cfg.float8.options() == Float8Options() and not cfg.float8.enabled
    assert cfg.float8.recipe_name == "tensorwise"  # torchtitan's default
    on = load_config(None, [*ON, "float8.recipe_name=rowwise_with_gw_hp", "float8.filter_fqns=wq, w2"])
    assert on.float8.options().fqn_filters() == ("wq", "w2")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["float8.recipe_name=blockwise"], "float8.recipe_name='blockwise'; choose one of ['tensorwise', 'rowwise'"),
        (
            [*ON, "float8.recipe_name=rowwise", "float8.enable_fsdp_float8_all_gather=true"],
            "needs recipe_name='tensorwise' (got 'rowwise')",
        ),
        (["float8.precompute_float8_dynamic_scale_for_fsdp=true"], "set enable_fsdp_float8_all_gather=true too"),
        ([*ON, "memory.mlp_tile=64"], "memory.mlp_tile computes its projections from the weight tensors"),
        ([*ON, "memory.head_groups=2"], "memory.head_groups computes its projections from the weight tensors"),
    ],
)
def test_bad_float8_input_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=None) as info:
        load_config(None, overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_tiled_mlp_and_head_groups_stay_allowed_without_float8():
    load_config(None, ["memory.mlp_tile=64", "memory.head_groups=2"])


def test_a_gpu_without_fp8_units_is_refused_naming_it():
    on = Float8Options(enabled=True)
    with pytest.raises(ValueError, match=r"NVIDIA A100-SXM4-80GB has 8\.0: set float8.emulate=true"):
        check_float8_device("cuda", (8, 0), "NVIDIA A100-SXM4-80GB", on)
    check_float8_device("cuda", (8, 0), "NVIDIA A100-SXM4-80GB", dataclasses.replace(on, emulate=True))
    check_float8_device("cuda", (8, 9), "NVIDIA L4", on)
    check_float8_device("cuda", (9, 0), "NVIDIA H100 80GB HBM3", on)
    check_float8_device("cpu", None, "", on)  # torch._scaled_mm runs on the CPU
    check_float8_device("cuda", (7, 0), "Tesla V100", Float8Options())  # off: nothing to check


def test_a_filter_that_leaves_nothing_is_a_warning_naming_it(tmp_path):
    (notice,) = preflight(_cfg(tmp_path, *ON, "float8.filter_fqns=attention,feed_forward"), 1).notices
    assert notice.startswith("warning: float8.enabled but no linear is converted")
    assert "filter_fqns 'attention'" in notice and "\n" not in notice
    assert preflight(_cfg(tmp_path, *ON, "float8.emulate=true"), 1).notices == ()  # the debug model: 14 in float8
    (slow,) = preflight(_cfg(tmp_path, *ON), 1).notices
    assert "torch._scaled_mm's reference kernel" in slow and "float8.emulate=true" in slow


def test_missing_or_old_torchao_is_one_line_naming_the_install(monkeypatch):
    import torchao

    monkeypatch.setattr(torchao, "__version__", "0.16.0")
    with pytest.raises(ValueError, match=r"torchao >= 0.18, found 0.16.0: pip install 'torchao>=0.18,<0.19'"):
        require_torchao()
    monkeypatch.setitem(sys.modules, "torchao", None)  # what Python does for a package that is not there
    with pytest.raises(ValueError, match="torchao >= 0.18, which is not installed .*pip install"):
        require_torchao()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_size_filter_is_torchaos(recipe):
    """``auto_filter_small_kn`` decides as torchao's own ``_auto_filter_for_recipe`` on a grid of shapes."""
    from torchao.float8 import _auto_filter_for_recipe

    theirs = _auto_filter_for_recipe(recipe, filter_fqns=[])
    options = Float8Options(enabled=True, recipe_name=recipe, auto_filter_small_kn=True)
    for n in (16, 1024, 1040, 2048, 2064, 4096, 4112, 8192, 14336):
        for k in (16, 1024, 1040, 2048, 2064, 4096, 4112, 8192):
            with torch.device("meta"):
                linear = nn.Linear(k, n, bias=False)
            assert (exclusion_reason("layers.0.w1", n, k, options) is None) == theirs(linear, "layers.0.w1"), (n, k)
            assert auto_filter_keeps(recipe, n, k) == theirs(linear, "x")


def test_the_start_up_line_names_what_is_float8_and_what_is_not():
    model = build_model(model_config("debug", ffn_dim=168))  # 168 = 10.5 x 16: the MLP stays high precision
    plan = float8_plan(model, Float8Options(enabled=True, filter_fqns="wv"))
    assert plan.converted == ("layers.0.attention.wq", "layers.0.attention.wk", "layers.0.attention.wo",
                              "layers.1.attention.wq", "layers.1.attention.wk", "layers.1.attention.wo")  # fmt: skip
    line = plan.describe()
    assert line.startswith("float8 (tensorwise): 6 linear(s) in float8; kept in high precision: ")
    assert "layers.0.attention.wv, layers.1.attention.wv (filter_fqns 'wv')" in line
    assert "(dims 168x64 not multiples of 16)" in line and "output (output layer)" in line


def test_checkpoints_and_hf_weights_are_unchanged_by_float8():
    """The float8 model's parameters are the plain model's: same names, shapes and dtype (the
    float8 copies exist only inside the matmuls), so checkpoints and HF export are unchanged."""
    plain, fp8 = build_model(model_config("debug")), build_model(model_config("debug"))
    apply_float8(fp8, Float8Options(enabled=True, recipe_name="rowwise"))
    assert len(float8_modules(fp8)) == 14 and not float8_modules(plain)
    for model in (plain, fp8):
        materialize(model, torch.device("cpu"), seed=1)
    theirs = plain.state_dict()
    assert list(fp8.state_dict()) == list(theirs)
    for name, tensor in fp8.state_dict().items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, theirs[name]), name


def _float8_linear(emulate: bool, recipe: str) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=False))
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    return convert_to_float8_training(model, config=config)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_emulate_is_scaled_mm_on_the_cpu(recipe):
    """``emulate`` (the float8 operands widened and multiplied in fp32) gives what ``torch._scaled_mm``
    computes on the CPU, output and both gradients. For the rowwise recipes torchao asks
    ``_scaled_mm`` for a bf16 result and widens it (torch has no fp32 output for rowwise scales,
    pytorch#156771): there ``_scaled_mm`` is the emulated product rounded to bf16."""
    x = torch.randn(3, 16, 64)
    dout = torch.randn(3, 16, 96)
    results = []
    for emulate in (True, False):
        model = _float8_linear(emulate, recipe)
        xi = x.clone().requires_grad_()
        out = model(xi)
        out.backward(dout)
        results.append((out.detach(), xi.grad, model[0].weight.grad))
    rowwise = recipe != "tensorwise"
    for i, (emulated, scaled) in enumerate(zip(*results)):
        hp = i == 2 and recipe == "rowwise_with_gw_hp"  # the weight gradient in high precision: no _scaled_mm
        if rowwise and not hp:
            emulated = emulated.bfloat16().float()
        tol = 2**-9 if rowwise and not hp else 1e-6  # a bf16 rounding may fall on the other side
        assert ((scaled - emulated).norm() / emulated.norm()).item() < tol, (i, (scaled - emulated).abs().max())
    plain = nn.Linear(64, 96, bias=False)
    plain.load_state_dict(_float8_linear(True, recipe)[0].state_dict())
    assert not torch.allclose(plain(x), results[0][0], rtol=1e-3), "float8 differs from fp32"


@pytest.mark.e2e  # inductor compiles a float8 block: ~30 s cold, ~5 s from its cache
@pytest.mark.slow
def test_compiled_float8_block_equals_eager():
    """One float8 transformer block compiled by inductor on the CPU gives its eager output and
    gradients in fp32 (rowwise_with_gw_hp: the float8 casts fused into the compiled graph)."""
    mcfg = model_config("debug", n_layers=1)
    models = []
    for _ in range(2):
        model = build_model(mcfg)
        apply_float8(model, Float8Options(enabled=True, recipe_name="rowwise_with_gw_hp"))
        materialize(model, torch.device("cpu"), seed=2)
        models.append(model)
    models[1].layers[0].compile(fullgraph=True)
    tokens = torch.randint(0, mcfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    outs = []
    for model in models:
        logits = model(tokens, torch.arange(32))
        logits.float().logsumexp(-1).mean().backward()
        outs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (eager, eager_grads), (compiled, compiled_grads) = outs
    assert ((compiled - eager).norm() / eager.norm()).item() < 1e-5
    for name, grad in eager_grads.items():
        assert ((compiled_grads[name] - grad).norm() / grad.norm()).item() < 1e-4, name
