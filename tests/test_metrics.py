"""Throughput arithmetic and the learning-rate schedule, against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from loongtrain.data.batch import Microbatch
from loongtrain.model import PRESETS, model_config
from loongtrain.train.metrics import batch_flops_per_token, flops_per_token, mfu
from loongtrain.train.schedule import lr_at


def test_flops_per_token_by_hand():
    cfg = model_config("debug", vocab_size=100, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=16)
    # per layer: q 8x8, k 8x4, v 8x4, o 8x8, mlp 3 x 8x16 -> 64+32+32+64+384 = 576 MACs
    # attention at S=9, causal: 2 heads x 4 dims x mean context 5 x 2 matmuls = 80 MACs
    # output layer 8x100 = 800 MACs; FLOPs = 2 x MACs, training = 3 x forward
    forward_macs = 2 * (576 + 80) + 800
    assert flops_per_token(cfg, 9) == 3 * 2 * forward_macs
    full_attention = 2 * (576 + 2 * 4 * 9 * 2) + 800
    assert flops_per_token(cfg, 9, causal=False) == 3 * 2 * full_attention


def test_7b_flops_match_6n_plus_attention():
    cfg = PRESETS["7b-mha"]
    seq = 4096
    non_embedding = cfg.num_params() - 2 * cfg.vocab_size * cfg.dim - cfg.dim - 2 * cfg.n_layers * cfg.dim
    expected = 6 * (non_embedding + cfg.vocab_size * cfg.dim) + 6 * cfg.n_layers * cfg.dim * (seq + 1)
    assert flops_per_token(cfg, seq) == pytest.approx(expected, rel=1e-12)


def _visible_keys(seq: int, cu: list[int] | None, window: int) -> int:
    """Brute force: count (i, j) with j <= i, same document, i - j < window (0: none)."""
    doc = (
        torch.zeros(seq, dtype=torch.long)
        if cu is None
        else torch.bucketize(torch.arange(seq), torch.tensor(cu[1:]), right=True)
    )
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    visible = (j <= i) & (doc[:, None] == doc[None, :])
    if window:
        visible &= i - j < window
    return int(visible.sum())


@pytest.mark.parametrize("window", [0, 5])
def test_batch_flops_count_the_keys_the_masks_leave(window):
    """Packed documents and a sliding window cut the attention FLOPs to the visible pairs
    (brute-force mask count); one unmasked document per row is the causal formula."""
    cfg = model_config(
        "debug", vocab_size=100, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=16, sliding_window=window
    )
    seq, cu = 24, [0, 3, 10, 11, 24]
    tokens = torch.zeros(1, seq, dtype=torch.long)
    packed = Microbatch(tokens, tokens, torch.tensor(cu))
    plain = Microbatch(torch.zeros(2, seq, dtype=torch.long), torch.zeros(2, seq, dtype=torch.long))
    unmasked = Microbatch(tokens, tokens, torch.tensor(cu), mask_documents=False)
    keys = _visible_keys(seq, cu, window) + 2 * _visible_keys(seq, None, window) + _visible_keys(seq, None, window)
    expected = cfg.flops_per_token(seq, keys_per_query=keys / (4 * seq))
    assert batch_flops_per_token(cfg, [packed, plain, unmasked]) == pytest.approx(expected, rel=1e-12)
    if not window:
        assert batch_flops_per_token(cfg, [plain]) == pytest.approx(flops_per_token(cfg, seq), rel=1e-12)
    # attention per query per layer and head: 2 matmuls x head_dim 4 x keys, x2 FLOPs, x3 training
    per_key = 3 * 2 * cfg.n_layers * 2 * cfg.n_heads * cfg.head_dim
    dense = cfg.flops_per_token(seq, keys_per_query=0.0)
    assert batch_flops_per_token(cfg, [packed]) == pytest.approx(dense + per_key * _visible_keys(seq, cu, window) / seq)


def test_mfu():
    assert mfu(1000.0, 6e9, 312.0) == pytest.approx(1000 * 6e9 / 312e12)
    assert mfu(1000.0, 6e9, None) is None


def test_lr_schedule():
    kw = dict(lr=1.0, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert all(lr_at(s, **kw) >= lr_at(s + 1, **kw) for s in range(10, 110))
    assert math.isclose(lr_at(0, lr=2.0, warmup_steps=0, total_steps=5, min_lr_ratio=0.0), 2.0)


def test_trainer_and_planner_count_the_same_model_flops():
    from loongtrain.planner.cost import Candidate, Workload, model_flops_per_microbatch

    cfg, seq = PRESETS["7b-gqa"], 8192
    assert flops_per_token(cfg, seq) == cfg.flops_per_token(seq)
    assert flops_per_token(cfg, seq, causal=False) == cfg.flops_per_token(seq, causal=False)
    # every rank of an sp group of 8 counts 1/8 of the micro-batch's 2 x 8192 tokens
    per_rank = model_flops_per_microbatch(Workload(cfg, seq, batch=2, micro_batch=2), Candidate.of(hp=2, cp=4))
    assert 8 * per_rank == pytest.approx(2 * seq * flops_per_token(cfg, seq), rel=1e-12)


def _refuse(constant: str):
    raise ValueError(f"not strict JSON: {constant}")


def test_metrics_lines_are_strict_json_and_an_absent_source_is_left_out(tmp_path, capsys):
    import json

    from loongtrain.train.metrics import read_metrics
    from loongtrain.train.report import Reporter, StepMetrics
    from loongtrain.train.step import SourceNumbers

    reporter = Reporter(
        tmp_path, enabled=True, total_steps=2, log_every=1, first_step=0, tensorboard=False, progress="off"
    )  # fmt: skip
    sources = (SourceNumbers("books", 2.5, 10, 12), SourceNumbers("code", math.nan, 0, 0))
    common = dict(accuracy=0.5, lr=1e-3, step_s=1.0, tokens_per_s_per_device=10.0, tflops_per_device=0.0,
                  peak_memory_gib=0.1, sources=sources)  # fmt: skip
    reporter.step(StepMetrics(step=1, loss=2.5, grad_norm=1.0, mfu=None, **common))
    reporter.step(StepMetrics(step=2, loss=math.nan, grad_norm=math.inf, mfu=math.nan, guard="skipped", **common))
    reporter.evaluation(2, 2.4, 0.5, {"books": 2.4, "code": math.nan})
    reporter.close()
    printed = capsys.readouterr().out
    assert "(books 2.500)" in printed and "code" not in printed and "(books 2.400)" in printed
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=_refuse) for line in lines]  # a strict parser reads every line
    assert [r["kind"] for r in records] == ["train", "train", "eval"]
    assert records[0]["loss/books"] == 2.5 and "loss/code" not in records[0]
    assert records[0]["targets/code"] == 0 and records[0]["tokens/code"] == 0
    assert records[1]["loss"] is None and records[1]["grad_norm"] is None and records[1]["mfu"] is None
    assert records[2]["loss/books"] == 2.4 and "loss/code" not in records[2]
    assert read_metrics(tmp_path / "metrics.jsonl") == records


def test_cpu_memory_is_labelled_as_the_resident_set_it_is():
    from loongtrain.train.report import StepMetrics

    common = dict(step=1, loss=2.0, accuracy=0.5, grad_norm=1.0, lr=1e-3, step_s=1.0, tokens_per_s_per_device=1.0,
                  tflops_per_device=0.0, mfu=None, peak_memory_gib=0.34)  # fmt: skip
    assert "| peak RSS 0.34 GiB" in StepMetrics(**common, memory_is_rss=True).line()
    assert "| mem 0.34 GiB" in StepMetrics(**common).line()
    assert "memory_is_rss" not in StepMetrics(**common, memory_is_rss=True).record()
