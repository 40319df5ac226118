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


def _pick_backend(world_size: int, local_world: int) -> str:
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        return "nccl"
    return "gloo"


def init_distributed(timeout_s: float = 600.0) -> torch.device:
    """Initialise the default process group from the environment; return this rank's device."""
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = _pick_backend(world_size, local_world)
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


def _spawned_entry(rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    device = init_distributed()
    try:
        fn(device, *args)
    finally:
        dist.destroy_process_group()


def launch(fn: Callable, nproc: int, *args) -> None:
    """Call ``fn(device, *args)`` on every rank of a freshly initialised process group.

    Under torchrun the current process is one rank (``nproc`` is ignored); otherwise
    ``nproc`` local processes are spawned. ``fn`` must be importable (module level).
    """
    if under_torchrun():
        device = init_distributed()
        try:
            fn(device, *args)
        finally:
            dist.destroy_process_group()
        return
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    mp.spawn(_spawned_entry, args=(nproc, _free_port(), fn, args), nprocs=nproc, join=True)
