"""Run a function on every rank: under ``torchrun`` in-process, otherwise by spawning
local processes (``launch``), or under torchrun's elastic agent (``elastic_run``: restarts,
several nodes). Picks NCCL when each rank can have its own GPU, else gloo on CPU."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import tempfile
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loongtrain.local_workers import (
    EnvChanges,
    allow_ctrl_c,
    apply_environment,
    die_with,
    environment_changes,
    launcher_identity,
    start_method,
    start_worker_server,
    under_torchrun,
)

__all__ = [
    "allow_ctrl_c", "check_device", "clear_single_process_env", "elastic_run", "init_distributed", "launch",
    "local_rank_env", "process_group_backend", "quiet_agent_logs", "resolve_device", "single_process_env",
    "start_worker_server", "under_torchrun",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_device(device: str, local_world: int) -> None:
    """Raise ValueError if ``device`` cannot give each of ``local_world`` local ranks its own device."""
    if device == "cuda":
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < local_world:
            raise ValueError(
                f"run.device=cuda needs one GPU per local rank: {local_world} local rank(s), {found} GPU(s) visible; "
                "use run.device=cpu (or auto), or fewer processes per node"
            )


def _pick_backend(local_world: int, device: str) -> str:
    return "nccl" if resolve_device(device, local_world) == "cuda" else "gloo"


def resolve_device(device: str, local_world: int) -> str:
    """``cuda`` or ``cpu``: what ``run.device`` (``auto``, ``cpu``, ``cuda``) means for ``local_world``
    ranks on this node (``auto``: one GPU each when there are enough, else the CPU); ``cuda``
    without enough GPUs raises (:func:`check_device`)."""
    if device == "cuda":
        check_device(device, local_world)
        return "cuda"
    if device == "auto" and torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        return "cuda"
    return "cpu"


def init_distributed(timeout_s: float = 600.0, device: str = "auto") -> torch.device:
    """Initialise the default process group from the environment; return this rank's device.

    ``device``: ``auto`` (NCCL on one GPU per local rank when there are enough GPUs,
    else gloo on CPU), ``cpu`` or ``cuda``.
    """
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = _pick_backend(local_world, device)
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        threads = int(os.environ.get("LOONGTRAIN_THREADS_PER_RANK", "0")) or max(
            1, (os.cpu_count() or 1) // local_world
        )
        torch.set_num_threads(threads)
    dist.init_process_group(process_group_backend(backend), timeout=timedelta(seconds=timeout_s))
    return device


def process_group_backend(backend: str) -> str:
    """What ``init_process_group`` is given for ``backend``: NCCL for device tensors with gloo
    beside it for host tensors (``"cpu:gloo,cuda:nccl"``, as torchtitan does), since with the
    model states offloaded the gradients are host tensors, and clipping all-reduces their norms
    over the default group, which NCCL alone cannot do; gloo alone otherwise."""
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def local_rank_env(rank: int, world: int, port: int) -> None:
    """Set the rendezvous variables of local rank ``rank`` of ``world`` (one node, ``port``)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )


RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def single_process_env() -> None:
    """Set the rendezvous variables of a one-rank job that runs in this process."""
    local_rank_env(0, 1, _free_port())


def clear_single_process_env() -> None:
    """Remove what :func:`single_process_env` set (the process is no rank any more)."""
    for key in RENDEZVOUS_ENV:
        os.environ.pop(key, None)


def _run_rank(fn: Callable, args: tuple, device: str) -> None:
    dev = init_distributed(device=device)
    try:
        fn(dev, *args)
    finally:
        dist.destroy_process_group()


def _spawned_entry(rank: int, world: int, port: int, env: EnvChanges, fn: Callable, args: tuple, device: str) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C: KeyboardInterrupt, as when spawned
    apply_environment(env)
    local_rank_env(rank, world, port)
    _run_rank(fn, args, device)


