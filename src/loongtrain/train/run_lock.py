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

The lock also knows the job's workers: each registers itself (host, process id, start time)
when it starts (:func:`register_worker`). A lock whose holder is gone is taken over only when
every worker registered on this host is gone too (workers end with their launcher within a
fraction of a second, :func:`loongtrain.local_workers.die_with`; one that has not yet is named
in the refusal). A lock that cannot be read or holds a malformed record (a torn write, a hand
edit: a wrong type, a missing key, a process id out of range) names nobody: it is taken over
with a notice that says what was wrong.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from loongtrain.local_workers import process_alive, process_start_time

__all__ = [
    "LOCK_FILE", "Holder", "RunFolderBusy", "Taken", "Worker", "acquire", "process_alive",
    "process_start_time", "read_holder", "read_lock", "register_worker", "release",
]  # fmt: skip

LOCK_FILE = "run.lock"
# held (flock) only while the lock file is checked and written; never removed (a process waiting
# on a removed one would lock another file than the next comer)
_MUTEX_FILE = ".run.lock.mutex"
# the largest process id Linux can give (PID_MAX_LIMIT on 64-bit); a recorded id above it names no process
_PID_LIMIT = 2**22


class RunFolderBusy(RuntimeError):
    """Another job holds the run folder; the message names it and the fix."""


@dataclass(frozen=True)
class Worker:
    """A worker process of the job that holds a run folder."""

    host: str
    pid: int
    start_time: int | None  # of process ``pid``, in clock ticks since boot (None: unknown)

    @classmethod
    def this_process(cls) -> Worker:
        return cls(socket.gethostname(), os.getpid(), process_start_time(os.getpid()))

    def alive_here(self) -> bool:
        """On this host, and still running (not a later process that reuses its id)."""
        return self.host == socket.gethostname() and process_alive(self.pid, self.start_time)


@dataclass(frozen=True)
class Holder:
    """Who holds a run folder, and the workers of its job that registered."""

    host: str
    pid: int
    start_time: int | None  # of process ``pid``, in clock ticks since boot (None: unknown)
    since: str  # when the lock was taken (local time)
    job: str  # the job's id: processes with the same id share the lock
    command: str = ""
    workers: tuple[Worker, ...] = ()

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


def read_lock(run_dir: Path) -> Holder | str | None:
    """The holder recorded in ``run_dir``'s lock; None if there is no lock; for a lock that
    cannot be read or whose record is malformed, what is wrong with it."""
    path = Path(run_dir) / LOCK_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:  # not a file, no permission, not UTF-8
        return f"cannot be read: {e}"
    try:
        data = json.loads(text)
    except ValueError:
        return "not a JSON record (a torn write?)"
    return _holder(data)


def read_holder(run_dir: Path) -> Holder | None:
    """The holder recorded in ``run_dir``'s lock, or None if there is none (or it is unreadable)."""
    found = read_lock(run_dir)
    return found if isinstance(found, Holder) else None


# what each key of the record holds: its JSON types, and those in words
_STRING, _INTEGER, _START = ((str,), "a string"), ((int,), "an integer"), ((int, type(None)), "an integer or null")
_HOLDER_KEYS = {"host": _STRING, "pid": _INTEGER, "start_time": _START, "since": _STRING, "job": _STRING}
_WORKER_KEYS = {key: _HOLDER_KEYS[key] for key in ("host", "pid", "start_time")}


def _kind(value: Any) -> str:
    """A JSON value's kind in words."""
    kinds = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }
    return kinds.get(type(value), "null")


def _problem(data: Any, keys: dict[str, tuple[tuple[type, ...], str]], what: str) -> str | None:
    """What is wrong with ``data`` as a record of ``keys`` (key -> its types, in words), or None."""
    if not isinstance(data, dict):
        return f"{what} is {_kind(data)}, not an object"
    missing = [key for key in keys if key not in data]
    if missing:
        return f"{what} has no {', '.join(missing)}"
    for key, (types, words) in keys.items():
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, types):
            return f"{what}'s {key} {json.dumps(value)} is {_kind(value)}, not {words}"
    if not 0 < data["pid"] <= _PID_LIMIT:
        return f"{what}'s pid {data['pid']} is no process id (1 to {_PID_LIMIT})"
    if data["start_time"] is not None and not 0 <= data["start_time"] < 2**63:
        return f"{what}'s start_time {data['start_time']} is out of range"
    return None


