"""What the user reads when a run ends badly: the report each worker leaves, and the one
line the launcher composes from them (pure functions, no process group).

A worker that fails writes a small JSON report (``rank-<r>.json``) into the folder named
by ``LOONGTRAIN_REPORT_DIR`` (set by ``loongtrain train``'s launcher), or, without one
(under an external torchrun), prints its line itself. The launcher then names the root
cause, not the ranks that only lost their connection to it: a user-facing error (bad
checkpoint, full disk) first, then a stalled rank, then an exception, then a rank killed
by a signal, and only then the ranks that saw a broken connection.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

REPORT_DIR_ENV = "LOONGTRAIN_REPORT_DIR"
DEBUG_ENV = "LOONGTRAIN_DEBUG"
PREFIX = "loongtrain train: "

# kinds, most telling first
RUNNING = "running"  # written when a worker starts: still there at the end means it died without a word
FATAL = "fatal"  # a user-facing error every rank agrees on (the message names the fix); never restarted
STALL = "stall"  # the watchdog found a rank that stopped answering
ERROR = "error"  # an exception on this rank
COMM = "comm"  # this rank lost a connection: the victim of a failure elsewhere
_ORDER = (FATAL, STALL, ERROR, COMM)

# substrings of the errors that gloo and NCCL raise when a peer is gone or silent
_COMM_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "remote worker crashing",
    "socket",
    "nccl communicator was aborted",
)


def debug_enabled() -> bool:
    """True when ``--debug`` or ``LOONGTRAIN_DEBUG=1`` asks for tracebacks and launcher logs."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def say(message: str) -> None:
    """Print one user-facing line on stderr."""
    print(PREFIX + message, file=sys.stderr, flush=True)


def current_attempt() -> int:
    """How many times the elastic agent restarted this worker group (0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


@dataclass(frozen=True)
class WorkerReport:
    """Why one rank ended: ``kind`` (fatal, stall, error, comm) and a one-line message."""

    rank: int
    kind: str
    message: str
    attempt: int = 0  # the elastic agent's restart count when it was written
    input_error: bool = False  # fatal: bad input (config, model folder, token file) that no resume can fix


def is_comm_failure(e: BaseException) -> bool:
    """True if ``e`` says that a connection to another rank broke or timed out."""
    try:
        import torch.distributed as dist

        if isinstance(e, dist.DistError):
            return True
    except ImportError:  # pragma: no cover - torch without distributed
        pass
    text = str(e).lower()
    return isinstance(e, (RuntimeError, ConnectionError, TimeoutError)) and any(m in text for m in _COMM_MARKERS)


def exception_line(e: BaseException) -> str:
    """``Type: first line of the message``."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def write_report(report: WorkerReport) -> bool:
    """Leave ``report`` for the launcher; returns False when there is no report folder."""
    folder = os.environ.get(REPORT_DIR_ENV)
    if not folder:
        return False
    path = Path(folder) / f"rank-{report.rank}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(report)))
    tmp.replace(path)
    return True


