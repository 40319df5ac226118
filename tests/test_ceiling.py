"""The step's ceiling (best measured kernels only): the matmul list against the model-FLOP
definition, the step time under uniform rates against a hand count, recomputation by policy,
errors, and the measurement on CPU at a tiny size."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from loongtrain.model.config import ModelConfig
from loongtrain.planner.ceiling import (
    KernelRates,
    attention_forward_flops,
    ceiling_step,
    fraction_of_ceiling,
    matmul_shapes,
    step_matmuls,
)

# the 1.1B Llama of the reference numbers
LLAMA_1B = ModelConfig(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=4, ffn_dim=8192)
# q width (heads x head_dim = 64) differs from dim: the q and o projections have different shapes
ODD = ModelConfig(vocab_size=100, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48, head_dim_override=16)


def uniform_rates(model: ModelConfig, tokens: int, tflops: float) -> KernelRates:
    """Every matmul and the attention kernel (its executed FLOPs: backward 2.5x forward) at ``tflops``."""
    attn = 2.0 * model.n_heads * model.head_dim * tokens * (tokens + 1)  # 4*H*d*(S+1)/2 per token
    rate = tflops * 1e12
    return KernelRates(tokens, {s: tflops for s in matmul_shapes(model, tokens)}, attn / rate, 2.5 * attn / rate)


def hand_layer_params(m: ModelConfig) -> int:
    """One layer's matmul weights, counted from the dimensions."""
    q, kv = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    return m.dim * q + 2 * m.dim * kv + q * m.dim + 3 * m.dim * m.ffn_dim


@pytest.mark.parametrize(
    "model,tokens",
    [(LLAMA_1B, 32768), (LLAMA_1B, 131072), (ODD, 37), (ModelConfig(tie_embeddings=True), 256), (ModelConfig(), 1)],
)
def test_matmuls_and_attention_make_the_model_flops(model, tokens):
    matmuls = step_matmuls(model, tokens)
    listed = sum(2.0 * m * k * n * mm.count for mm in matmuls for m, k, n in [mm.shape])
    attention = 3 * model.n_layers * attention_forward_flops(model, tokens)  # forward + 2x backward (model FLOPs)
    assert listed + attention == pytest.approx(tokens * model.flops_per_token(tokens), rel=1e-9)
    # seven weights per layer and the output layer, each forward + two backward matmuls
    assert len(matmuls) == 8 * 3
    assert sum(mm.count for mm in matmuls if mm.in_layer) == 7 * 3 * model.n_layers


def test_the_list_is_exact_so_a_missing_or_doubled_matmul_is_seen():
    tokens = 512
    full = sum(mm.flops for mm in step_matmuls(ODD, tokens)) + 3 * ODD.n_layers * attention_forward_flops(ODD, tokens)
    smallest = min(mm.flops for mm in step_matmuls(ODD, tokens))
    assert smallest / full > 1e-6  # far above the tolerance of the equality above


def test_shapes_are_grouped():
    t = 32768
    shapes = matmul_shapes(LLAMA_1B, t)
    assert len(shapes) == 12  # q/o, k/v and w1/w3 share theirs; w2's forward is w1's input gradient
    assert (t, 2048, 2048) in shapes and (t, 2048, 512) in shapes and (2048, t, 8192) in shapes
    assert (t, 2048, 32000) in shapes and (t, 32000, 2048) in shapes and (32000, t, 2048) in shapes
    by_name = {(mm.name, mm.phase): mm.shape for mm in step_matmuls(LLAMA_1B, t)}
    assert by_name["w1", "forward"] == (t, 2048, 8192)
    assert by_name["w1", "grad_input"] == (t, 8192, 2048)
    assert by_name["w1", "grad_weight"] == (8192, t, 2048)


