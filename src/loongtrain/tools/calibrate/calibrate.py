"""``loongtrain plan --calibrate``: measure this machine and write the ``local`` cluster file.

Spawns ``nproc`` local gloo processes (``loongtrain.launch``) and measures, with the code
paths the attention uses and every rank busy at once (as in a real run):

- point to point: ``ring_exchange`` (``batch_isend_irecv``) between two ranks, and around
  a ring of all ranks at once (-> per-device and whole-node bandwidth, latency);
- all-to-all: ``all_to_all_start`` on packed buffers, over pairs and over all ranks;
- attention: the ring step functions (``forward_work``/``backward_work`` on a zigzag block's call: the CPU
  flash kernels plus the fp32 merge/accumulation) on non-causal half blocks and causal
  diagonal blocks of several sizes, on every rank at once (ranks share the cores);
- matmul: ``torch.mm`` alone in one process (the "peak") and on every rank at once;
- overlap: a block computed while a ring transfer is in flight;
- synchronisation: ring steps (a block, then a tiny exchange with the neighbours) against
  the same blocks alone: what ranks that time-share cores lose meeting at each transfer.

Each measurement is the median over repetitions of the slowest rank. The fits (pure) are
``loongtrain.planner.fit.fit_cluster``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from pathlib import Path

import torch
import torch.distributed as dist

from loongtrain.attention.mask_plan import zigzag_calls
from loongtrain.attention.schedule import BlockKind
from loongtrain.planner.fit import fit_cluster
from loongtrain.planner.specs import cluster_to_toml, default_local_path

COMM_SIZES = (2**16, 2**18, 2**20, 2**22, 2**23, 2**24)
NONCAUSAL_TOKENS = (512, 1024, 2048, 4096)  # tokens per context rank (two zigzag chunks)
CAUSAL_TOKENS = (1024, 2048, 4096)


def _median_of_slowest(fn, reps: int) -> float:
    """Median over ``reps`` runs (after a warm-up) of the slowest rank's time of ``fn()``."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([sorted(times)[len(times) // 2]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _ring_link(members: list[int], rank: int):
    from loongtrain.parallel.state import RingLink

    group = dist.new_group(members)
    if rank not in members:
        return None
    pos = members.index(rank)
    return RingLink(group, members[(pos + 1) % len(members)], members[pos - 1], len(members))


