"""One run per run folder: who owns ``<run>/``, moving an older run aside, and repairing
what a killed run left half-written.

A run folder holds one run: ``run.json`` (its id), ``config.toml``, ``metrics.jsonl``,
``curves.png``, ``tensorboard/``, ``checkpoints/``, ``hf-source/`` (an imported model's
config and tokenizer files, for export) and ``eval/`` (long-context evaluations). Starting fresh
(``checkpoint.resume = false``) in a folder that holds a run moves those files into
``<run>/previous/<n>/`` (nothing is deleted) and starts a new run with a new id. A
resumed run keeps the id, and a worker group restarted by torchrun's elastic agent
(same launch id) is a resumed run even with ``checkpoint.resume = false``.
``metrics.jsonl`` is cut back to the step a run resumes from, so steps trained again are
not logged twice and a line torn by a kill never reaches a reader. Pure file operations
(rank 0 calls them), no process group.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
PREVIOUS_DIR = "previous"
# what a run writes into its folder ("hf-source" is train.model_setup.SOURCE_DIR, "eval" the
# evaluations' folder, not imported: this module needs no torch); anything else there (e.g. a token file) is left alone
RUN_FILES = (
    RUN_FILE, "config.toml", METRICS_FILE, "curves.png", "tensorboard", "checkpoints", "hf-source", "eval",
    "tracking.json", "wandb",
)  # fmt: skip


@dataclass(frozen=True)
class RunStart:
    """How a run begins in its folder."""

    run_id: str
    resuming: bool  # continue the run found in the folder (from its newest intact checkpoint, if any)
    restarted: bool  # a restart of the same launch by the elastic agent
    moved_to: Path | None  # where an older run was moved, when starting fresh


def _read_identity(run_dir: Path) -> dict | None:
    try:
        data = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("run_id"), str) else None


def _write_identity(run_dir: Path, identity: dict) -> None:
    tmp = run_dir / (RUN_FILE + ".tmp")
    tmp.write_text(json.dumps(identity, indent=1))
    tmp.replace(run_dir / RUN_FILE)


def holds_run(run_dir: Path) -> bool:
    """True if ``run_dir`` holds any file a run writes."""
    return any((run_dir / name).exists() for name in RUN_FILES)


def move_aside(run_dir: Path) -> Path:
    """Move the run files of ``run_dir`` into a new ``previous/<n>/`` folder; returns it."""
    previous = run_dir / PREVIOUS_DIR
    taken = [int(p.name) for p in previous.iterdir() if p.name.isdigit()] if previous.is_dir() else []
    dest = previous / str(max(taken, default=0) + 1)
    dest.mkdir(parents=True)
    for name in RUN_FILES:
        if (run_dir / name).exists():
            (run_dir / name).rename(dest / name)
    return dest


def start_run(run_dir: Path, resume: bool, launch_id: str | None = None) -> RunStart:
    """Decide (and record in ``run.json``) whether this run continues the folder's run or
    starts a new one, moving an older run aside. ``launch_id`` is the elastic agent's run
    id (``TORCHELASTIC_RUN_ID``), the same for every restart of one launch."""
    run_dir.mkdir(parents=True, exist_ok=True)
    identity = _read_identity(run_dir)
    restarted = launch_id is not None and identity is not None and identity.get("launch_id") == launch_id
    if resume or restarted:
        identity = identity or {"run_id": uuid.uuid4().hex, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        _write_identity(run_dir, {**identity, "launch_id": launch_id})
        return RunStart(run_id=identity["run_id"], resuming=True, restarted=restarted, moved_to=None)
    moved = move_aside(run_dir) if holds_run(run_dir) else None
    identity = {"run_id": uuid.uuid4().hex, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "launch_id": launch_id}
    _write_identity(run_dir, identity)
    return RunStart(run_id=identity["run_id"], resuming=False, restarted=False, moved_to=moved)


def discard_new_run(run_dir: Path, existed: bool) -> None:
    """Remove what a run that failed on bad input wrote into ``run_dir``, which held no run
    before it started: the whole folder when the run created it (``existed`` False), else
    the run's files (anything else there is left alone)."""
    if not existed:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def trim_metrics(path: Path, upto_step: int) -> int:
    """Keep the well-formed records of ``path`` with ``step <= upto_step`` (rewritten
    atomically); returns how many lines were dropped (re-trained steps, torn lines)."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
            keep = isinstance(record, dict) and int(record["step"]) <= upto_step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        elif line.strip():
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
    return dropped
