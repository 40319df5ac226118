"""How local worker processes start: forked from one fork server that imported torch and the
command's modules once (a spawned worker imports torch again: ~2 s of CPU per rank), and how
they end with their launcher (:func:`die_with`). No torch import here, so a command can start
the server first and import beside it."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

#: What every local worker needs, imported once in the fork server instead of in each worker.
WORKER_PRELOAD = ("torch", "torch.distributed", "loongtrain.launch")

# The environment the fork server started with: its workers inherit that one, not this
# process's at the time they start, so what changed since travels with them
# (:func:`environment_changes`). One fork server per process, as multiprocessing keeps it.
_server_env: dict[str, str] | None = None


def start_method() -> str:
    """How local workers start: forked from a fork server where the platform has one (a
    spawned worker imports torch again: ~2 s of CPU per rank), else spawned."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def start_worker_server(modules: Iterable[str] = ()) -> None:
    """Start the fork server that local workers are forked from, with :data:`WORKER_PRELOAD`
    and ``modules`` imported once (nothing where workers are spawned, or when it runs already:
    one per process). Call it early to import beside the launcher's own work.

    The server starts with SIGINT ignored (its imports would print a traceback for a Ctrl-C),
    and so does every worker until its entry lets a Ctrl-C end it quietly
    (:func:`allow_ctrl_c`); a Ctrl-C before that reaches the launcher, which stops the workers."""
    if start_method() != "forkserver" or under_torchrun():
        return
    from multiprocessing import forkserver

    global _server_env
    if _server_env is not None:
        return
    multiprocessing.set_forkserver_preload(list(dict.fromkeys([*WORKER_PRELOAD, *modules])))
    main = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:  # an ignored signal stays ignored in the exec'd server, and the server's children keep it so
        forkserver.ensure_running()
        _server_env = dict(os.environ)
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)


EnvChanges = tuple[dict[str, str], tuple[str, ...]]


def environment_changes() -> EnvChanges:
    """What this process's environment set and removed since the fork server started (its
    workers start with the server's): hand it to :func:`apply_environment` in each worker, so
    a worker sees the environment a spawned one would have."""
    if _server_env is None:
        return {}, ()
    changed = {k: v for k, v in os.environ.items() if _server_env.get(k) != v}
    return changed, tuple(k for k in _server_env if k not in os.environ)


def apply_environment(changes: EnvChanges) -> None:
    """In a worker: the launcher's :func:`environment_changes`."""
    changed, removed = changes
    os.environ.update(changed)
    for key in removed:
        os.environ.pop(key, None)


def allow_ctrl_c() -> None:
    """In a worker: SIGINT (Ctrl-C in the terminal) and SIGTERM (the agent stopping the group)
    end this process at once, quietly (the launcher says what happened); one that came while
    it started, while blocked, ends it now."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def under_torchrun() -> bool:
    """True when launched by torchrun (or another launcher that sets WORLD_SIZE/RANK)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3 and on of ``/proc/<pid>/stat`` (state, parent, ...), or None (no such process, no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # the command name (field 2) may hold spaces and parentheses: count from its closing one
        return stat[stat.rindex(")") + 2 :].split() or None
    except (OSError, ValueError):
        return None


def process_start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux ``/proc``), or None
    if it cannot be read (no such process, or no ``/proc``)."""
    return _start_of(_stat_fields(pid))


def _start_of(fields: list[str] | None) -> int | None:
    """The start time (field 22) from :func:`_stat_fields`' fields, or None."""
    try:
        return int(fields[19]) if fields else None
    except (ValueError, IndexError):
        return None


def process_alive(pid: int, start_time: int | None) -> bool:
    """Whether process ``pid`` runs and, where ``start_time`` is known, is the same process
    (not a later one that reuses the id). A zombie (ended, not yet reaped by its parent) is gone."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        pass  # it exists, under another user
    fields = _stat_fields(pid)
    if fields is None:
        return True  # no /proc: the signal test alone
    if fields[0] in ("Z", "X"):
        return False
    return start_time is None or _start_of(fields) in (None, start_time)


#: How often a worker's watchdog looks for its launcher.
WATCH_INTERVAL_S = 0.2
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def launcher_identity(pid: int | None = None) -> str:
    """``"pid:start_time"`` of process ``pid`` (default: this one): what a worker is given to
    :func:`die_with` its launcher."""
    pid = os.getpid() if pid is None else pid
    start = process_start_time(pid)
    return f"{pid}:{'' if start is None else start}"


def _parse_identity(text: str) -> tuple[int, int | None] | None:
    pid, _, start = text.partition(":")
    try:
        return int(pid), (int(start) if start else None)
    except ValueError:
        return None


def _release_fork_server() -> None:
    """In a worker forked from a fork server: close the write end of the server's "alive" pipe.
    CPython hands it to every child (``multiprocessing.forkserver``: the server runs until every
    holder is gone), so without this the server outlives a launcher killed hard, and its
    workers' parent-death signal never comes. The worker never uses it: a fork server it needs
    is its own (it did not start the inherited one)."""
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is None or getattr(server, "_forkserver_pid", None) is not None:
        return  # not forked from a fork server, or this process started the server
    try:
        os.close(fd)
    except OSError:
        pass
    server._forkserver_alive_fd = None


def _end_now() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def die_with(launcher: str | None) -> bool:
    """In a worker: end this process at once (SIGKILL) when the launcher ``launcher`` (its
    :func:`launcher_identity`) is gone, so that a launcher killed hard (``kill -9``, out of
    memory) leaves no worker writing into its run folder. Two guards: the Linux parent-death
    signal (the worker's parent is the fork server, which exits when its launcher does once the
    worker lets go of it, :func:`_release_fork_server`; or an external torchrun agent) and a
    daemon thread that checks the launcher's process id and start time every
    :data:`WATCH_INTERVAL_S`. Returns False (and does nothing) for an empty or malformed
    ``launcher``."""
    found = _parse_identity(launcher or "")
    if found is None:
        return False
    pid, start = found
    _release_fork_server()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl: the watchdog alone
    if not process_alive(pid, start):  # gone before the signal was armed
        _end_now()

    def watch() -> None:
        while process_alive(pid, start):
            time.sleep(WATCH_INTERVAL_S)
        _end_now()

    threading.Thread(target=watch, name="loongtrain-launcher-watch", daemon=True).start()
    return True
