"""Run a function on every rank: under ``torchrun`` in-process, otherwise by spawning
local processes. Picks NCCL when each rank can have its own GPU, else gloo on CPU."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def under_torchrun() -> bool:
    """True when launched by torchrun (or another launcher that sets WORLD_SIZE/RANK)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pick_backend(local_world: int, device: str) -> str:
    if device == "cuda":
        if not torch.cuda.is_available() or torch.cuda.device_count() < local_world:
            found = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise RuntimeError(
                f"device=cuda needs one GPU per local rank: {local_world} local rank(s), {found} GPU(s) visible"
            )
        return "nccl"
    if device == "auto" and torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        return "nccl"
    return "gloo"


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
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return device


def _local_env(rank: int, world: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )


def _run_rank(fn: Callable, args: tuple, device: str) -> None:
    dev = init_distributed(device=device)
    try:
        fn(dev, *args)
    finally:
        dist.destroy_process_group()


def _spawned_entry(rank: int, world: int, port: int, fn: Callable, args: tuple, device: str) -> None:
    _local_env(rank, world, port)
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
        _local_env(0, 1, _free_port())
        try:
            _run_rank(fn, args, device)
        finally:
            for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
                os.environ.pop(key, None)
        return
    mp.spawn(_spawned_entry, args=(nproc, _free_port(), fn, args, device), nprocs=nproc, join=True)
