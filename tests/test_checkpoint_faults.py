"""Checkpoints and run folders under faults, on gloo ranks: a damaged newest checkpoint
falls back to the newest intact one and training continues bit-exactly; a fresh start in
a used folder loses nothing and mixes nothing; a full disk leaves the previous checkpoint
intact and no partial folder; keep-k never deletes another run's checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from loongtrain.config import load_config
from loongtrain.train.checkpoint import (
    CHECKSUM_FILE,
    STATE_FILE,
    CheckpointError,
    CheckpointManager,
    CheckpointSaveError,
    checksum_problems,
    structure_problem,
)
from loongtrain.train.trainer import preflight, train

BASE = [
    "run.log_every=100", "run.eval_batches=1", "run.tensorboard=false", "run.progress=off",
    "data.seq_len=64", "data.global_batch=8", "data.recall_queries=8", "optim.warmup_steps=2",
    "checkpoint.every=0", "checkpoint.save_final=false", "memory.activation_checkpoint=none",
]  # fmt: skip


def _train(overrides: list[str]) -> list[float]:
    cfg = load_config(None, BASE + overrides)
    return train(torch.device("cpu"), cfg, preflight(cfg, torch.distributed.get_world_size())).losses


def _train_or_error(overrides: list[str]) -> str | list[float]:
    try:
        return _train(overrides)
    except CheckpointError as e:
        return f"{type(e).__name__}: {e}"


def _train_out_of_space(overrides: list[str], fail_at_step: int, how: str) -> str | list[float]:
    """Train with a disk that is full from the save of ``fail_at_step`` on: ``how`` is
    "free" (free space reported too small) or "write" (a write fails with ENOSPC)."""
    import errno
    import io
    from contextlib import contextmanager

    from torch.distributed.checkpoint import filesystem

    import loongtrain.train.checkpoint as ckpt

    real_usage, real_stream = ckpt.shutil.disk_usage, filesystem.FileSystem.create_stream

    def full(path):
        usage = real_usage(path)
        return usage._replace(free=1000) if f"step-{fail_at_step}" in str(ckpt._saving) else usage

    class FullStream(io.BytesIO):
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    @contextmanager
    def stream(self, path, mode):
        if "w" in mode and f"step-{fail_at_step}.partial" in str(path):
            yield FullStream()
        else:
            with real_stream(self, path, mode) as s:
                yield s

    ckpt._saving = None
    real_save = ckpt.CheckpointManager.save

    def save(self, step, *args, **kwargs):
        ckpt._saving = f"step-{step}"
        return real_save(self, step, *args, **kwargs)

    ckpt.CheckpointManager.save = save
    if how == "free":
        ckpt.shutil.disk_usage = full
    else:
        filesystem.FileSystem.create_stream = stream
    try:
        return _train(overrides)
    except CheckpointSaveError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        ckpt.CheckpointManager.save = real_save
        ckpt.shutil.disk_usage = real_usage
        filesystem.FileSystem.create_stream = real_stream


def _flip_byte(folder: Path) -> None:
    shard = sorted(folder.glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))


DAMAGES = {
    "flipped byte": _flip_byte,
    "truncated shard": lambda f: (f / "__0_0.distcp").write_bytes((f / "__0_0.distcp").read_bytes()[:100]),
    "missing shard": lambda f: (f / "__1_0.distcp").unlink(),
    "missing .metadata": lambda f: (f / ".metadata").unlink(),
    "empty trainer_state.json": lambda f: (f / STATE_FILE).write_text(""),
}


def _intact(folder: Path) -> bool:
    names = sorted(json.loads((folder / CHECKSUM_FILE).read_text()))
    return structure_problem(folder) is None and not checksum_problems(folder, names)


def _metric_steps(run_dir: Path) -> list[int]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in lines if r["kind"] == "train"]


@pytest.mark.dist
def test_damaged_newest_checkpoint_falls_back_to_the_newest_intact(dist_pool, tmp_path):
    pool = dist_pool(2)
    full = pool.run(_train, ["run.steps=4", f"run.output_dir={tmp_path / 'full'}"])[0]
    template = tmp_path / "template"
    first = pool.run(_train, ["run.steps=3", "checkpoint.every=1", "checkpoint.keep=3",
                              f"run.output_dir={template}"])[0]  # fmt: skip
    assert first == full[:3]
    for name, damage in DAMAGES.items():
        run_dir = tmp_path / name.replace(" ", "_")
        shutil.copytree(template, run_dir)
        damage(run_dir / "checkpoints" / "step-3")
        resumed = pool.run(_train, ["run.steps=4", f"run.output_dir={run_dir}"])[0]
        assert resumed == full[2:], f"{name}: must resume from step-2 and continue bit-exactly"
        names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        assert names == ["step-1", "step-2", "step-3.damaged"], name
        assert _metric_steps(run_dir) == [1, 2, 3, 4], f"{name}: step 3 is logged once"
    # on_damaged=stop: nothing is loaded or renamed, every rank says why
    run_dir = tmp_path / "stop"
    shutil.copytree(template, run_dir)
    _flip_byte(run_dir / "checkpoints" / "step-3")
    out = pool.run(_train_or_error, ["run.steps=4", "checkpoint.on_damaged=stop", f"run.output_dir={run_dir}"])
    assert out[0] == out[1] and out[0].startswith("CheckpointError: checkpoint ")
    assert "does not match its checksum" in out[0]
    assert "Set checkpoint.on_damaged=fallback to resume from step-2" in out[0]
    assert (run_dir / "checkpoints" / "step-3").is_dir()


@pytest.mark.dist
def test_fresh_start_in_a_used_folder_loses_and_mixes_nothing(dist_pool, tmp_path):
    """The issue's case: keep=2 used to delete the new run's checkpoints and keep the old run's."""
    pool = dist_pool(2)
    run_dir = tmp_path / "run"
    pool.run(_train, ["run.steps=6", "checkpoint.every=3", "checkpoint.keep=2", f"run.output_dir={run_dir}"])
    old = pool.run(_train, ["run.steps=5", f"run.output_dir={tmp_path / 'ref'}"])[0]
    new = pool.run(_train, ["run.steps=3", "checkpoint.every=1", "checkpoint.keep=2", "checkpoint.resume=false",
                            f"run.output_dir={run_dir}"])[0]  # fmt: skip
    assert new == old[:3]  # a fresh start: the old run's step-6 was not loaded
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2", "step-3"]
    previous = run_dir / "previous" / "1"
    assert sorted(p.name for p in (previous / "checkpoints").iterdir()) == ["step-3", "step-6"]
    assert all(_intact(p) for p in (previous / "checkpoints").iterdir())
    assert _metric_steps(previous) == [1, 2, 3, 4, 5, 6] and _metric_steps(run_dir) == [1, 2, 3]
    assert "steps = 6" in (previous / "config.toml").read_text()
    assert "steps = 3" in (run_dir / "config.toml").read_text()
    rest = pool.run(_train, ["run.steps=5", f"run.output_dir={run_dir}"])[0]
    assert new + rest == old, "resumes the new run's step-3, not the old run's step-6"
    assert _metric_steps(run_dir) == [1, 2, 3, 4, 5]


