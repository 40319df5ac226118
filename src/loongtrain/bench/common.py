"""Pieces shared by the demo and the benchmarks: named layouts and timed attention runs."""

from __future__ import annotations

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
        out.append(NamedLayout(f"double ring w={world // 2}", ParallelConfig(cp=world, window=world // 2)))
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
                        ParallelConfig(hp=hp, cp=cp, window=cp, placement="context_first"),
                    )
                )
    if world == 1:
        out.append(NamedLayout("single", ParallelConfig()))
    return out


def make_inputs(
    batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, ...]:
    """Full-sequence q, k, v, dout (same on every rank: same seed)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, heads, head_dim, generator=gen)
    k = torch.randn(batch, seq, kv_heads, head_dim, generator=gen)
    v = torch.randn(batch, seq, kv_heads, head_dim, generator=gen)
    dout = torch.randn(batch, seq, heads, head_dim, generator=gen)
    return tuple(x.to(dtype) for x in (q, k, v, dout))


@dataclass
class TimedRun:
    out: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    fwd_s: float
    bwd_s: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
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
        _sync(device)
        t0 = time.perf_counter()
        out = head_context_attention(ql, kl, vl, state, causal=causal)
        _sync(device)
        t1 = time.perf_counter()
        out.backward(dout)
        _sync(device)
        t2 = time.perf_counter()
        if rep > 0:
            fwd_times.append(t1 - t0)
            bwd_times.append(t2 - t1)
    medians = [statistics.median(fwd_times), statistics.median(bwd_times)]
    times = torch.tensor(medians, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return TimedRun(out.detach(), ql.grad, kl.grad, vl.grad, times[0].item(), times[1].item())


def median_time(fn, reps: int) -> float:
    """Median wall time of ``fn()`` over ``reps`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