def measure_comm(reps: int) -> dict:
    """Pair and whole-ring exchanges, all-to-alls over pairs and over all ranks."""
    from loongtrain.attention.comm import all_to_all_start, ring_exchange
    from loongtrain.parallel.stats import AttentionStats

    rank, world = dist.get_rank(), dist.get_world_size()
    stats = AttentionStats()
    pair = _ring_link([0, 1], rank)
    ring = _ring_link(list(range(world)), rank)
    pair_groups = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]
    my_pair = pair_groups[rank // 2] if rank < 2 * (world // 2) else None
    out: dict = {"pair": [], "ring": [], "a2a": []}
    for nbytes in COMM_SIZES:
        x = torch.randn(nbytes // 4)

        def exchange(link=None, x=x):
            if link is not None:
                ring_exchange(x, link, stats, "calib").wait()

        out["pair"].append((nbytes, _median_of_slowest(lambda: exchange(pair), reps)))
        out["ring"].append((nbytes, _median_of_slowest(lambda: exchange(ring), reps)))
        for size, group in ((2, my_pair), (world, dist.group.WORLD)):
            packed = torch.randn(size, nbytes // 4 // size)

            def a2a(packed=packed, group=group):
                if group is not None:
                    all_to_all_start(packed, group, stats, "calib").wait()

            out["a2a"].append((size, nbytes, _median_of_slowest(a2a, reps)))
    return out


def _forward(q, kv, kind: BlockKind, scale: float, acc) -> None:
    """One zigzag ring block of ``kind`` (its call, as the ring runs it) merged into ``acc``."""
    from loongtrain.attention.blocks import forward_work

    forward_work(q, kv, zigzag_calls(kind, q.shape[1]), True, None, scale, acc)


def time_block(tokens: int, kind, heads: int, head_dim: int, reps: int, gen) -> tuple[float, float]:
    """Forward and backward seconds of one ring step of ``kind`` on ``tokens`` local tokens."""
    from loongtrain.attention.blocks import OutputAccumulator, add_kv_grads, backward_work

    scale = head_dim**-0.5
    q = torch.randn(1, tokens, heads, head_dim, generator=gen)
    kv = torch.randn(2, 1, tokens, heads, head_dim, generator=gen)
    dout = torch.randn_like(q)
    acc = OutputAccumulator()
    _forward(q, kv, BlockKind.DIAGONAL, scale, acc)  # later blocks merge into it
    fwd_s = _median_of_slowest(lambda: _forward(q, kv, kind, scale, acc), reps)
    out, lse = acc.out.clone(), acc.lse.clone()
    dq, partial = torch.zeros_like(q), torch.zeros_like(kv)
    calls = zigzag_calls(kind, tokens)

    def backward():
        add_kv_grads(partial, backward_work(dout, q, kv, out, lse, calls, True, None, scale, dq))

    return fwd_s, _median_of_slowest(backward, reps)


def measure_blocks(heads: int, head_dim: int, reps: int) -> dict:
    """Ring-step forward/backward times on every rank at once: ``[(fwd FLOPs, seconds, causal)]``."""
    gen = torch.Generator().manual_seed(dist.get_rank())
    out: dict = {"fwd": [], "bwd": []}
    shapes = [(s, BlockKind.KV_FIRST_HALF) for s in NONCAUSAL_TOKENS] + [(s, BlockKind.DIAGONAL) for s in CAUSAL_TOKENS]
    for tokens, kind in shapes:
        flops = 2.0 * tokens * tokens * heads * head_dim  # half of a tokens x tokens block
        fwd_s, bwd_s = time_block(tokens, kind, heads, head_dim, reps, gen)
        out["fwd"].append((flops, fwd_s, kind is BlockKind.DIAGONAL))
        out["bwd"].append((flops, bwd_s, kind is BlockKind.DIAGONAL))
    return out


def measure_matmul(reps: int, n: int = 1024) -> dict:
    a, b = torch.randn(n, n), torch.randn(n, n)
    flops = 2.0 * n**3
    alone = _median_of_slowest(lambda: (a @ b) if dist.get_rank() == 0 else None, reps)
    together = _median_of_slowest(lambda: a @ b, reps)
    return {"matmul_alone": flops / alone, "matmul_all": flops / together}


def measure_overlap(heads: int, head_dim: int, reps: int, tokens: int = 2048, nbytes: int = 2**26) -> dict:
    """A non-causal block alone, a whole-ring transfer alone, and both at once."""
    from loongtrain.attention.blocks import OutputAccumulator
    from loongtrain.attention.comm import ring_exchange
    from loongtrain.parallel.stats import AttentionStats

    rank, world = dist.get_rank(), dist.get_world_size()
    link, stats = _ring_link(list(range(world)), rank), AttentionStats()
    q = torch.randn(1, tokens, heads, head_dim)
    kv = torch.randn(2, 1, tokens, heads, head_dim)
    x = torch.randn(nbytes // 4)
    acc = OutputAccumulator()
    _forward(q, kv, BlockKind.DIAGONAL, head_dim**-0.5, acc)

    def compute():
        _forward(q, kv, BlockKind.KV_FIRST_HALF, head_dim**-0.5, acc)

    def both():
        pending = ring_exchange(x, link, stats, "calib")
        compute()
        pending.wait()

    return {
        "compute": _median_of_slowest(compute, reps),
        "transfer": _median_of_slowest(lambda: ring_exchange(x, link, stats, "calib").wait(), reps),
        "both": _median_of_slowest(both, reps),
    }


def measure_step(heads: int, head_dim: int, reps: int, tokens: int = 1024, steps: int = 4) -> dict:
    """``steps`` ring steps of every rank (a non-causal half block, then a 1 KiB exchange with
    the ring neighbours) against the same blocks without the exchange: seconds per step."""
    from loongtrain.attention.blocks import OutputAccumulator
    from loongtrain.attention.comm import ring_exchange
    from loongtrain.parallel.stats import AttentionStats

    rank, world = dist.get_rank(), dist.get_world_size()
    link, stats = _ring_link(list(range(world)), rank), AttentionStats()
    q = torch.randn(1, tokens, heads, head_dim)
    kv = torch.randn(2, 1, tokens, heads, head_dim)
    token = torch.zeros(256)
    acc = OutputAccumulator()
    _forward(q, kv, BlockKind.DIAGONAL, head_dim**-0.5, acc)

    def blocks(exchange: bool):
        for _ in range(steps):
            _forward(q, kv, BlockKind.KV_FIRST_HALF, head_dim**-0.5, acc)
            if exchange:
                ring_exchange(token, link, stats, "calib").wait()

    return {
        "step": _median_of_slowest(lambda: blocks(True), reps) / steps,
        "block": _median_of_slowest(lambda: blocks(False), reps) / steps,
    }


def measure_host_copy(reps: int, nbytes: int = 2**26) -> float:
    """Seconds of one ``copy_`` of ``nbytes`` between two host buffers, every rank at once: what
    offload's host link is for CPU processes (a memory copy)."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    return _median_of_slowest(lambda: dst.copy_(src), reps)


def load_average() -> float:
    """One-minute load average (0 where unknown)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def _memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 8.0


def _raw_lines(meas: dict) -> list[str]:
    lines = ["raw measurements (median of the slowest rank):"]
    for key in ("pair", "ring"):
        pts = ", ".join(f"{b / 2**20:g} MiB {t * 1e3:.2f} ms" for b, t in meas[key])
        lines.append(f"  {key}: {pts}")
    for g, b, t in meas["a2a"]:
        lines.append(f"  all-to-all group {g}: {b / 2**20:g} MiB {t * 1e3:.2f} ms")
    for key in ("fwd", "bwd"):
        for f, t, causal in meas[key]:
            kind = "causal diagonal" if causal else "non-causal half"
            lines.append(f"  {key} {kind}: {f / 1e9:.2f} GFLOP (fwd count) {t * 1e3:.1f} ms")
    step = meas["step"]
    lines.append(f"  ring step: {step['step'] * 1e3:.2f} ms, its block alone {step['block'] * 1e3:.2f} ms")
    if "host_copy" in meas:
        nbytes, t = meas["host_copy"]
        lines.append(f"  host copy: {nbytes / 2**20:g} MiB {t * 1e3:.2f} ms (every rank at once)")
    return lines


def _calibrate_rank(device: torch.device, args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    t_start = time.perf_counter()
    if rank == 0:
        print(f"calibrating with {dist.get_world_size()} processes ({torch.get_num_threads()} thread(s) each) ...")
    meas: dict = {
        "nproc": dist.get_world_size(),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "calib_heads": args.calib_heads,
        "calib_head_dim": args.calib_head_dim,
        "date": datetime.date.today().isoformat(),
        "load_start": load_average(),
    }
    meas.update(measure_comm(args.reps))
    if rank == 0:
        print(f"  communication measured ({time.perf_counter() - t_start:.0f} s)", flush=True)
    meas.update(measure_blocks(args.calib_heads, args.calib_head_dim, args.reps))
    if rank == 0:
        print(f"  attention blocks measured ({time.perf_counter() - t_start:.0f} s)", flush=True)
    meas.update(measure_matmul(args.reps))
    meas["overlap"] = measure_overlap(args.calib_heads, args.calib_head_dim, args.reps)
    meas["step"] = measure_step(args.calib_heads, args.calib_head_dim, args.reps)
    meas["host_copy"] = (2**26, measure_host_copy(args.reps))
    if rank != 0:
        return
    path = Path(args.out) if args.out else default_local_path()
    spec, comments = fit_cluster(meas, name=path.stem)
    header = "\n".join(
        [
            f"The '{path.stem}' cluster: this machine, measured by `loongtrain plan --calibrate`.",
            f"{platform.node()} {platform.machine()}, torch {torch.__version__}, {meas['date']}; "
            f"attention measured with H={args.calib_heads}, d={args.calib_head_dim}, fp32; load average "
            f"{meas['load_start']:.1f} before, {load_average():.1f} after (other processes share the cores).",
            *_raw_lines(meas),
            "",
        ]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cluster_to_toml(spec, comments, header))
    print(path.read_text())
    print(f"wrote {path} ({time.perf_counter() - t_start:.0f} s)")


def run(args: argparse.Namespace) -> None:
    """Spawn ``args.nproc`` processes, measure, write the cluster file (rank 0)."""
    from loongtrain.launch import launch

    launch(_calibrate_rank, args.nproc, args)