@pytest.mark.dist
@pytest.mark.parametrize("how", ["free", "write"])
def test_full_disk_keeps_the_previous_checkpoint_and_leaves_no_partial(dist_pool, tmp_path, how):
    pool = dist_pool(2)
    run_dir = tmp_path / "run"
    out = pool.run(_train_out_of_space, ["run.steps=4", "checkpoint.every=1", f"run.output_dir={run_dir}"], 2, how)
    assert out[0] == out[1], "every rank stops with the same error"
    assert out[0].startswith("CheckpointSaveError: checkpoint step-2 not saved: no space left on device"), out[0]
    assert "the previous checkpoint step-1 is intact" in out[0] and "resume with the same command" in out[0]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-1"]
    assert _intact(run_dir / "checkpoints" / "step-1")


def test_keep_k_deletes_only_this_runs_checkpoints(tmp_path):
    folder = tmp_path / "checkpoints"
    for step, run_id in [(1, "other"), (2, "mine"), (3, "mine"), (4, "mine"), (5, "mine")]:
        (folder / f"step-{step}").mkdir(parents=True)
        (folder / f"step-{step}" / STATE_FILE).write_text(json.dumps({"step": step, "run_id": run_id}))
    CheckpointManager(folder, keep=2, run_id="mine").prune(4)
    assert sorted(p.name for p in folder.iterdir()) == ["step-1", "step-3", "step-4", "step-5"]


def test_model_shape_check_reads_settings_an_older_checkpoint_lacks_as_defaults(tmp_path):
    from dataclasses import asdict, replace

    from loongtrain.model import model_config
    from loongtrain.train.checkpoint import check_model_shape

    current = asdict(model_config("debug"))
    older = {k: v for k, v in current.items() if k not in ("qk_norm", "sliding_window")}  # saved before they existed
    check_model_shape(tmp_path, {"model_shape": older}, current)  # accepted: the missing ones are the defaults
    windowed = asdict(replace(model_config("debug"), sliding_window=16))
    with pytest.raises(CheckpointError, match="sliding_window"):
        check_model_shape(tmp_path, {"model_shape": older}, windowed)  # an older run had no window
    with pytest.raises(CheckpointError, match="dim"):
        check_model_shape(tmp_path, {"model_shape": {**current, "dim": 32}}, current)
