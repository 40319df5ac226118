"""One job per run folder: ``<run>/run.lock`` names the job that holds the folder.

The lock records its holder (host, process id and that process's start time, when it was
taken, the job's id and command). A job that finds the lock held by another job refuses to
start, in one line naming the holder and the fix, before any worker process exists. The lock
is taken over only when its holder is provably gone: the same host, and no process with that
id and start time (a killed job's lock, a reused process id). A holder on another host cannot
be checked from here; the message says how to clear it once that job is known to be gone.
The processes of one job share the lock: the nodes of a multi-node launch (same ``--rdzv-id``)
and the ranks of an external torchrun (same ``TORCHELASTIC_RUN_ID``; their holder is the
torchrun agent, the ranks' parent). Released on every exit of the holder (a kill leaves a
stale lock, taken over by the next job). Pure file operations, no torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

LOCK_FILE = "run.lock"
# held (flock) only while the lock file is checked and written; never removed (a process waiting
# on a removed one would lock another file than the next comer)
_MUTEX_FILE = ".run.lock.mutex"


class RunFolderBusy(RuntimeError):
    """Another job holds the run folder; the message names it and the fix."""


def process_start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux ``/proc``), or None
    if it cannot be read (no such process, or no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count from its closing one
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def process_alive(pid: int, start_time: int | None) -> bool:
    """Whether process ``pid`` runs and, where ``start_time`` is known, is the same process
    (not a later one that reuses the id)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    if start_time is None:
        return True
    now = process_start_time(pid)
    return now is None or now == start_time


@dataclass(frozen=True)
class Holder:
    """Who holds a run folder."""

    host: str
    pid: int
    start_time: int | None  # of process ``pid``, in clock ticks since boot (None: unknown)
    since: str  # when the lock was taken (local time)
    job: str  # the job's id: processes with the same id share the lock
    command: str = ""

    @classmethod
    def this_process(cls, job: str, pid: int | None = None, command: str = "") -> Holder:
        pid = os.getpid() if pid is None else pid
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        return cls(socket.gethostname(), pid, process_start_time(pid), since, job, command)

    def gone(self) -> bool:
        """Provably gone: on this host, and its process no longer runs."""
        return self.host == socket.gethostname() and not process_alive(self.pid, self.start_time)

    def describe(self) -> str:
        text = f"job {self.job} (process {self.pid} on {self.host}, since {self.since})"
        return text + (f": {self.command}" if self.command else "")


def read_holder(run_dir: Path) -> Holder | None:
    """The holder recorded in ``run_dir``'s lock, or None if there is none (or it is unreadable)."""
    try:
        data = json.loads((Path(run_dir) / LOCK_FILE).read_text())
        return Holder(**data)
    except (OSError, ValueError, TypeError):
        return None


def _write(path: Path, holder: Holder) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(holder), indent=1))
    tmp.replace(path)


@contextlib.contextmanager
def _mutex(run_dir: Path):
    """Serialise the check-and-write of the lock between processes of this host."""
    fd = os.open(run_dir / _MUTEX_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def acquire(run_dir: str | Path, holder: Holder) -> str:
    """Take ``run_dir`` for ``holder``'s job (creating the folder). Returns ``"taken"``,
    ``"shared"`` (the same job holds it: another node, a restart) or ``"taken over"`` (from a
    holder that is provably gone). Raises :class:`RunFolderBusy` if another job holds it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    with _mutex(run_dir):
        current = read_holder(run_dir)
        if current is None and path.exists():
            outcome = "taken over"  # an unreadable lock (a torn write): nobody can be named as its holder
        elif current is None:
            outcome = "taken"
        elif current.job == holder.job:
            return "shared"
        elif current.gone():
            outcome = "taken over"
        else:
            raise RunFolderBusy(
                f"run folder {run_dir} is in use by {current.describe()}: two jobs in one folder would mix their "
                f"metrics and checkpoints. Wait for it to end, stop it, or choose another run.output_dir"
                + (
                    f"; if that job is gone (its host {current.host} cannot be checked from here), delete {path}"
                    if current.host != socket.gethostname()
                    else ""
                )
            )
        _write(path, holder)
    return outcome


def release(run_dir: str | Path, holder: Holder) -> None:
    """Remove ``run_dir``'s lock if ``holder`` (the same host and process) holds it; a folder
    already removed is fine."""
    run_dir = Path(run_dir)
    try:
        with _mutex(run_dir):
            current = read_holder(run_dir)
            if current is not None and (current.host, current.pid) == (holder.host, holder.pid):
                (run_dir / LOCK_FILE).unlink(missing_ok=True)
    except OSError as e:
        if e.errno != errno.ENOENT:
            raise