def read_reports(folder: Path) -> list[WorkerReport]:
    reports = []
    for path in sorted(Path(folder).glob("rank-*.json")):
        try:
            reports.append(WorkerReport(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return reports


@dataclass(frozen=True)
class ProcessEnd:
    """How the agent saw a worker process end: exit code, or the signal that killed it."""

    rank: int
    exitcode: int
    signal: str | None = None


def root_cause(reports: list[WorkerReport], ends: list[ProcessEnd], attempt: int = 0) -> str:
    """The one sentence that names what ended the job (without the resume hint), from the
    workers' reports of the failed ``attempt`` and the exit status of the failed processes."""
    reports = [r for r in reports if r.attempt == attempt]
    by_kind = {kind: [r for r in reports if r.kind == kind] for kind in _ORDER}
    if by_kind[FATAL]:
        return by_kind[FATAL][0].message
    if by_kind[STALL]:
        return by_kind[STALL][0].message
    if by_kind[ERROR]:
        first = min(by_kind[ERROR], key=lambda r: r.rank)
        others = len({r.rank for r in by_kind[ERROR]}) - 1
        return f"rank {first.rank} failed: {first.message}" + (f" (and {others} more rank(s))" if others else "")
    reported = {r.rank for r in reports if r.kind != RUNNING}
    killed = [e for e in ends if e.signal and e.rank not in reported]
    if killed:
        e = killed[0]
        return (
            f"rank {e.rank} was killed by {e.signal} (out of memory, or killed by the system or a user); "
            "the other ranks were stopped"
        )
    silent = [e for e in ends if e.rank not in reported and e.exitcode != 0]
    if silent:
        return f"rank {silent[0].rank} exited with code {silent[0].exitcode} without a report"
    # a rank that started and never said why it ended died first: the agent stopped the others
    # only after it saw a death, and a rank that loses a connection reports it
    vanished = sorted(r.rank for r in reports if r.kind == RUNNING)
    if vanished and by_kind[COMM]:
        return (
            f"rank {rank_list(vanished)} died without a word (killed by a signal such as SIGKILL, e.g. out of memory, "
            "or crashed); the other ranks were stopped"
        )
    if by_kind[COMM]:
        ranks = sorted({r.rank for r in by_kind[COMM]})
        return (
            f"rank(s) {', '.join(map(str, ranks))} lost the connection to another rank, which died or whose node "
            "is unreachable"
        )
    return "a worker process ended without a report (killed by a signal, or crashed; --debug shows more)"


def input_error_cause(reports: list[WorkerReport], attempt: int = 0) -> bool:
    """True when what :func:`root_cause` names for ``attempt`` is bad input (a fatal report of a
    config, model folder or token file error): a resume cannot fix it, so no resume hint."""
    fatal = [r for r in reports if r.attempt == attempt and r.kind == FATAL]
    return bool(fatal) and fatal[0].input_error


def fatal_cause(reports: list[WorkerReport], attempt: int = 0) -> bool:
    """True when :func:`root_cause` names a fatal report (a user-facing error, e.g. a full disk
    met by rank 0 alone) for ``attempt``: the launcher exits with 2, as when every rank met it."""
    return any(r.attempt == attempt and r.kind == FATAL for r in reports)


def rank_list(ranks: list[int]) -> str:
    """``"0, 3, 5"``: at most eight ranks, then how many more."""
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def resume_command(argv: list[str]) -> str:
    """The command line that resumes this run: ``argv`` without a ``checkpoint.resume=false`` override."""
    out, i = [], 0
    while i < len(argv):
        item = argv[i]
        key = item.split("=", 1)[0]
        if key == "--checkpoint.resume":
            i += 1 if "=" in item else 2
            continue
        out.append(item)
        i += 1
    return shlex.join(["loongtrain", *out])


def resume_hint(latest_step: int | None, argv: list[str]) -> str:
    """One sentence: where the run resumes from and the command that does it."""
    where = f"the last complete checkpoint is step-{latest_step}" if latest_step else "no checkpoint was saved yet"
    return f"{where}; resume with: {resume_command(argv)}"


def restart_notice() -> str:
    """What a restarted worker group says first: which restart, and why (from the reports of
    the attempt before, when the launcher collects them)."""
    attempt = current_attempt()
    folder = os.environ.get(REPORT_DIR_ENV)
    cause = root_cause(read_reports(Path(folder)), [], attempt - 1) if folder else "a worker failed"
    most = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
    return f"restarted by the elastic agent (restart {attempt} of {most}) after: {cause}"


_QUIET_THREADS = {"installed": False}


def quiet_disk_full_in_threads() -> None:
    """A full disk met by a background writer thread (TensorBoard's) prints no traceback: the
    main thread meets the same error at its next write and ends the run with one line."""
    if _QUIET_THREADS["installed"]:
        return
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        value = args.exc_value
        if isinstance(value, OSError) and value.errno in (errno.ENOSPC, errno.EDQUOT):
            return
        previous(args)

    threading.excepthook = hook
    _QUIET_THREADS["installed"] = True
