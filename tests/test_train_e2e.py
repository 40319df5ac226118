"""The trainer end to end on gloo ranks: bit-exact resume, resume on another layout,
and the same losses under different layouts."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from loongtrain.config import ConfigError, load_config
from loongtrain.data import TokenFileError, write_tokens
from loongtrain.train.checkpoint import STATE_FILE, CheckpointError, CheckpointManager
from loongtrain.train.trainer import preflight, train

from dist_pool import cached_state  # noqa: F401  (keeps the worker import path in one place)

BASE = [
    "run.log_every=100", "run.eval_batches=1", "run.tensorboard=false", "run.progress=off",
    "data.seq_len=64", "data.global_batch=8", "data.recall_queries=8", "optim.warmup_steps=2",
    "checkpoint.every=0", "checkpoint.save_final=false",
]  # fmt: skip


def _train(overrides: list[str]) -> dict:
    cfg = load_config(None, BASE + overrides)
    world = torch.distributed.get_world_size()
    result = train(torch.device("cpu"), cfg, preflight(cfg, world))
    return {"losses": result.losses, "eval": result.eval_loss}


def _layout(hp=1, cp=1, window=1, dp=0, placement="head_first") -> list[str]:
    return [f"parallel.hp={hp}", f"parallel.cp={cp}", f"parallel.ring_window={window}", f"parallel.dp={dp}",
            f"parallel.placement={placement}"]  # fmt: skip


@pytest.mark.dist
def test_resume_is_bit_exact_and_keeps_latest(dist_pool, tmp_path):
    pool = dist_pool(4)
    layout = _layout(hp=2, cp=2, window=2) + ["memory.activation_checkpoint=sc++", "parallel.zero=dp_sp"]
    full = pool.run(_train, layout + ["run.steps=6", f"run.output_dir={tmp_path / 'a'}"])[0]["losses"]
    first = pool.run(_train, layout + ["run.steps=3", "checkpoint.every=1", "checkpoint.keep=2",
                                       f"run.output_dir={tmp_path / 'b'}"])[0]["losses"]  # fmt: skip
    assert [p.name for p in sorted((tmp_path / "b" / "checkpoints").iterdir())] == ["step-2", "step-3"]
    rest = pool.run(_train, layout + ["run.steps=6", f"run.output_dir={tmp_path / 'b'}"])[0]["losses"]
    assert first + rest == full, "resumed run must continue bit-exactly"
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    for r in (x for x in lines if x["kind"] == "train"):
        # per layer, one fp32 K/V block each way (forward, backward; sc++ recomputes no attention)
        # and one dK/dV partial: the metrics' ring bytes are 2 : 1, and the head all-to-all runs
        assert r["ring_dkv_mib"] > 0 and r["ring_kv_mib"] == pytest.approx(2 * r["ring_dkv_mib"])
        assert r["all_to_all_mib"] > 0
        # ZeRO-3 gathers each block twice (forward, backward) and the root once, and reduces each once
        assert 1 < r["zero_all_gather_mib"] / r["zero_reduce_mib"] < 2
    assert (tmp_path / "b" / "curves.png").stat().st_size > 0
    assert (tmp_path / "b" / "config.toml").is_file()


@pytest.mark.dist
def test_resume_on_other_layouts_and_world_sizes(dist_pool, tmp_path):
    base = ["memory.activation_checkpoint=full"]
    ref = dist_pool(4).run(_train, base + _layout(hp=2, cp=2) + ["run.steps=5", f"run.output_dir={tmp_path / 'r'}"])
    ref_losses = ref[0]["losses"]
    # one 2-step run on hp=2 x cp=2, copied for each resume (each resume writes its own folder)
    start = tmp_path / "start"
    dist_pool(4).run(_train, base + _layout(hp=2, cp=2) + ["run.steps=2", "checkpoint.save_final=true",
                                                           f"run.output_dir={start}"])  # fmt: skip
    for name, world, layout in [
        ("cp4w2", 4, _layout(cp=4, window=2)),
        ("dp2", 4, _layout(hp=2, dp=2, placement="context_first") + ["parallel.zero=sp"]),
        ("world2", 2, _layout(cp=2)),
    ]:
        out = tmp_path / name
        shutil.copytree(start, out)
        resumed = dist_pool(world).run(_train, base + layout + ["run.steps=5", f"run.output_dir={out}"])[0]["losses"]
        assert len(resumed) == 3
        np.testing.assert_allclose(resumed, ref_losses[2:], rtol=2e-5, err_msg=name)


def _train_recording_memory(overrides: list[str]) -> dict:
    """:func:`_train`, with the memory options and checkpoint policy the run was built with."""
    cfg = load_config(None, BASE + overrides)
    seen: dict = {}

    def after_step(run, done, reporter, beat) -> None:
        seen.setdefault("memory", dataclasses.asdict(run.spec.memory))
        seen.setdefault("policy", run.policy.describe() if run.policy is not None else None)

    world = torch.distributed.get_world_size()
    result = train(torch.device("cpu"), cfg, preflight(cfg, world), after_step=after_step)
    return {"losses": result.losses, **seen}


def _budget_between(first: dict, second: dict, layout: dict) -> float:
    """GiB halfway between the planner's peaks of two checkpointings of BASE's run on ``layout``."""
    from loongtrain.planner import Candidate, Workload
    from loongtrain.planner.memory import memory_bytes
    from loongtrain.train.spec import model_spec

    cfg = load_config(None, BASE)
    w = Workload(
        model_spec(cfg).model, cfg.data.seq_len, batch=8, micro_batch=8 // cfg.data.micro_batches, dtype_bytes=4
    )
    peaks = [memory_bytes(w, Candidate.of(dp=1, zero="dp_sp", **layout, **x), gpu=False).total for x in (first, second)]
    return sum(peaks) / 2 / 2**30


@pytest.mark.dist
def test_same_losses_unsharded_and_2d(dist_pool, tmp_path):
    common = ["run.steps=4", "memory.activation_checkpoint=none"]
    plain = dist_pool(4).run(_train, common + _layout(dp=4) + [f"run.output_dir={tmp_path / 'p'}"])[0]
    twod = dist_pool(4).run(_train, common + _layout(hp=2, cp=2, window=2) + [f"run.output_dir={tmp_path / 'q'}"])[0]
    np.testing.assert_allclose(twod["losses"], plain["losses"], rtol=1e-5)
    assert twod["losses"][-1] < twod["losses"][0]  # it trains
    # auto, with a budget between the planner's peaks of no checkpointing and sc++ on the first
    # layer: it checkpoints that layer alone, and trains as without checkpointing
    budget = _budget_between(
        {"activation_checkpoint": "none"},
        {"activation_checkpoint": "sc++", "activation_checkpoint_layers": 1},
        {"hp": 2, "cp": 2, "ring_window": 2},
    )
    auto = ["run.steps=4", "memory.activation_checkpoint=auto", f"memory.device_memory_gib={budget!r}"]
    chosen = dist_pool(4).run(
        _train_recording_memory, auto + _layout(hp=2, cp=2, window=2) + [f"run.output_dir={tmp_path / 'a'}"]
    )
    for rank in chosen:
        assert (rank["memory"]["activation_checkpoint"], rank["memory"]["activation_checkpoint_layers"]) == ("sc++", 1)
        assert rank["policy"].startswith("sc++ on the first 1 of 2 layers (predicted peak"), rank["policy"]
        np.testing.assert_allclose(rank["losses"], plain["losses"], rtol=1e-5)


def test_checkpoint_manager_ignores_incomplete(tmp_path):
    folder = tmp_path / "checkpoints"
    for name, complete in [("step-2", True), ("step-5", True), ("step-9", False), ("step-12.partial", True)]:
        (folder / name).mkdir(parents=True)
        if complete:
            (folder / name / STATE_FILE).write_text("{}")
    manager = CheckpointManager(folder, keep=2)
    assert [s for s, _ in manager.complete()] == [2, 5]
    assert manager.latest()[0] == 5


def test_preflight_errors(tmp_path):
    with pytest.raises(ConfigError, match="world size 6 is not divisible by sp = hp\\*cp = 2\\*2 = 4"):
        preflight(load_config(None, ["parallel.hp=2", "parallel.cp=2"]), 6)
    with pytest.raises(ConfigError, match="query heads H=4 are not divisible by hp=8"):
        preflight(load_config(None, ["parallel.hp=8"]), 8)
    with pytest.raises(ConfigError, match="sequence length 100 is not divisible by 2\\*sp"):
        preflight(load_config(None, ["data.seq_len=100", "parallel.cp=4"]), 4)
    with pytest.raises(ConfigError, match="unknown model preset 'gpt5'"):
        preflight(load_config(None, ["model.preset=gpt5"]), 1)
    with pytest.raises(ConfigError, match="recall task needs 168 token ids but the model's vocabulary is 128"):
        preflight(load_config(None, ["model.vocab_size=128", "data.recall_keys=16", "data.recall_values=8"]), 1)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot be written"):
        preflight(load_config(None, [f"run.output_dir={blocker / 'run'}"]), 1)
    tokens = tmp_path / "t.tok"
    write_tokens(tokens, np.arange(5000) % 300, 300)
    with pytest.raises(TokenFileError, match="beyond the model's vocabulary of 256"):
        preflight(load_config(None, ["data.source=tokens", f"data.path={tokens}", f"run.output_dir={tmp_path}"]), 1)
    run = tmp_path / "run"
    (run / "checkpoints" / "step-3").mkdir(parents=True)
    (run / "checkpoints" / "step-3" / STATE_FILE).write_text(json.dumps({"step": 3, "model_shape": {"dim": 32}}))
    with pytest.raises(CheckpointError, match="different model shape"):
        preflight(load_config(None, [f"run.output_dir={run}"]), 1)


@pytest.mark.e2e
def test_cli_reports_bad_config_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "loongtrain", "train", "--config", str(tmp_path / "none.toml")],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1],
    )  # fmt: skip
    assert proc.returncode == 2
    assert "loongtrain train: config file" in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.dist
def test_a_layout_per_microbatch_trains_as_the_fixed_layout(dist_pool, tmp_path):
    """parallel.layout=per_batch through the trainer: the same losses as the fixed 2D layout (the
    documents decide where each microbatch runs; the model and the data are the same)."""
    common = ["run.steps=3", "data.pack=true", "data.doc_len=32", "data.micro_batches=2", "parallel.balance=locality"]
    common += _layout(hp=2, cp=2, window=2)
    fixed = dist_pool(4).run(_train, common + [f"run.output_dir={tmp_path / 'f'}"])[0]
    mine = dist_pool(4).run(_train, common + ["parallel.layout=per_batch", f"run.output_dir={tmp_path / 'p'}"])[0]
    np.testing.assert_allclose(mine["losses"], fixed["losses"], rtol=1e-5)
    # stopped after step 2 and resumed: the third step as the uninterrupted run's
    resume = common + ["parallel.layout=per_batch", "checkpoint.every=2", f"run.output_dir={tmp_path / 'r'}"]
    dist_pool(4).run(_train, [*resume, "run.steps=2"])
    rest = dist_pool(4).run(_train, resume)[0]["losses"]
    assert len(rest) == 1
    np.testing.assert_allclose(rest, mine["losses"][2:], rtol=1e-5)
    records = [json.loads(x) for x in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()]
    layouts = [r["layouts"] for r in records if r["kind"] == "train"]
    assert all(len(x.split(",")) == 2 for x in layouts), layouts  # one entry per microbatch
    assert all(p in ("2x2", "1x4", "4x1") for x in layouts for p in x.split(",")), layouts


def _after_step_meets_a_full_disk(overrides: list[str]) -> str:
    """Train, rank 0's after-step hook (the evaluations' files) meeting a full disk at step 2:
    what every rank raised."""
    import errno

    from loongtrain.train.checkpoint import DiskFullError

    def after_step(run, done, reporter, beat) -> None:
        if done == 2 and torch.distributed.get_rank() == 0:
            raise OSError(errno.ENOSPC, "No space left on device", "eval/step-2/needles.png")

    cfg = load_config(None, BASE + overrides)
    try:
        train(torch.device("cpu"), cfg, preflight(cfg, torch.distributed.get_world_size()), after_step=after_step)
    except DiskFullError as e:
        return f"DiskFullError: {e}"
    except Exception as e:  # noqa: BLE001 - what the old code did: rank 1 waited in a collective, then timed out
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.dist
def test_a_full_disk_met_after_a_step_stops_every_rank_together(dist_pool, tmp_path):
    """rank 0's writes after the step's evaluations (the needle heatmap, its record) meet a full
    disk: every rank stops at the next step's reduction with the one disk-full line, none waits
    in a collective rank 0 never joins."""
    said = dist_pool(2).run(_after_step_meets_a_full_disk, ["parallel.cp=2", "run.steps=6", "run.timeout_s=60",
                                                             f"run.output_dir={tmp_path / 'r'}"])  # fmt: skip
    for text in said:
        assert text.startswith("DiskFullError: no space left on device while writing to the run folder"), said
