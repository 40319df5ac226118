"""``loongtrain train`` broken from the outside while it runs, as a user (or the world) would:
Ctrl-C / SIGTERM, a frozen rank, a killed rank, a restart by the elastic agent, a full
disk, bad values, and two torchrun "nodes". Each asserts what the user reads (a few
lines, no traceback), how fast the job ends, and what is left on disk."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fault_tools import SMALL, Job, alive, metrics, train_losses
from loongtrain.train.checkpoint import CHECKSUM_FILE, checksum_problems, structure_problem
from loongtrain.train.run_lock import read_holder

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds workers through /proc"),
]


def _intact(folder) -> bool:
    import json

    names = sorted(json.loads((folder / CHECKSUM_FILE).read_text()))
    return structure_problem(folder) is None and not checksum_problems(folder, names)


def _checkpoints(run_dir) -> list[str]:
    """The complete step folders, oldest first (a kill during a save leaves ``step-N.partial``)."""
    steps = [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.split("-")[-1].isdigit()]
    return sorted(steps, key=lambda name: int(name.split("-")[1]))


def _assert_few_lines(done, most: int = 3) -> None:
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout, done.stderr
    assert len(done.stderr_lines()) <= most, done.stderr


def _show(what: str, done) -> None:
    print(f"\n[{what}] exit {done.returncode} after {done.seconds:.1f} s; stderr:\n{done.stderr}")


@pytest.mark.slow
def test_ctrl_c_and_sigterm_stop_every_worker_and_say_how_to_resume(tmp_path):
    run_dir = tmp_path / "run"
    args = ["--nproc", "2", *SMALL, "--run.steps", "100000", "--checkpoint.every", "2", "--checkpoint.keep", "1",
            "--run.output_dir", str(run_dir)]  # fmt: skip
    job = Job.train(args, tmp_path / "first")
    job.wait_for_step(run_dir, 5)
    workers = job.workers()
    assert len(workers) == 2
    t0 = time.monotonic()
    job.proc.send_signal(signal.SIGINT)  # like Ctrl-C in the terminal (the workers get it too, below)
    for pid in workers.values():
        subprocess.run(["kill", "-INT", str(pid)], check=False)
    done = job.wait(since=t0, timeout=60)
    _show("Ctrl-C", done)
    assert done.returncode == 128 + signal.SIGINT
    assert done.seconds < 15, "every worker stops within seconds"
    assert not any(alive(pid) for pid in workers.values())
    _assert_few_lines(done, 1)
    line = done.stderr_lines()[0]
    assert line.startswith("loongtrain train: stopped by SIGINT") and "resume with: loongtrain train" in line
    latest = _checkpoints(run_dir)[-1]
    assert latest.startswith("step-") and _intact(run_dir / "checkpoints" / latest)
    saved = int(latest.split("-")[1])

    # the same command resumes; SIGTERM to the launcher alone (a scheduler's stop) ends it as fast
    job = Job.train(args, tmp_path / "second")
    job.wait_for_step(run_dir, saved + 3)
    t0 = time.monotonic()
    job.proc.send_signal(signal.SIGTERM)
    done = job.wait(since=t0, timeout=60)
    _show("SIGTERM", done)
    assert done.returncode == 128 + signal.SIGTERM and done.seconds < 15
    _assert_few_lines(done, 1)
    assert done.stderr_lines()[0].startswith("loongtrain train: stopped by SIGTERM")
    assert f"resumed from {run_dir / 'checkpoints' / latest} at step {saved}" in done.stdout
    train_losses(run_dir)  # no step logged twice


def test_a_frozen_rank_is_named_within_the_timeout(tmp_path):
    """Rank 1 frozen in one job and rank 0 (which also serves the job's store) in another,
    the two jobs at once (each spends most of its time waiting out the timeout)."""
    timeout_s = 6
    jobs = {}
    try:
        for rank in (1, 0):
            run_dir = tmp_path / f"run{rank}"
            args = ["--nproc", "2", *SMALL, "--run.steps", "100000", "--run.timeout_s", str(timeout_s),
                    "--run.output_dir", str(run_dir)]  # fmt: skip
            jobs[rank] = run_dir, Job.train(args, tmp_path / f"log{rank}")
        stopped = {}
        for rank, (run_dir, job) in jobs.items():
            job.wait_for_step(run_dir, 3)
            stopped[rank] = job.workers()[rank], time.monotonic()
            subprocess.run(["kill", "-STOP", str(stopped[rank][0])], check=True)
        for rank, (_, job) in jobs.items():
            frozen, t0 = stopped[rank]
            done = job.wait(since=t0, timeout=120)
            _show(f"SIGSTOP rank {rank}", done)
            assert done.returncode == 1
            _assert_few_lines(done, 1)
            line = done.stderr_lines()[0]
            assert line.startswith(f"loongtrain train: rank {rank} stopped answering"), line
            assert "raise run.timeout_s (now 6 s)" in line and "resume with: loongtrain train" in line
            # detected after the timeout plus a few heartbeats; the reporting rank kills the frozen one
            assert timeout_s < done.seconds < timeout_s + 15
            assert not alive(frozen)
    finally:
        for _, job in jobs.values():
            job.kill()


def _temporary_folder(tmp_path) -> dict[str, str]:
    """A fresh TMPDIR for one job: what the job leaves in it is its own."""
    folder = tmp_path / "tmpdir"
    folder.mkdir()
    return {"TMPDIR": str(folder)}


def _assert_left_no_temporary_folders(env: dict[str, str]) -> None:
    """The launcher removes what it created there (the elastic agent's log folder, the reports);
    inductor's cache folder (``torchinductor_<user>``, one for every run) may stay."""
    left = sorted(p.name for p in Path(env["TMPDIR"]).iterdir() if not p.name.startswith("torchinductor_"))
    assert left == [], f"left behind in TMPDIR: {left}"


def test_a_killed_worker_ends_the_job_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    env = _temporary_folder(tmp_path)
    job = Job.train(["--nproc", "2", *SMALL, "--run.steps", "100000", "--checkpoint.every", "2",
                     "--run.output_dir", str(run_dir)], tmp_path, env)  # fmt: skip
    job.wait_for_step(run_dir, 5)
    workers = job.workers()
    t0 = time.monotonic()
    subprocess.run(["kill", "-KILL", str(workers[1])], check=True)
    done = job.wait(since=t0, timeout=60)
    _show("SIGKILL rank 1", done)
    assert done.returncode == 1 and done.seconds < 15
    _assert_few_lines(done, 1)
    line = done.stderr_lines()[0]
    assert line.startswith("loongtrain train: rank 1 was killed by SIGKILL"), line
    assert "the last complete checkpoint is step-" in line and "resume with: loongtrain train" in line
    assert not alive(workers[0])
    latest = _checkpoints(run_dir)[-1]
    assert _intact(run_dir / "checkpoints" / latest)
    _assert_left_no_temporary_folders(env)


def test_one_job_per_run_folder_and_a_killed_jobs_lock_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    args = ["--nproc", "2", *SMALL, "--run.output_dir", str(run_dir)]
    first = Job.train([*args, "--run.steps", "100000", "--checkpoint.every", "2"], tmp_path / "first")
    first.wait_for_step(run_dir, 3)
    second = Job.train([*args, "--run.steps", "3"], tmp_path / "second").wait(timeout=60)
    _show("a second job on the same folder", second)
    assert second.returncode == 2
    _assert_few_lines(second, 1)
    line = second.stderr_lines()[0]
    assert line.startswith(f"loongtrain train: run folder {run_dir} is in use by job "), line
    assert f"(process {first.proc.pid} on " in line and "choose another run.output_dir" in line
    assert "process(es) on" not in second.stdout  # refused before any worker started
    workers = first.workers()
    assert sorted(w.pid for w in read_holder(run_dir).workers) == sorted(workers.values()), "workers registered"
    # SIGKILL to the launcher alone (the pid in run.lock): its workers end with it, its lock stays behind
    end = int(_checkpoints(run_dir)[-1].split("-")[1]) + 4
    killed = time.monotonic()
    os.kill(first.proc.pid, signal.SIGKILL)
    env = _temporary_folder(tmp_path)
    third = Job.train([*args, "--run.steps", str(end)], tmp_path / "third", env)  # at once
    try:
        while any(alive(pid) for pid in workers.values()) and time.monotonic() - killed < 5:
            time.sleep(0.02)
        print(f"\nthe workers were gone {time.monotonic() - killed:.2f} s after their launcher's SIGKILL")
        assert not any(alive(pid) for pid in workers.values()), "workers outlived their launcher"
        latest = int(_checkpoints(run_dir)[-1].split("-")[1])
        done = third.wait(timeout=120)
    finally:
        first.kill()
        third.kill()
    _show("after the launcher alone was killed", done)
    assert done.returncode == 0, done.stderr
    assert f"took over {run_dir}/run.lock from a job that is gone" in done.stderr
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{latest}'}" in done.stdout
    steps = [r["step"] for r in metrics(run_dir) if r["kind"] == "train"]
    assert steps == list(range(1, end + 1)), f"steps interleaved or repeated: {steps}"  # one writer at a time
    assert not [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".partial")]
    assert not (run_dir / "run.lock").exists()  # released at the end
    _assert_left_no_temporary_folders(env)


@pytest.mark.slow
def test_max_restarts_resumes_and_matches_an_uninterrupted_run(tmp_path):
    steps = ["--run.steps", "24", "--checkpoint.every", "4", "--data.seq_len", "128"]
    # the uninterrupted reference runs at the same time (the losses do not depend on timing)
    reference = Job.train(["--nproc", "2", *SMALL, *steps, "--run.output_dir", str(tmp_path / "ref")],
                          tmp_path / "ref-log")  # fmt: skip
    run_dir = tmp_path / "run"
    job = Job.train(["--nproc", "2", "--max-restarts", "1", *SMALL, *steps, "--run.output_dir", str(run_dir)],
                    tmp_path / "log")  # fmt: skip
    try:
        job.wait_for_step(run_dir, 6)  # the kill lands somewhere after step-4 was saved
        subprocess.run(["kill", "-KILL", str(job.workers()[1])], check=True)
        done = job.wait(timeout=240)
        ref_done = reference.wait(timeout=240)
    finally:
        job.kill()
        reference.kill()
    assert ref_done.returncode == 0, ref_done.stderr
    _show("SIGKILL rank 1 with --max-restarts 1", done)
    assert done.returncode == 0, done.stderr
    assert "restarted by the elastic agent (restart 1 of 1) after: " in done.stdout
    assert "resumed from" in done.stdout
    assert train_losses(run_dir) == train_losses(tmp_path / "ref"), "bit-exact, each step logged once"
    assert "Traceback" not in done.stderr


@contextlib.contextmanager
def _small_disk(tmp_path, size: str):
    """A tmpfs of ``size`` (a real full disk), unmounted afterwards; the test is skipped where it cannot be mounted."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:  # fmt: skip
        pytest.skip("cannot mount a tmpfs here (needs root); test_checkpoint_faults simulates the full disk")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_stops_with_one_line_and_the_previous_checkpoint_intact(tmp_path):
    # a 2.5 MiB tmpfs: one checkpoint of the debug model (1.8 MiB) fits, a second does not
    with _small_disk(tmp_path, "2560k") as mount:
        run_dir = mount / "run"
        job = Job.train(["--nproc", "2", *SMALL, "--run.steps", "6", "--checkpoint.every", "2",
                         "--checkpoint.keep", "1", "--run.output_dir", str(run_dir)], tmp_path / "log")  # fmt: skip
        done = job.wait(timeout=180)
        _show("full disk (2.5 MiB tmpfs)", done)
        assert done.returncode == 2
        _assert_few_lines(done, 1)
        line = done.stderr_lines()[0]
        assert line.startswith("loongtrain train: checkpoint step-4 not saved: no space left on device"), line
        assert "the previous checkpoint step-2 is intact" in line
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2"], "no partial folder"
        assert _intact(run_dir / "checkpoints" / "step-2")
        assert max(r["step"] for r in metrics(run_dir)) == 4


def test_a_disk_that_fills_between_checkpoints_ends_in_one_line(tmp_path):
    # metrics.jsonl and TensorBoard's writer thread meet the full disk, not a checkpoint save
    with _small_disk(tmp_path, "4m") as mount:
        run_dir = mount / "run"
        job = Job.train(["--nproc", "2", *SMALL, "--run.steps", "100000", "--checkpoint.every", "20",
                         "--checkpoint.keep", "1", "--run.tensorboard", "true", "--run.output_dir", str(run_dir)],
                        tmp_path / "log")  # fmt: skip
        job.wait_for_step(run_dir, 21)  # step-20 is saved; the next save is 20 steps away
        with open(mount / "filler", "wb") as f:  # the rest of the disk, as another job would take it
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        done = job.wait(timeout=120)
        _show("disk full between checkpoints", done)
        assert done.returncode == 2
        _assert_few_lines(done, 1)
        line = done.stderr_lines()[0]
        assert line.startswith(f"loongtrain train: no space left on device while writing to the run folder {run_dir}")
        assert "the last intact checkpoint is step-20" in line and line.endswith("then resume with the same command")
        assert "Exception in thread" not in done.stderr


class _Spawned(Exception):
    pass


@pytest.mark.unit
def test_bad_values_are_refused_before_spawning(tmp_path, monkeypatch, capsys):
    """The command's own code in process; spawning is replaced by an exception, so a value
    that got through would be seen at once."""
    import loongtrain.train.cli as train_cli
    from loongtrain.cli import main

    def spawn(*args, **kwargs):
        raise _Spawned

    monkeypatch.setattr(train_cli, "supervise", spawn)
    for name in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    for override, message in [
        (["--optim.beta1", "1.5"], "optim.beta1=1.5 must be in [0, 1)"),
        (["--optim.eps", "-1"], "optim.eps=-1.0 must be positive"),
        (["--optim.lr", "1e39"], "optim.lr=1e+39 does not fit float32, the dtype of AdamW's parameters and states"),
        (["--run.device", "cuda"], "run.device=cuda needs one GPU per local rank"),
        (["--max-restarts", "-1"], "--max-restarts must not be negative"),
    ]:
        try:
            main(["train", "--nproc", "2", *override, "--run.output_dir", str(tmp_path)])
        except _Spawned:
            assert override == ["--run.device", "cuda"], f"{override} was not refused"
            continue  # a machine with GPUs
        except SystemExit as e:
            code = e.code
        else:
            code = 0
        err = capsys.readouterr().err
        print(f"\n[{' '.join(override)}] exit {code}: {err.strip()}")
        assert code == 2 and err.startswith(f"loongtrain train: {message}"), err
        assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.slow
def test_two_nodes_train_like_one_node(tmp_path):
    """Two torchrun agents (``--nnodes 2``, one process each) on this machine, and two
    ``loongtrain train --nnodes 2`` launchers, reach the same losses as one node with two
    processes (same world size and layout)."""
    common = [*SMALL, "--run.steps", "6", "--checkpoint.every", "3"]
    # the one-node reference and both two-node jobs run at the same time (losses do not depend on timing)
    one = Job.train(["--nproc", "2", *common, "--run.output_dir", str(tmp_path / "one")], tmp_path / "one-log")
    env = {"LOONGTRAIN_THREADS_PER_RANK": "1"}  # as in one node of 2 processes on 2 cores
    started = {}
    for launcher in ("torchrun", "loongtrain"):
        run_dir, port, job_id = tmp_path / launcher, _free_port(), uuid.uuid4().hex
        if launcher == "torchrun":
            argv = [
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                 "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job_id,
                 "--rdzv-conf", f"is_host={node == 0}", "-m", "loongtrain", "train", *common,
                 "--run.output_dir", str(run_dir)]
                for node in range(2)
            ]  # fmt: skip
        else:
            argv = [
                [sys.executable, "-m", "loongtrain", "train", "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint",
                 f"127.0.0.1:{port}", "--rdzv-id", job_id, *common, "--run.output_dir", str(run_dir)]
            ] * 2  # fmt: skip
        started[launcher] = run_dir, [Job(a, tmp_path / f"{launcher}-node{i}", env) for i, a in enumerate(argv)]
    try:
        assert one.wait(timeout=240).returncode == 0
        single_node = train_losses(tmp_path / "one")
        for launcher, (run_dir, nodes) in started.items():
            for node in nodes:
                done = node.wait(timeout=240)
                assert done.returncode == 0, done.stderr
            assert train_losses(run_dir) == single_node, launcher
            assert _checkpoints(run_dir) == ["step-3", "step-6"]
    finally:
        for job in [one, *(node for _, nodes in started.values() for node in nodes)]:
            job.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
