"""The fault-handling logic that needs no process: run-folder ownership, torn metrics,
checkpoint verification against independently computed checksums, the stall diagnosis,
and the one line the launcher prints."""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from loongtrain.train.checkpoint import (
    CHECKSUM_FILE,
    STATE_FILE,
    CheckpointManager,
    checksum_problems,
    structure_problem,
)
from loongtrain.train.faults import (
    COMM,
    ERROR,
    FATAL,
    RUNNING,
    STALL,
    ProcessEnd,
    WorkerReport,
    resume_command,
    root_cause,
)
from loongtrain.train.run_folder import RUN_FILE, start_run, trim_metrics
from loongtrain.train.watchdog import Beat, describe_stall

# -- run folders ---------------------------------------------------------------------------


def _old_run(run_dir):
    (run_dir / "checkpoints" / "step-10").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-10" / STATE_FILE).write_text('{"step": 10}')
    (run_dir / "config.toml").write_text("old config")
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    (run_dir / "corpus.tok").write_text("not ours")  # a user's file in the same folder


def test_fresh_start_moves_the_previous_run_aside(tmp_path):
    run_dir = tmp_path / "run"
    _old_run(run_dir)
    first = start_run(run_dir, resume=False)
    assert not first.resuming and first.moved_to == run_dir / "previous" / "1"
    moved = first.moved_to
    assert (moved / "checkpoints" / "step-10" / STATE_FILE).read_text() == '{"step": 10}'
    assert (moved / "config.toml").read_text() == "old config"
    assert (moved / "metrics.jsonl").is_file()
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()
    assert (run_dir / "corpus.tok").read_text() == "not ours"  # left where it was
    # a second fresh start moves the first fresh run to previous/2 and gets a new id
    second = start_run(run_dir, resume=False)
    assert second.moved_to == run_dir / "previous" / "2" and (second.moved_to / RUN_FILE).is_file()
    assert second.run_id != first.run_id
    assert json.loads((run_dir / RUN_FILE).read_text())["run_id"] == second.run_id


def test_resume_keeps_the_run_and_an_elastic_restart_is_a_resume(tmp_path):
    run_dir = tmp_path / "run"
    fresh = start_run(run_dir, resume=False, launch_id="launch-1")
    # the agent restarts the workers of the same launch: resumed, not moved aside
    again = start_run(run_dir, resume=False, launch_id="launch-1")
    assert again.resuming and again.restarted and again.moved_to is None and again.run_id == fresh.run_id
    assert start_run(run_dir, resume=True).run_id == fresh.run_id
    # a new launch with resume=false is a new run
    assert start_run(run_dir, resume=False, launch_id="launch-2").moved_to is not None
    # a torn run.json (killed while writing) does not break the next run
    (run_dir / RUN_FILE).write_text('{"run_id": "ab')
    assert start_run(run_dir, resume=True).resuming


def test_trim_metrics_drops_retrained_steps_and_torn_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"kind": "train", "step": s, "loss": 1.0 / s} for s in range(1, 7)]
    lines.insert(4, {"kind": "eval", "step": 4, "loss": 0.5})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"kind": "train", "st')
    assert trim_metrics(path, 4) == 3  # steps 5, 6 and the torn line
    kept = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in kept] == [("train", 1), ("train", 2), ("train", 3), ("train", 4),
                                                       ("eval", 4)]  # fmt: skip
    assert trim_metrics(path, 4) == 0
    assert trim_metrics(tmp_path / "absent.jsonl", 3) == 0


# -- checkpoint verification ----------------------------------------------------------------


def _checkpoint(folder, files: dict[str, bytes]):
    """A step folder whose checksums.json is computed here with hashlib (the reference)."""
    folder.mkdir(parents=True)
    listed = {}
    for name, data in files.items():
        (folder / name).write_bytes(data)
        listed[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / CHECKSUM_FILE).write_text(json.dumps(listed))
    return sorted(files)


@pytest.fixture
def checkpoint(tmp_path):
    rng = random.Random(0)
    files = {
        ".metadata": rng.randbytes(3000),
        "__0_0.distcp": rng.randbytes(20000),
        "__1_0.distcp": rng.randbytes(20000),
        STATE_FILE: json.dumps({"step": 4}).encode(),
    }
    folder = tmp_path / "step-4"
    return folder, _checkpoint(folder, files)


def test_intact_checkpoint_passes(checkpoint):
    folder, names = checkpoint
    assert structure_problem(folder) is None and checksum_problems(folder, names) == []


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: (f / "__1_0.distcp").unlink(), "file __1_0.distcp is missing"),
        (lambda f: (f / ".metadata").unlink(), "file .metadata is missing"),
        (lambda f: (f / "__0_0.distcp").write_bytes((f / "__0_0.distcp").read_bytes()[:777]),
         "__0_0.distcp has 777 bytes, 20000 were written"),
        (lambda f: (f / CHECKSUM_FILE).unlink(), "checksums.json is missing or unreadable"),
        (lambda f: (f / CHECKSUM_FILE).write_text(""), "checksums.json is missing or unreadable"),
    ],
)  # fmt: skip
def test_missing_or_truncated_files_are_named(checkpoint, damage, message):
    folder, _ = checkpoint
    damage(folder)
    assert message in structure_problem(folder)


def test_empty_trainer_state_is_damage(tmp_path):
    folder = tmp_path / "step-2"
    _checkpoint(folder, {".metadata": b"x" * 10, STATE_FILE: b""})
    assert structure_problem(folder) == f"{STATE_FILE} is unreadable"


