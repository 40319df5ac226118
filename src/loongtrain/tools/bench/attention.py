"""``loongtrain bench attention``: time every scheme on ``nproc`` ranks, and measure the
decomposition overhead in one process.

Part 1 (one process, no communication): for each length, one fused causal attention
call over the full sequence (forward + backward) against the ring's blocks and merges
for all ``cp`` context ranks replayed one after another (:class:`RingReplay`). The ratio
is what splitting attention into ring blocks costs by itself.

Part 2 (``nproc`` processes): forward and backward time of each standard layout.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from loongtrain.attention.kernels import block_backward, block_forward
from loongtrain.attention.replay import RingReplay
from loongtrain.launch import launch, under_torchrun
from loongtrain.parallel import init_parallel
from loongtrain.tools.harness import make_inputs, median_time, run_sharded_attention, standard_layouts


def decomposition_overhead(
    seq: int,
    cp: int,
    ring_window: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    reps: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> dict:
    """Fused vs replayed ring attention (forward + backward) in this process, on ``device``."""
    device = torch.device(device)
    q, k, v, dout = make_inputs(1, seq, heads, kv_heads, head_dim, dtype, device=device)
    scale = head_dim**-0.5
    out, _ = block_forward(q, k, v, causal=True, scale=scale)

    def fused():
        o, l_ = block_forward(q, k, v, causal=True, scale=scale)
        block_backward(dout, q, k, v, o, l_, causal=True, scale=scale)

    replay = RingReplay(cp, ring_window, causal=True)
    qs, douts = replay.shard(q), replay.shard(dout)
    kvs = [torch.stack(kv) for kv in zip(replay.shard(k), replay.shard(v))]

    def replayed():
        outs, lses = replay.forward(qs, kvs, scale)
        replay.backward(douts, qs, kvs, outs, lses, scale)

    t_fused = median_time(fused, reps, device)
    t_replay = median_time(replayed, reps, device)
    outs, _ = replay.forward(qs, kvs, scale)
    err = ((replay.unshard(outs).double() - out.double()).abs().max() / out.abs().max()).item()
    return {
        "seq": seq,
        "cp": cp,
        "ring_window": ring_window,
        "fused_s": t_fused,
        "replay_s": t_replay,
        "ratio": t_replay / t_fused,
        "max_rel_err": err,
    }


def _bench_rank(device: torch.device, args: argparse.Namespace, rows: list) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    layouts = standard_layouts(world, args.heads, args.kv_heads)
    if rank == 0:
        print(f"\n[2] {world} processes ({dist.get_backend()}, {device.type}): forward / backward seconds per call")
        print(f"{'seq':>7s}  {'layout':34s} {'fwd s':>8s} {'bwd s':>8s} {'f+b s':>8s}")
    states = {layout.name: init_parallel(layout.config, verify_inputs=False) for layout in layouts}
    for seq in args.seqs:
        full = make_inputs(1, seq, args.heads, args.kv_heads, args.head_dim, dtype)
        for layout in layouts:
            run = run_sharded_attention(states[layout.name], full, device, reps=args.reps)
            if rank == 0:
                total = run.fwd_s + run.bwd_s
                print(f"{seq:7d}  {layout.name:34s} {run.fwd_s:8.3f} {run.bwd_s:8.3f} {total:8.3f}", flush=True)
                rows.append(
                    {
                        "part": "distributed",
                        "seq": seq,
                        "layout": layout.name,
                        "fwd_s": run.fwd_s,
                        "bwd_s": run.bwd_s,
                        "world": world,
                    }
                )
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def main(args: argparse.Namespace) -> None:
    dtype = getattr(torch, args.dtype)
    rows: list = []
    if not under_torchrun():
        cp = args.nproc
        print(
            f"[1] decomposition overhead in one process ({torch.get_num_threads()} threads): ring blocks + fp32 "
            f"merges for cp={cp} replayed vs one fused causal call, forward+backward, H={args.heads} "
            f"G={args.kv_heads} d={args.head_dim} {args.dtype}"
        )
        print(f"{'seq':>7s} {'ring_window':>11s} {'fused s':>8s} {'replay s':>9s} {'ratio':>6s} {'max rel err':>11s}")
        ring_windows = sorted({1, cp // 2 if cp >= 4 else 1})
        for seq in args.seqs:
            for ring_window in ring_windows:
                r = decomposition_overhead(
                    seq, cp, ring_window, args.heads, args.kv_heads, args.head_dim, args.reps, dtype
                )
                rows.append({"part": "overhead", **r})
                print(
                    f"{seq:7d} {ring_window:11d} {r['fused_s']:8.3f} {r['replay_s']:9.3f} {r['ratio']:6.3f} "
                    f"{r['max_rel_err']:11.1e}",
                    flush=True,
                )
    launch(_bench_rank, args.nproc, args, rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=4, help="processes to spawn (ignored under torchrun)")
    parser.add_argument(
        "--seqs",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[2048, 4096, 8192, 16384],
        help="comma-separated global sequence lengths",
    )
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions (median) after one warm-up")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this file")