@pytest.mark.parametrize("model,tokens", [(ODD, 64), (ModelConfig(), 256), (LLAMA_1B, 32768)])
def test_uniform_rate_step_is_flops_over_rate(model, tokens):
    r = 400.0
    c = ceiling_step(model, tokens, "none", 0, uniform_rates(model, tokens, r), peak_tflops=1000.0)
    # 6 x parameters per token for the matmuls (layers and output layer) and 1 + 2.5 forwards of
    # the causal attention, 2 * H * head_dim * T * (T + 1) per layer forward
    matmuls = 6.0 * tokens * (model.n_layers * hand_layer_params(model) + model.dim * model.vocab_size)
    attention = 3.5 * model.n_layers * 2.0 * model.n_heads * model.head_dim * tokens * (tokens + 1)
    assert c.step_s == pytest.approx((matmuls + attention) / (r * 1e12), rel=1e-12)
    assert c.tokens_per_s == pytest.approx(tokens / c.step_s, rel=1e-12)
    assert c.matmul_flops == pytest.approx(matmuls, rel=1e-12)
    assert c.attention_flops == pytest.approx(attention * 3 / 3.5, rel=1e-12)
    assert c.score_recompute_flops == pytest.approx(attention * 0.5 / 3.5, rel=1e-12)
    assert c.recompute_flops == 0 and c.recompute_s == 0
    assert c.executed_flops == pytest.approx(matmuls + attention, rel=1e-12)
    assert c.model_flops == pytest.approx(tokens * model.flops_per_token(tokens), rel=1e-12)
    assert c.mfu == pytest.approx(c.model_flops / c.step_s / 1e15, rel=1e-12)
    assert c.mfu < r / 1000.0  # the score recompute is executed but not model FLOPs
    assert ceiling_step(model, tokens, "none", 0, uniform_rates(model, tokens, r)).mfu is None


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_recompute_by_policy(k):
    model, tokens, r = ODD, 128, 250.0
    rates = uniform_rates(model, tokens, r)
    none = ceiling_step(model, tokens, "none", 0, rates)
    sc = ceiling_step(model, tokens, "sc++", k, rates)
    full = ceiling_step(model, tokens, "full", k, rates)
    layer_forward = 2.0 * tokens * hand_layer_params(model)  # one layer's forward matmuls
    attn = 2.0 * model.n_heads * model.head_dim * tokens * (tokens + 1)
    assert sc.step_s - none.step_s == pytest.approx(k * layer_forward / (r * 1e12), rel=1e-9, abs=1e-18)
    assert full.step_s - sc.step_s == pytest.approx(k * attn / (r * 1e12), rel=1e-9, abs=1e-18)
    assert sc.recompute_flops == pytest.approx(k * layer_forward, rel=1e-12)
    assert full.recompute_flops == pytest.approx(k * (layer_forward + attn), rel=1e-12)
    assert none.model_flops == sc.model_flops == full.model_flops  # recomputation is not model FLOPs
    if k:
        assert none.step_s < sc.step_s < full.step_s
        assert none.mfu is None and none.tokens_per_s > sc.tokens_per_s > full.tokens_per_s


def test_recompute_uses_the_measured_rates_of_the_forward_shapes():
    tokens = 64
    rates = uniform_rates(ODD, tokens, 100.0)
    slow = dict(rates.matmul_tflops)
    forward = {mm.shape for mm in step_matmuls(ODD, tokens) if mm.in_layer and mm.phase == "forward"}
    for shape in forward:
        slow[shape] = 50.0  # every layer forward matmul at half the rate
    halved = KernelRates(tokens, slow, rates.attention_fwd_s, rates.attention_bwd_s)
    extra = ceiling_step(ODD, tokens, "sc++", 2, halved).recompute_s
    assert extra == pytest.approx(2 * 2.0 * tokens * hand_layer_params(ODD) / 50e12, rel=1e-12)


