"""How local worker processes start: forked from one fork server that imported torch and the
command's modules once (a spawned worker imports torch again: ~2 s of CPU per rank). No
torch import here, so a command can start the server first and import beside it."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Iterable

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
