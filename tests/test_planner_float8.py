"""The planner's FP8 prices (planner/float8.py): matmul rates, casts, the float8 all-gather, refusals."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from loongtrain.model import model_config
from loongtrain.planner.cost import Candidate, Workload, linear_flops_fwd
from loongtrain.planner.estimate import estimate
from loongtrain.planner.float8 import CAST_BYTES, cast_elements, cast_seconds
from loongtrain.planner.specs import CLUSTER_PRESETS, PlanError, cluster_spec
from loongtrain.planner.zero import collective_seconds, group_shape, zero_seconds

H100 = CLUSTER_PRESETS["h100"]
MODEL = model_config("llama3-8b")


def _work(**float8) -> Workload:
    return Workload(MODEL, 32768, batch=8, micro_batch=1, **float8)


def test_hopper_fp8_is_twice_bf16_and_older_gpus_have_none():
    for name in ("h100", "h800", "h200"):
        c = CLUSTER_PRESETS[name]
        assert c.fp8_matmul_tflops == pytest.approx(2 * c.matmul_tflops, rel=1e-3)  # 1979 vs 989 dense
    assert CLUSTER_PRESETS["a100"].fp8_matmul_tflops == 0


def test_the_blocks_matmuls_run_at_the_fp8_rate():
    """Without casts (no memory bandwidth modelled) and no recompute, float8 saves exactly the
    blocks' three matmul passes at twice the rate; rowwise_with_gw_hp keeps the weight gradient's at bf16's."""
    c = dataclasses.replace(H100, hbm_bw_gbs=0.0, layer_token_ns=0.0)
    layout = Candidate.of(hp=8, cp=1, dp=1, activation_checkpoint="none")
    bf16 = estimate(c, _work(), layout)
    lin = linear_flops_fwd(_work(), 8)
    steps, layers = bf16.microbatches, MODEL.n_layers
    for recipe, fp8_passes in (("tensorwise", 3), ("rowwise", 3), ("rowwise_with_gw_hp", 2)):
        fp8 = estimate(c, _work(float8=recipe), layout)
        saved = steps * layers * fp8_passes * (lin / (c.matmul_tflops * 1e12) - lin / (c.fp8_matmul_tflops * 1e12))
        assert bf16.compute_s - fp8.compute_s == pytest.approx(saved, rel=1e-9), recipe


def test_cast_elements_by_hand():
    m = model_config("debug")  # dim 64, 4 heads of 16 (q 64), 2 kv heads (kv 32), ffn 176
    k_sum = 64 * 3 + 64 + 64 * 2 + 176  # inputs of wq, wk, wv, wo, w1, w3, w2
    n_sum = 64 + 32 + 32 + 64 + 176 * 2 + 64
    weights = 64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 176 * 64
    t = 10
    assert cast_elements(m, t, "tensorwise") == (t * k_sum + weights, t * n_sum + weights + t * k_sum)
    assert cast_elements(m, t, "rowwise") == (t * k_sum + weights, 2 * t * n_sum + weights + t * k_sum)
    assert cast_elements(m, t, "rowwise_with_gw_hp") == (t * k_sum + weights, 2 * t * n_sum + weights)
    forward, _ = cast_seconds(m, t, "tensorwise", 1000.0)
    assert forward == pytest.approx((t * k_sum + weights) * CAST_BYTES / 1e12)
    assert cast_seconds(m, t, "", 1000.0) == (0.0, 0.0)


def test_the_float8_all_gather_sends_the_weights_in_one_byte():
    layout = Candidate.of(hp=8, cp=1, dp=1)
    bf16 = zero_seconds(H100, MODEL, layout, 2)
    fp8 = zero_seconds(H100, MODEL, layout, 2, float8_all_gather=True)
    group = group_shape(tuple(range(8)), H100.devices_per_node)
    norms = MODEL.layer_params() - MODEL.layer_matmul_params()
    assert fp8.gather_layer == pytest.approx(
        collective_seconds(H100, group, MODEL.layer_matmul_params() + 2 * norms, "ag")
    )
    assert bf16.gather_layer == pytest.approx(collective_seconds(H100, group, 2 * MODEL.layer_params(), "ag"))
    assert fp8.reduce_layer == bf16.reduce_layer  # gradients are reduced in fp32 either way


def test_bad_float8_requests_are_refused():
    with pytest.raises(PlanError, match="needs the tensorwise recipe"):
        _work(float8="rowwise", float8_all_gather=True)
    with pytest.raises(PlanError, match="choose one of"):
        _work(float8="blockwise")
    tiled = estimate(H100, _work(float8="tensorwise"), Candidate.of(hp=8, dp=1, mlp_tile=4096))
    assert tiled.blocked and "bypass the float8 linears" in tiled.blocked
    assert cluster_spec("a100").fp8_matmul_tflops == 0


@pytest.mark.e2e
def test_plan_compares_bf16_and_float8_rows():
    run = [sys.executable, "-m", "loongtrain", "plan", "--model", "llama3-8b", "--devices", "8", "--seq-len", "32K"]
    out = subprocess.run([*run, "--cluster", "h100", "--float8", "tensorwise"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "bf16 vs float8 linears, the same layout" in out.stdout and "float8 / bf16 tokens/s: 1." in out.stdout
    assert 'recipe_name = "tensorwise"' in out.stdout  # the config to paste carries [float8]
    refused = subprocess.run([*run, "--cluster", "a100", "--float8", "rowwise"], capture_output=True, text=True)
    assert refused.returncode != 0 and "has no FP8 matmul units" in refused.stderr


def test_the_leanest_float8_layout_is_one_the_trainer_takes():
    """The memory floor behind "does not fit; N devices would" takes no tiled MLP and no head
    groups under float8 (the trainer refuses them), so it names a layout that would run."""
    from loongtrain.planner.search import leanest

    base = Candidate.of(hp=1, dp=1, activation_checkpoint="full")
    work = dataclasses.replace(_work(float8="tensorwise"), seq_len=1 << 22, batch=1)
    lean = leanest(H100, work, base)
    assert lean.memory.mlp_tile == 0 and lean.memory.head_groups == 1, lean.label()
    assert not estimate(H100, work, lean).blocked
    plain = leanest(H100, dataclasses.replace(work, float8=None), base)
    assert plain.memory.mlp_tile > 0 and plain.memory.head_groups > 1  # bf16 takes both