def launch(fn: Callable, nproc: int, *args, device: str = "auto") -> None:
    """Call ``fn(device, *args)`` on every rank of a freshly initialised process group.

    Under torchrun the current process is one rank (``nproc`` is ignored); with
    ``nproc == 1`` it runs in this process; otherwise ``nproc`` local processes are
    spawned (``fn`` must then be importable, i.e. defined at module level).
    """
    if under_torchrun():
        _run_rank(fn, args, device)
        return
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    if nproc == 1:
        single_process_env()
        try:
            _run_rank(fn, args, device)
        finally:
            clear_single_process_env()
        return
    start_worker_server([fn.__module__])
    mp.start_processes(
        _spawned_entry, args=(nproc, _free_port(), environment_changes(), fn, args, device), nprocs=nproc,
        join=True, start_method=start_method(),
    )  # fmt: skip


# Loggers of torchrun's agent and of torch.multiprocessing; their warnings and tracebacks
# about a failed worker repeat what the trainer says in one line.
_AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


def quiet_agent_logs() -> None:
    """Silence the elastic agent's own logging in this process (the launcher's)."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(_AGENT_LOGGERS):
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    for name in _AGENT_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def elastic_run(
    entry: Callable, *args: Any, nproc: int, nnodes: int = 1, rdzv_endpoint: str = "", rdzv_id: str = "",
    max_restarts: int = 0, shutdown_timeout_s: int = 5, quiet: bool = True,
) -> dict[int, Any]:  # fmt: skip
    """Run ``entry(*args)`` on ``nproc`` local workers under torchrun's elastic agent
    (``torch.distributed.launcher.api``, what ``torchrun`` itself runs): it sets each
    worker's RANK/WORLD_SIZE/... environment, stops every worker when one fails (SIGTERM,
    SIGKILL after the agent's 30 s) or this process gets SIGINT/SIGTERM (SIGKILL after
    ``shutdown_timeout_s``), and restarts the whole group up to ``max_restarts`` times. A
    worker ends at once when this process is gone (killed hard: :func:`~loongtrain.local_workers.die_with`).
    Several nodes: the same call on each node with ``nnodes``, a common ``rdzv_endpoint``
    (host:port of one node) and ``rdzv_id``.

    Returns the workers' return values by global rank; raises the agent's
    ``ChildFailedError`` or ``SignalException``.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Workers get a fresh TCPStore per attempt instead of sharing the agent's: with the
    # shared store a restarted group reads the previous attempt's keys and its process
    # group hangs or is refused (pytorch/pytorch#135712; measured here with torch 2.13).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if quiet:
        quiet_agent_logs()
    start_worker_server([entry.__module__])  # at once, unless the command started it earlier
    # the agent's folder for its workers' error files (by default a /tmp/torchelastic_* folder it
    # never removes): one of ours, removed however the run ends
    logs = tempfile.mkdtemp(prefix="loongtrain-agent-")
    try:
        config = LaunchConfig(
            min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc, run_id=rdzv_id or uuid.uuid4().hex,
            rdzv_backend="c10d", rdzv_endpoint=rdzv_endpoint or "127.0.0.1:0", max_restarts=max_restarts,
            monitor_interval=0.2, start_method=start_method(), logs_specs=DefaultLogsSpecs(log_dir=logs),
            **_shutdown_timeout(LaunchConfig, shutdown_timeout_s),
        )  # fmt: skip
        return elastic_launch(config, _elastic_entry)(environment_changes(), launcher_identity(), entry, *args)
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def _shutdown_timeout(config_type: type, seconds: int) -> dict[str, int]:
    """``LaunchConfig``'s ``shutdown_timeout`` where this torch has it (2.12+); torch 2.11's
    agent waits its fixed 30 s before SIGKILL."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(config_type)}
    return {"shutdown_timeout": seconds} if "shutdown_timeout" in names else {}


def _elastic_entry(env: EnvChanges, launcher: str, entry: Callable, *args: Any) -> Any:
    """A worker of :func:`elastic_run`: bound to its launcher (it ends when the launcher is
    gone, killed hard or not), the launcher's environment (the agent set the rank's), then ``entry``."""
    die_with(launcher)
    apply_environment(env)
    return entry(*args)
