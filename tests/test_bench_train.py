"""``loongtrain bench train`` end to end at a tiny size: it builds the trainer's run, times
steps and profiles one; what it writes is consistent (tokens/s from the step time, the
four parts of the breakdown add up to the profiled step, the attention kernels and the
transfers are seen)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_bench_train_rows_are_consistent(tmp_path):
    config = tmp_path / "tiny.toml"
    main_job = (REPO / "configs" / "debug_cpu.toml").read_text()
    config.write_text(
        main_job.replace("hp = 2", "hp = 1").replace("ring_window = 2", "ring_window = 1")
    )  # cp=2 on 2 ranks
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "loongtrain", "bench", "train", "--nproc", "2", "--config", str(config),
           "--cases", "main", "--modes", "eager", "--steps", "2", "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert (row["case"], row["mode"], row["world"]) == ("main", "eager", 2)
    assert row["tokens_per_step"] == 16 * 256
    assert row["tokens_per_s_per_device"] == pytest.approx(16 * 256 / row["step_s"] / 2)
    assert sum(row["share"].values()) == pytest.approx(1.0)
    for rank in row["per_rank"]:
        parts = sum(rank[k] for k in ("attention", "communication", "compute", "framework"))
        assert parts == pytest.approx(rank["wall_s"], rel=1e-6)
        assert rank["attention"] > 0 and rank["communication"] > 0 and rank["compute"] > 0
    assert "main   eager" in done.stdout


@pytest.mark.unit
def test_bench_train_refuses_bad_input_before_spawning(monkeypatch):
    """In process; spawning is replaced by an exception, so input that got through is seen."""
    import loongtrain.tools.bench.train as bench_train
    from loongtrain.cli import main

    def spawn(*args, **kwargs):
        raise AssertionError("spawned")

    monkeypatch.setattr(bench_train, "launch", spawn)
    with pytest.raises(SystemExit) as bad_case:
        main(["bench", "train", "--cases", "huge"])
    assert "unknown case or mode ['huge']" in str(bad_case.value.code)
    with pytest.raises(SystemExit) as missing:
        main(["bench", "train", "--config", "/no/such.toml"])
    assert missing.value.code == "bench train: config file '/no/such.toml' does not exist"


@pytest.mark.unit
def test_float8_modes_emulate_on_a_cpu_only(tmp_path):
    """A float8 mode turns float8 on with its recipe; on a CPU (no FP8 units) it emulates the
    matmuls, on a GPU it does not (the speed is what it measures there)."""
    import torch

    from loongtrain.tools.bench.train import DEFAULT_MODES, MAIN_CONFIG, case_config

    assert not any(m.startswith("float8") for m in DEFAULT_MODES)  # asked for by name
    for device, emulate in (("cpu", True), ("cuda", False)):
        cfg = case_config("main", "float8-rowwise", MAIN_CONFIG, tmp_path / device, torch.device(device))
        assert (cfg.float8.enabled, cfg.float8.recipe_name, cfg.float8.emulate) == (True, "rowwise", emulate)
    assert not case_config("main", "eager", MAIN_CONFIG, tmp_path / "plain", torch.device("cpu")).float8.enabled