def test_every_flipped_bit_is_detected(checkpoint):
    folder, names = checkpoint
    rng = random.Random(1)
    for _ in range(40):
        name = rng.choice([n for n in names if n != STATE_FILE])
        path = folder / name
        data = bytearray(path.read_bytes())
        pos, bit = rng.randrange(len(data)), 1 << rng.randrange(8)
        data[pos] ^= bit
        path.write_bytes(bytes(data))
        assert structure_problem(folder) is None  # same size: only the checksum can tell
        assert checksum_problems(folder, names) == [f"file {name} does not match its checksum (corrupted)"]
        data[pos] ^= bit
        path.write_bytes(bytes(data))
    assert checksum_problems(folder, names) == []


def test_leftovers_of_a_killed_save_are_removed_and_damaged_ones_kept(tmp_path):
    folder = tmp_path / "checkpoints"
    for name in ["step-2", "step-4.partial", "step-1.deleting", "step-3.damaged"]:
        (folder / name).mkdir(parents=True)
        (folder / name / STATE_FILE).write_text("{}")
    manager = CheckpointManager(folder, keep=2)
    assert sorted(p.name for p in manager.remove_leftovers()) == ["step-1.deleting", "step-4.partial"]
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-3.damaged"]
    assert [s for s, _ in manager.steps()] == [2]


# -- the stall diagnosis --------------------------------------------------------------------


def test_describe_stall_names_the_frozen_rank():
    before = {0: Beat(10, 5, "train"), 1: Beat(9, 5, "train"), 2: Beat(11, 5, "train"), 3: Beat(10, 5, "train")}
    after = {0: Beat(13, 5, "train"), 1: Beat(12, 5, "train"), 2: Beat(11, 5, "train"), 3: Beat(13, 5, "train")}
    text = describe_stall(before, after, 60)
    assert text.startswith("rank 2 stopped answering") and "step 5 (train)" in text and "60 s" in text
    assert describe_stall({0: Beat(1, 0, "build"), 1: None}, {0: Beat(4, 0, "build"), 1: None}, 5).startswith(
        "rank 1 stopped answering"
    )


def test_describe_stall_names_the_rank_left_behind():
    before = {0: Beat(1, 7, "train"), 1: Beat(1, 6, "checkpoint save"), 2: Beat(1, 7, "train")}
    after = {r: Beat(b.count + 3, b.step, b.phase) for r, b in before.items()}
    assert describe_stall(before, after, 30).startswith(
        "rank 1 stopped making progress at step 6 (checkpoint save) for over 30 s while the others reached step 7"
    )
    same_step = {0: Beat(1, 7, "train"), 1: Beat(1, 7, "evaluation"), 2: Beat(1, 7, "train")}
    later = {r: Beat(b.count + 3, b.step, b.phase) for r, b in same_step.items()}
    assert describe_stall(same_step, later, 30).startswith("rank 1 stopped making progress at step 7 (evaluation)")
    exited = {0: Beat(5, 3, "train"), 1: Beat(5, 3, "exited")}
    assert describe_stall(exited, {0: Beat(8, 3, "train"), 1: Beat(6, 3, "exited")}, 9).startswith(
        "rank 1 left the job"
    )
    stuck = {r: Beat(2, 4, "train") for r in range(3)}
    assert "no rank made progress" in describe_stall(stuck, {r: Beat(5, 4, "train") for r in range(3)}, 9)


# -- what the launcher says -----------------------------------------------------------------


def test_root_cause_prefers_the_cause_over_its_victims():
    victims = [WorkerReport(0, COMM, "RuntimeError: Connection closed by peer"), WorkerReport(2, COMM, "same")]
    killed = [ProcessEnd(1, -9, "SIGKILL"), ProcessEnd(0, 1)]
    assert root_cause(victims, killed).startswith("rank 1 was killed by SIGKILL")
    error = [*victims, WorkerReport(3, ERROR, "ValueError: bad batch")]
    assert root_cause(error, [ProcessEnd(0, 1)]) == "rank 3 failed: ValueError: bad batch"
    stall = [*victims, WorkerReport(1, STALL, "rank 2 stopped answering")]
    assert root_cause(stall, killed) == "rank 2 stopped answering"
    fatal = [WorkerReport(r, FATAL, "checkpoint not saved: no space left on device") for r in range(2)]
    assert root_cause(fatal + victims, killed) == "checkpoint not saved: no space left on device"
    assert root_cause(victims, [ProcessEnd(0, 1)]).startswith("rank(s) 0, 2 lost the connection")
    # the rank that lost its connection exited first: the one that started and never reported died
    started = [WorkerReport(0, COMM, "lost the connection"), WorkerReport(1, RUNNING, "")]
    assert root_cause(started, [ProcessEnd(0, 1)]).startswith("rank 1 died without a word")
    # only the reports of the attempt that failed count
    old = [WorkerReport(3, ERROR, "ValueError: from attempt 0", attempt=0)]
    assert root_cause(old, [ProcessEnd(1, -9, "SIGKILL")], attempt=1).startswith("rank 1 was killed")


def test_resume_command_drops_a_fresh_start():
    argv = ["train", "--config", "c.toml", "--nproc", "4", "--checkpoint.resume", "false", "--run.steps", "9"]
    assert resume_command(argv) == "loongtrain train --config c.toml --nproc 4 --run.steps 9"
    assert resume_command(["train", "--checkpoint.resume=false"]) == "loongtrain train"
