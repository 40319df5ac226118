"""``loongtrain bench layer-kinds``: bytes a sliding-window layer and a full layer send per step.

For each context degree ``cp`` and global length, one attention forward and backward of a
full causal layer and of a sliding layer of window ``w`` (one zigzag document) on the same
shards; the ``state.stats`` counters give the bytes each rank sent: key/value blocks
(forward, and again in backward) and the float32 dK/dV partials. The full layer sends
``~2 (cp - 1)`` blocks of ``S / cp`` tokens per pass; a sliding layer whose window is below a
zigzag chunk (``S / 2cp``) takes the halo (:mod:`loongtrain.attention.halo`): ``w - 1`` tokens
to each ring neighbour, flat in ``S``. Bytes are exact on any device (only the time would
not transfer from CPU processes), so the table is measured, not predicted.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

import loongtrain as lt
from loongtrain.launch import launch
from loongtrain.parallel import ParallelConfig, init_parallel

KINDS = ("ring_kv fwd", "ring_kv bwd", "ring_dkv")
COUNTERS = ("fwd.ring_kv", "bwd.ring_kv", "bwd.ring_dkv")


def layer_bytes(state, seq: int, window: int | None, heads: int, kv_heads: int, head_dim: int) -> list[int]:
    """Bytes this rank sent per counter (:data:`COUNTERS`) in one forward + backward of causal
    attention over ``seq`` tokens (one document) with ``window`` (None: full)."""
    gen = torch.Generator().manual_seed(seq)
    layout = lt.sequence_layout(seq, state)
    full = [torch.randn(1, seq, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads)]
    q, k, v = (lt.shard_sequence(x, state, layout=layout).requires_grad_() for x in full)
    state.stats.reset()
    lt.head_context_attention(q, k, v, state, layout=layout, sliding_window=window).sum().backward()
    return [state.stats.bytes.get(kind, 0) for kind in COUNTERS]


def _bench_rank(device: torch.device, args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    if rank == 0:
        print(
            f"bytes sent per rank in one forward + backward of one layer (the most any rank sends), H={args.heads} "
            f"G={args.kv_heads} d={args.head_dim} float32, one document, zigzag; sliding window w={args.window}"
        )
        print(f"{'cp':>3s} {'seq':>7s} {'kind':>12s} {'kv fwd':>10s} {'kv bwd':>10s} {'dkv':>10s} {'total':>11s} "
              f"{'sliding/full':>12s}")  # fmt: skip
    for cp in args.cps:
        state = init_parallel(ParallelConfig(cp=cp, dp=world // cp), verify_inputs=False)
        for seq in args.seqs:
            measured = {}
            for name, window in (("full", None), (f"sliding {args.window}", args.window)):
                mine = torch.tensor(layer_bytes(state, seq, window, args.heads, args.kv_heads, args.head_dim))
                dist.all_reduce(mine, op=dist.ReduceOp.MAX)
                measured[name] = mine.tolist()
            if rank == 0:
                full_total = sum(measured["full"])
                for name, counts in measured.items():
                    total = sum(counts)
                    ratio = f"{total / full_total:12.4f}" if name != "full" else f"{'':12s}"
                    print(f"{cp:3d} {seq:7d} {name:>12s} " + " ".join(f"{b:10d}" for b in counts)
                          + f" {total:11d} {ratio}", flush=True)  # fmt: skip
                    rows.append({"cp": cp, "seq": seq, "kind": name, **dict(zip(COUNTERS, counts)), "total": total})
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def main(args: argparse.Namespace) -> None:
    nproc = max(args.cps)
    if any(nproc % cp for cp in args.cps):
        raise SystemExit(f"--cps {args.cps}: each must divide the largest ({nproc}), the processes started")
    if any(seq % (2 * cp) for seq in args.seqs for cp in args.cps):
        raise SystemExit(f"--seqs {args.seqs}: each must be a multiple of 2 * cp for every cp of {args.cps}")
    launch(_bench_rank, nproc, args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser.add_argument("--cps", type=ints, default=[4, 8], help="context degrees (processes: the largest)")
    parser.add_argument("--seqs", type=ints, default=[4096, 16384, 65536], help="global sequence lengths")
    parser.add_argument("--window", type=int, default=256, help="the sliding layer's window")
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this file")
