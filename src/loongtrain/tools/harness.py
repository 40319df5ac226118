"""Running the distributed attention outside training, shared by the demo, the benchmarks,
the calibration and the GPU check: named standard layouts, same-seed inputs, timed sharded
runs, device synchronisation and releasing memory between measurements."""

from __future__ import annotations

import ctypes
import gc
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loongtrain.attention import head_context_attention, shard_sequence
from loongtrain.parallel import ParallelConfig, ParallelState


@dataclass(frozen=True)
class NamedLayout:
    name: str
    config: ParallelConfig


def standard_layouts(world: int, heads: int, kv_heads: int) -> list[NamedLayout]:
    """The schemes worth comparing on ``world`` ranks (all sp = world, dp = 1)."""

    def ok(hp: int) -> bool:
        return heads % hp == 0 and (kv_heads % hp == 0 if hp <= kv_heads else hp % kv_heads == 0)

    out: list[NamedLayout] = []
    if world > 1:
        out.append(NamedLayout("ring", ParallelConfig(cp=world)))
    if world >= 4 and world % 2 == 0:
        out.append(NamedLayout(f"double ring w={world // 2}", ParallelConfig(cp=world, ring_window=world // 2)))
    if world > 1 and ok(world):
        out.append(NamedLayout("ulysses", ParallelConfig(hp=world)))
    for hp in range(2, world):
        if world % hp == 0 and ok(hp):
            cp = world // hp
            out.append(NamedLayout(f"2D {hp}x{cp} head_first", ParallelConfig(hp=hp, cp=cp)))
            if cp >= 2:
                out.append(
                    NamedLayout(
                        f"2D {hp}x{cp} context_first w={cp}",
                        ParallelConfig(hp=hp, cp=cp, ring_window=cp, placement="context_first"),
                    )
                )
    if world == 1:
        out.append(NamedLayout("single", ParallelConfig()))
    return out


def make_inputs(
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: torch.device | str = "cpu",
    kv_seq: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Full-sequence q, k, v, dout (same on every rank: same seed), drawn on ``device`` by a
    generator of that device; k and v have ``kv_seq`` rows (default ``seq``). On ``meta``
    only the shapes exist."""
    device = torch.device(device)
    gen = torch.Generator("cpu" if device.type == "meta" else device).manual_seed(seed)

    def draw(rows: int, n_heads: int) -> torch.Tensor:
        return torch.randn(batch, rows, n_heads, head_dim, generator=gen, device=device).to(dtype)

    kv_rows = seq if kv_seq is None else kv_seq
    return draw(seq, heads), draw(kv_rows, kv_heads), draw(kv_rows, kv_heads), draw(seq, heads)


@dataclass
class TimedRun:
    out: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    fwd_s: float
    bwd_s: float


def sync(device: torch.device | None) -> None:
    """Wait for ``device``'s queued work (CUDA kernels run asynchronously); no-op on CPU."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def run_sharded_attention(
    state: ParallelState,
    full: tuple[torch.Tensor, ...],
    device: torch.device,
    *,
    causal: bool = True,
    reps: int = 1,
) -> TimedRun:
    """Shard full (q, k, v, dout), run forward + backward ``reps`` times after one warm-up;
    return the last local results and the median times (max over ranks)."""
    q, k, v, dout = (shard_sequence(x, state).to(device) for x in full)
    fwd_times, bwd_times = [], []
    for rep in range(reps + 1):
        ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        out = head_context_attention(ql, kl, vl, state, causal=causal)
        sync(device)
        t1 = time.perf_counter()
        out.backward(dout)
        sync(device)
        t2 = time.perf_counter()
        if rep > 0:
            fwd_times.append(t1 - t0)
            bwd_times.append(t2 - t1)
    medians = [statistics.median(fwd_times), statistics.median(bwd_times)]
    times = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return TimedRun(out.detach(), ql.grad, kl.grad, vl.grad, times[0].item(), times[1].item())


def median_time(fn, reps: int, device: torch.device | None = None) -> float:
    """Median wall time of ``fn()`` over ``reps`` runs after one warm-up; with ``device``,
    each run is timed until that device's queued work has finished."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def release_memory(device: torch.device) -> None:
    """Return freed memory so the next measurement starts clean: the CUDA caching
    allocator's blocks to the GPU, glibc's free heap pages to the OS on CPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass
