"""Helpers for tests that break a running ``loongtrain train`` from the outside, as the
world does: start it, wait for a step, find a worker by rank, signal it, and read what the
user saw (Linux: worker processes are found through /proc)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# a small, fast run of the debug model (each step well under a second on 2 cores)
SMALL = [
    "--run.progress", "off", "--run.tensorboard", "false", "--run.log_every", "1", "--run.eval_batches", "1",
    "--data.seq_len", "64", "--data.global_batch", "8", "--data.recall_queries", "8", "--optim.warmup_steps", "2",
    "--memory.activation_checkpoint", "none",
]  # fmt: skip


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    seconds: float  # from the moment of the fault (or the start) to the exit

    def stderr_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def _as_in_a_terminal() -> None:
    """SIGINT handled by default, as for a command typed in a terminal: a test suite started
    in the background (``cmd &``, nohup) passes SIGINT on ignored, and Python then keeps it
    ignored, so the Ctrl-C tests would see the job go on (measured: it ran to the end)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Job:
    """One ``loongtrain train`` (or any command) running in the background."""

    def __init__(self, argv: list[str], log_dir: Path, env: dict | None = None) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self._out, self._err = open(log_dir / "stdout", "w+"), open(log_dir / "stderr", "w+")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            argv, cwd=REPO, stdout=self._out, stderr=self._err, env={**os.environ, **(env or {})},
            start_new_session=True, preexec_fn=_as_in_a_terminal,
        )  # fmt: skip

    @classmethod
    def train(cls, args: list[str], log_dir: Path, env: dict | None = None) -> Job:
        return cls([sys.executable, "-m", "loongtrain", "train", *args], log_dir, env)

    def workers(self) -> dict[int, int]:
        """pid of each worker process by rank: the agent starts local ranks in order (one node),
        each forked from the launcher's fork server (``loongtrain.local_workers``)."""
        servers = [pid for pid in _children(self.proc.pid) if b"forkserver" in _cmdline(pid)]
        forked = [pid for server in servers for pid in _children(server)]
        return dict(enumerate(sorted(forked, key=_start_time)))

    def wait_for_step(self, run_dir: Path, step: int, timeout: float = 180) -> None:
        """Until ``metrics.jsonl`` holds a train record of ``step`` or later."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the job ended before step {step}: {self._read()}")
            if any(r["kind"] == "train" and r["step"] >= step for r in metrics(run_dir)):
                return
            time.sleep(0.1)
        raise AssertionError(f"step {step} not reached in {timeout} s: {self._read()}")

    def wait(self, since: float | None = None, timeout: float = 180) -> Finished:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job did not end within {timeout} s: {self._read()}") from None
        end = time.monotonic()
        out, err = self._read()
        return Finished(self.proc.returncode, out, err, end - (since if since is not None else self.started))

    def kill(self) -> None:
        """Kill the job's whole process group (also stopped or orphaned workers)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def _read(self) -> tuple[str, str]:
        self._out.flush()
        self._err.flush()
        return Path(self._out.name).read_text(), Path(self._err.name).read_text()


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _start_time(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def train_losses(run_dir: Path) -> dict[int, float]:
    """Loss by step; raises if a step is logged twice."""
    losses: dict[int, float] = {}
    for r in metrics(run_dir):
        if r["kind"] == "train":
            assert r["step"] not in losses, f"step {r['step']} logged twice in {run_dir}"
            losses[r["step"]] = r["loss"]
    return losses
