"""The cost model against published measurements (tests/planner_anchors.py: each number's source).

- ring-flash-attention's zigzag ring reaches 89.8% (8xA100) and 90.2% (8xH800) of eight
  single-GPU flash_attn calls, forward + backward, at 8192 tokens per GPU; the kernel
  rates come from that table's own single-GPU column, so what is tested is the ring's
  cost around the kernels: merges, block-size efficiency, transfers, per-hop costs.
- TRL trains Qwen3-8B on 1M-token sequences on one 8xH100 node (cp=8, FSDP, full
  recompute) at 380 s/step; the h100 preset must predict it within 20%.
Pure: no processes."""

from __future__ import annotations

import pytest

from loongtrain.planner.specs import CLUSTER_PRESETS
from planner_anchors import (
    QWEN3_8B,
    RFA_FLASH_ITERS,
    RING_FLASH_ATTENTION_EFFICIENCY,
    TRL_STEP_SECONDS,
    flash_attention2_rates,
    ring_efficiency,
    ring_flash_attention_clusters,
    trl_qwen3_8b_1m,
)


@pytest.mark.parametrize("gpu", ["a100", "h800"])
def test_zigzag_ring_efficiency_within_five_points_of_ring_flash_attention(gpu):
    predicted = ring_efficiency(ring_flash_attention_clusters()[gpu])
    assert abs(predicted - RING_FLASH_ATTENTION_EFFICIENCY[gpu]) <= 0.05, f"{gpu}: predicted {predicted:.1%}"


def test_ring_efficiency_comes_from_the_cost_around_the_kernels():
    # with free merges, no per-hop cost and no block-size effect, the ring's kernels are the
    # single-GPU kernels split in eight: the efficiency is ~100% (>= the published 90%)
    from dataclasses import replace

    c = ring_flash_attention_clusters()["a100"]
    ideal = replace(c, hbm_bw_gbs=0.0, hop_sync_us=0.0, attn_wave_rows=0.0)
    assert ring_efficiency(ideal) > 0.99
    assert ring_efficiency(c) < ring_efficiency(ideal) - 0.03


def test_a100_preset_runs_the_published_flash_attention2_rates():
    a100 = CLUSTER_PRESETS["a100"]
    fwd, bwd = flash_attention2_rates(a100, *RFA_FLASH_ITERS["a100"])
    assert (a100.attn_fwd_tflops, a100.attn_bwd_tflops) == pytest.approx((fwd, bwd), rel=1e-3)
    # FlashAttention-2 on A100 reaches 50-73% of peak (FlashAttention-2 paper)
    assert 0.5 < fwd / a100.peak_tflops < 0.73 and 0.5 < bwd / a100.peak_tflops < 0.73


def test_trl_qwen3_8b_1m_step_on_8xh100_within_twenty_percent():
    check = trl_qwen3_8b_1m()
    assert check.published_s == TRL_STEP_SECONDS == 380.0
    assert 0.8 <= check.ratio <= 1.2, f"predicted {check.predicted_s:.0f} s"
    # the setting is Qwen3-8B's published shape: 36 layers of 4096, 32 query / 8 KV heads, FFN 12288
    assert (QWEN3_8B.n_layers, QWEN3_8B.dim, QWEN3_8B.n_heads, QWEN3_8B.n_kv_heads) == (36, 4096, 32, 8)
    assert 7.5e9 < QWEN3_8B.num_params() < 8.5e9
