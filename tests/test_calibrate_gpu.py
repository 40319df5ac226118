"""``loongtrain plan --calibrate-gpu``: the planner's cluster fitted to a GPU check report, on a
report recorded from the first H200 run's numbers (tests/data; its ``source`` says which)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loongtrain.planner import calibrate_gpu
from loongtrain.planner.cost import block_seconds
from loongtrain.planner.specs import PlanError, cluster_spec

REPORT = Path(__file__).parent / "data" / "gpu_check_h200_2026-12-04.json"

pytestmark = pytest.mark.unit


def test_the_h200_report_calibrates_the_planner_to_its_steps(tmp_path):
    report = calibrate_gpu.read_report(REPORT)
    cluster, checks, comments = calibrate_gpu.calibrate(cluster_spec("h200"), report)
    cal = report["rows"][0]["values"]
    assert cluster.matmul_tflops == cal["matmul"]["tflops"] and cluster.hbm_bw_gbs == cal["hbm"]["gbs"]
    assert cluster.layer_token_ns > 0 and set(comments) >= {"matmul_tflops", "attn_fwd_tflops", "layer_token_ns"}
    # the fitted block model gives back the measured kernel times (a line through two lengths a pass;
    # FA2's rate falls from 32K to 128K, so the intercept stops at its floor and the line misses a little)
    model = calibrate_gpu.ModelConfig(**report["environment"]["train_model"])
    for m in cal["attention"]:
        t = block_seconds(cluster, calibrate_gpu._workload(model, m["seq"], 2), 1, 1)
        assert t.kernel_fwd_first == pytest.approx(m["fwd_s"], rel=0.08)
        assert t.kernel_fwd_first + t.kernel_bwd_first == pytest.approx(m["fwd_bwd_s"], rel=0.08)
    # the bounds: step time within 15%, peak memory within 5%, on every measured row
    assert len(checks) == 2
    for row in checks:
        assert abs(row.time_error) <= 0.15 and abs(row.memory_error) <= 0.05, row
    # the preset predicts the same rows 1.8x too fast (the first GPU run)
    preset = calibrate_gpu._predict(cluster_spec("h200"), model, 2, calibrate_gpu.training_rows(report)[0])[0]
    assert checks[0].measured_s / preset > 1.5
    # the written file is a cluster the planner reads back, with the same predictions
    text = calibrate_gpu.run(str(REPORT), cluster_spec("h200"), str(tmp_path / "h200.toml"))
    assert "worst step-time error" in text and "written to" in text
    again = cluster_spec(str(tmp_path / "h200.toml"))
    assert again.name == "h200-calibrated" and again.layer_token_ns == pytest.approx(cluster.layer_token_ns, rel=1e-5)
    row = calibrate_gpu.training_rows(report)[1]
    assert calibrate_gpu._predict(again, model, 2, row)[0] == pytest.approx(checks[1].predicted_s, rel=1e-4)


def test_a_report_without_calibration_is_refused_with_the_fix(tmp_path):
    report = json.loads(REPORT.read_text())
    report["rows"] = [r for r in report["rows"] if r["section"] != "calibrate"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(report))
    with pytest.raises(PlanError, match="no calibration row .* run `bash scripts/gpu_check.sh` of this version"):
        calibrate_gpu.read_report(path)
    with pytest.raises(PlanError, match="cannot read a GPU check report"):
        calibrate_gpu.read_report(tmp_path / "missing.json")


def test_the_command_refuses_what_it_cannot_calibrate_in_one_line(tmp_path, capsys):
    """A report of no known GPU without --cluster, and a cluster file that cannot be written."""
    import argparse

    from loongtrain import plan_cli

    report = json.loads(REPORT.read_text())
    report["environment"].pop("gpu")
    report["environment"]["device"] = "cpu"
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(report))
    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    with pytest.raises(SystemExit) as stop:
        plan_cli.main(parser.parse_args(["--calibrate-gpu", str(path)]))
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["loongtrain plan: error: --calibrate-gpu: the report was made on cpu (no GPU), which no preset "
                   "matches; pass --cluster PRESET_OR_FILE"]  # fmt: skip
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(PlanError, match="cannot write the cluster file .* choose another path"):
        calibrate_gpu.run(str(REPORT), cluster_spec("h200"), str(blocked / "h200.toml"))


def test_the_attention_fit_recovers_the_rates_its_timings_came_from():
    """What the calibration computes from the numbers it is given (issue 53: not from timings a loaded
    machine can invert): kernel times made by known rates and overheads are fitted back to them."""
    from dataclasses import replace

    from loongtrain.model import model_config

    base = cluster_spec("h200")
    true = replace(base, attn_fwd_tflops=300.0, attn_bwd_tflops=180.0, kernel_overhead_us=25.0,
                   kernel_bwd_overhead_us=60.0)  # fmt: skip
    model = model_config("llama3-8b")
    measured = []
    for seq in (2048, 8192, 32768):
        t = block_seconds(true, calibrate_gpu._workload(model, seq, 2), 1, 1)
        measured.append({"seq": seq, "heads": model.n_heads, "kv_heads": model.n_kv_heads,
                         "head_dim": model.head_dim, "fwd_s": t.kernel_fwd_first, "bwd_s": t.kernel_bwd_first})
    fit = calibrate_gpu._attention_fit(base, model, 2, measured)
    assert fit["attn_fwd_tflops"] == pytest.approx(300.0, rel=1e-6)
    assert fit["attn_bwd_tflops"] == pytest.approx(180.0, rel=1e-6)
    assert fit["kernel_overhead_us"] == pytest.approx(25.0, rel=1e-6)
    assert fit["kernel_bwd_overhead_us"] == pytest.approx(60.0, rel=1e-6)
