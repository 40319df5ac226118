"""A pool of long-lived gloo worker processes shared by many test bodies.

Starting a process group costs seconds per world size (a spawned worker imports torch), so
workers are forked from one server that imported torch once, and each world size is started
once per test module (the ``dist_pool`` fixture of ``conftest.py``: pools end with their
module, since idle gloo groups keep threads that wake up) and every test sends it a body
to run on all ranks: a module-level function called as ``fn(*args, **kwargs)`` on every
rank, whose return values come back as a list indexed by rank. A failure (exception on any rank, or a timeout) kills
the pool, which is respawned for the next test, and fails the test with each rank's
traceback.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import queue
import socket
import traceback
import types
from datetime import timedelta

import torch
import torch.multiprocessing as mp

#: torch 2.11's workers segfault in Python's cyclic collector while it frees some jobs' garbage
#: (an FSDP model left in a cycle by a finished or failed training run: seen in three different
#: tests, always inside the collector; never on 2.13). There the pool's workers do not run the
#: collector: a job's cyclic garbage stays until the worker exits.
COLLECT_GARBAGE = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 12)
JOB_TIMEOUT_S = float(os.environ.get("LOONGTRAIN_TEST_JOB_TIMEOUT", "300"))
GLOO_TIMEOUT_S = 120

_state_cache: dict = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, jobs, results) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if not COLLECT_GARBAGE:
        gc.disable()
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    except Exception:
        results.put((rank, False, traceback.format_exc()))
        return
    # What the worker holds before its first job (torch and the preloaded modules, its group)
    # lives until it exits: frozen, the collector never walks it again. A full collection over
    # it took 0.3-0.4 s per job and rank (250k-300k objects; measured), most of a small body's
    # round trip; frozen objects are still freed by reference counting.
    gc.freeze()
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            result = (rank, True, fn(*args, **kwargs))
        except BaseException:
            result = (rank, False, traceback.format_exc())
        if COLLECT_GARBAGE:  # the job's garbage (models: reference cycles) goes while its groups live
            gc.collect()
            # what survived it (imported modules, cached states and meshes) is not walked again;
            # such an object that later ends in a reference cycle (an evicted state) stays
            gc.freeze()
        results.put(result)
    # Exit without destroy_process_group: with the groups of many layouts alive, tearing
    # them down took up to the 10 s join timeout per pool (measured), and the process's
    # exit releases them anyway. Every result was consumed by the parent already.
    os._exit(0)


def _context():
    """Workers forked from one server process that imported torch and this module once (a
    spawned worker imports torch again: 2.5 s of CPU per rank); nothing else runs in the
    server, so its children start as clean as spawned ones."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "dist_pool", "loongtrain.apply", "loongtrain.train.step"])
    return ctx


class WorkerPool:
    """``world`` ranks (forked from the fork server) with an initialised gloo default group."""

    def __init__(self, world: int) -> None:
        ctx = _context()
        self.world = world
        self._results = ctx.Queue()
        self._jobs = [ctx.Queue() for _ in range(world)]
        port = _free_port()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world, port, self._jobs[r], self._results), daemon=True)
            for r in range(world)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn, *args, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results."""
        timeout = JOB_TIMEOUT_S
        for q in self._jobs:
            q.put((fn, args, kwargs))
        out: list = [None] * self.world
        errors: dict[int, str] = {}
        for _ in range(self.world):
            try:
                rank, ok, payload = self._results.get(timeout=timeout if not errors else 10)
            except queue.Empty:
                missing = [r for r in range(self.world) if out[r] is None and r not in errors]
                errors.setdefault(-1, f"timed out after {timeout:.0f}s waiting for ranks {missing}")
                break
            if ok:
                out[rank] = payload
            else:
                errors[rank] = payload
        if errors:
            self.close(force=True)
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise AssertionError(f"distributed body {fn.__name__} failed:\n{detail}")
        return out

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self._jobs:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


#: States kept per worker. Every gloo process group holds a transport thread that wakes
#: up while idle; a worker that kept the groups of every layout a test session touches
#: (hundreds, with the ZeRO meshes) spent a noticeable share of the two cores on them.
MAX_CACHED_STATES = 6


def _release(state) -> None:
    """Destroy the process groups of ``state`` (every rank evicts the same state at the same call)."""
    import torch.distributed as dist

    if COLLECT_GARBAGE:
        gc.collect()  # nothing that still refers to these groups outlives them
    groups = [state.sp_group, state.dp_group, state.head_group, state.context_group, state.dkv_group]
    for ring in (state.inner_ring, state.outer_ring):
        if ring is not None:
            groups.append(ring.kv_group)
    # The ZeRO meshes are not the state's own (see :func:`cached_state`) and stay alive.
    for group in dict.fromkeys(g for g in groups if g is not None and g != dist.group.WORLD):
        dist.destroy_process_group(group)


def cached_state(**config):
    """``init_parallel`` for this worker, cached per config (groups are built once); the
    least recently used of more than :data:`MAX_CACHED_STATES` states is released."""
    import loongtrain as lt

    key = tuple(sorted(config.items()))
    if key in _state_cache:
        _state_cache[key] = _state_cache.pop(key)  # most recently used last
        return _state_cache[key]
    if len(_state_cache) >= MAX_CACHED_STATES:
        _release(_state_cache.pop(next(iter(_state_cache))))
    state = lt.init_parallel(lt.ParallelConfig(**config), zero_scopes=())
    meshes = _zero_meshes(state.layout.world_size, state.dp, state.device.type)
    _state_cache[key] = dataclasses.replace(state, zero_meshes=meshes)
    return _state_cache[key]


_mesh_cache: dict = {}


def _zero_meshes(world: int, dp: int, device_type: str):
    """The ZeRO meshes of every scope for ``dp``, built once per worker and shared by the
    cached states (a mesh depends on the world size, dp and scope only). Shared and never
    destroyed because DeviceMesh equality ignores the groups: DTensor's sharding caches hand
    a later model an earlier, equal mesh, so destroying an evicted state's mesh groups broke
    the next model with the same mesh (`Could not resolve the process group`)."""
    from torch.distributed.device_mesh import DeviceMesh

    from loongtrain.options import ZERO_SCOPES
    from loongtrain.parallel.state import zero_mesh_ranks

    if dp not in _mesh_cache:
        meshes = {}
        for scope in ZERO_SCOPES:
            ranks, names = zero_mesh_ranks(world, dp, scope)
            meshes[scope] = DeviceMesh(device_type, ranks, mesh_dim_names=names)
        _mesh_cache[dp] = types.MappingProxyType(meshes)
    return _mesh_cache[dp]