def _holder(data: Any) -> Holder | str:
    """The holder in a lock's JSON record, or what is wrong with the record."""
    problem = _problem(data, _HOLDER_KEYS, "the record")
    if problem is not None:
        return problem
    command, workers = data.get("command", ""), data.get("workers", [])
    if not isinstance(command, str):
        return f"the record's command {json.dumps(command)} is {_kind(command)}, not a string"
    if not isinstance(workers, list):
        return f"the record's workers {json.dumps(workers)} is {_kind(workers)}, not an array"
    for i, worker in enumerate(workers):
        problem = _problem(worker, _WORKER_KEYS, f"worker {i}")
        if problem is not None:
            return problem
    return Holder(
        data["host"], data["pid"], data["start_time"], data["since"], data["job"], command,
        tuple(Worker(w["host"], w["pid"], w["start_time"]) for w in workers),
    )  # fmt: skip


def _write(path: Path, holder: Holder) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(holder), indent=1))  # asdict recurses into the workers
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


@dataclass(frozen=True)
class Taken:
    """How :func:`acquire` took a run folder: ``how`` is ``"taken"``, ``"shared"`` (the same
    job holds it: another node, a restart) or ``"taken over"``; ``notice`` says, for a
    takeover, from whom (or what was wrong with an unreadable lock)."""

    how: str
    notice: str = ""


def acquire(run_dir: str | Path, holder: Holder) -> Taken:
    """Take ``run_dir`` for ``holder``'s job (creating the folder). Takes over a lock whose
    holder and workers on this host are provably gone, and an unreadable one. Raises
    :class:`RunFolderBusy` if another job holds it, or its holder is gone but some of its
    workers still run."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    with _mutex(run_dir):
        current = read_lock(run_dir)
        if isinstance(current, str):
            taken = Taken("taken over", f"took over {path}, which names no job: {current}")
        elif current is None:
            taken = Taken("taken")
        elif current.job == holder.job:
            return Taken("shared")
        elif current.gone():
            live = [w for w in current.workers if w.alive_here()]
            if live:
                pids = " ".join(str(w.pid) for w in live)
                raise RunFolderBusy(
                    f"run folder {run_dir} is in use by worker process(es) {pids} of {current.describe()}, whose "
                    f"launcher is gone: two jobs in one folder would mix their metrics and checkpoints. They end "
                    f"within a second of their launcher; if they do not, stop them (kill {pids}) and start again"
                )
            gone = f"job {current.job}, process {current.pid} on {current.host}, since {current.since}"
            taken = Taken("taken over", f"took over {path} from a job that is gone ({gone})")
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
    return taken


def register_worker(run_dir: str | Path, job: str, worker: Worker | None = None) -> None:
    """Record ``worker`` (default: this process) among the workers of ``job``, which holds
    ``run_dir`` (workers of this host that are gone are dropped: a restarted group's). Raises
    :class:`RunFolderBusy` if the lock no longer names ``job`` (removed or replaced by hand)."""
    run_dir = Path(run_dir)
    worker = Worker.this_process() if worker is None else worker
    with _mutex(run_dir):
        current = read_lock(run_dir)
        if not isinstance(current, Holder) or current.job != job:
            raise RunFolderBusy(
                f"run folder {run_dir} is no longer held by this job ({job}): its {LOCK_FILE} was removed or "
                "replaced while the job started; stopping so that two jobs do not write into one folder"
            )
        here = socket.gethostname()
        kept = tuple(w for w in current.workers if w != worker and (w.host != here or w.alive_here()))
        _write(run_dir / LOCK_FILE, replace(current, workers=(*kept, worker)))


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