def test_fraction_of_ceiling():
    c = ceiling_step(ODD, 64, "none", 0, uniform_rates(ODD, 64, 100.0))
    assert fraction_of_ceiling(c.tokens_per_s / 2, c) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="measured_tokens_per_s=0 must be positive"):
        fraction_of_ceiling(0, c)


def test_bad_input_names_the_problem_and_the_fix():
    rates = uniform_rates(ODD, 64, 100.0)
    with pytest.raises(ValueError, match=r"checkpointed=4 but the model has 3 layers; use at most 3"):
        ceiling_step(ODD, 64, "sc++", 4, rates)
    with pytest.raises(ValueError, match=r"checkpointed=-1 must be a layer count from 0 to 3"):
        ceiling_step(ODD, 64, "full", -1, rates)
    with pytest.raises(
        ValueError, match=r"unknown checkpoint mode 'selective'; choose one of \['none', 'full', 'sc\+\+'\]"
    ):
        ceiling_step(ODD, 64, "selective", 1, rates)
    with pytest.raises(ValueError, match=r"mode 'none' checkpoints no layer but checkpointed=2; use 0"):
        ceiling_step(ODD, 64, "none", 2, rates)
    for tokens in (0, -5):
        with pytest.raises(ValueError, match=rf"tokens={tokens} must be a positive integer"):
            ceiling_step(ODD, tokens, "none", 0, rates)
        with pytest.raises(ValueError, match=rf"tokens={tokens} must be a positive integer"):
            step_matmuls(ODD, tokens)
    with pytest.raises(ValueError, match=r"measured at tokens=64, the step has tokens=128; measure at 128"):
        ceiling_step(ODD, 128, "none", 0, rates)
    missing = dict(rates.matmul_tflops)
    gone = matmul_shapes(ODD, 64)[0]
    del missing[gone]
    with pytest.raises(
        ValueError, match=re.escape(f"no measured rate for matmul shape(s) [{gone}]; measure every shape")
    ):
        ceiling_step(ODD, 64, "none", 0, KernelRates(64, missing, 1.0, 1.0))
    with pytest.raises(ValueError, match=r"attention_bwd_s=0.0 must be positive seconds"):
        ceiling_step(ODD, 64, "none", 0, KernelRates(64, rates.matmul_tflops, 1.0, 0.0))
    with pytest.raises(ValueError, match=r"peak_tflops=0 must be positive"):
        ceiling_step(ODD, 64, "none", 0, rates, peak_tflops=0)


def test_pure_module_imports_no_torch():
    code = "import sys, loongtrain.planner.ceiling; print(any(m.split('.')[0] == 'torch' for m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_measurement_runs_on_cpu_at_a_tiny_size():
    import torch

    from loongtrain.tools.gpucheck.ceiling import measure_ceiling

    model = ModelConfig(dim=64, n_layers=2)
    tokens = 256
    _, report = measure_ceiling(model, tokens, torch.float32, torch.device("cpu"), reps=2, min_time_s=0.002,
                             peak_tflops=1.0)  # fmt: skip
    json.dumps(report)  # fit for JSON
    assert report["device"] == "cpu" and report["dtype"] == "float32" and report["tokens"] == tokens
    assert [tuple(row["shape"]) for row in report["matmuls"]] == list(matmul_shapes(model, tokens))
    assert all(row["tflops"] > 0 and row["seconds"] > 0 and row["uses"] for row in report["matmuls"])
    att = report["attention"]
    assert att["fwd_s"] > 0 and att["bwd_s"] > 0 and att["kernel"] == "cpu"
    policies = report["policies"]
    assert [(p["mode"], p["checkpointed"]) for p in policies] == [("none", 0), ("sc++", 2), ("full", 2)]
    for p in policies:
        assert math.isfinite(p["step_s"]) and p["step_s"] > 0 and p["tokens_per_s"] > 0 and p["mfu"] > 0
    assert policies[0]["step_s"] < policies[1]["step_s"] < policies[2]["step_s"]
    print(json.dumps(report, indent=1))
