"""``loongtrain bench documents``: packed documents through the distributed attention.

Part 1 (pure arithmetic): for each document-length distribution (a lognormal mix, one long
document plus short ones, and with ``--tokens FILE`` the packed sequences of a token file
that ``loongtrain prepare`` made from real text), the attention work per context rank (keys
its queries see) under each balance (zigzag, documents, locality), as max/mean over ranks,
and the ring's critical path over the ideal (total work / cp): a rank starts step ``s``
when it has finished step ``s-1`` and its predecessor has started step ``s-1`` (which is
when that block was sent on), so uneven steps cost only what this dependency chain cannot
absorb. Then the ring's key/value transfers of one pass (plain ring, the routes of
:mod:`loongtrain.attention.routes`) against the minimum (each block once to each rank
that reads it) and what the untrimmed ring sent (``cp - 1`` per rank).

Part 2 (``nproc`` processes): forward + backward seconds of the distributed attention on
a full causal sequence of the same length, then on each packed distribution with every
balance, and the ring bytes each rank sent (mean); the ratio to full causal is what the
document masks and routes save.

``--picture`` draws which (query, key) blocks each rank computes for a small packed
example, under both balances.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from loongtrain.attention import head_context_attention, sequence_layout, shard_sequence
from loongtrain.attention.mask_plan import BAND, CAUSAL, MaskPlan
from loongtrain.attention.routes import full_routes
from loongtrain.attention.schedule import ring_source
from loongtrain.attention.sharding import sequence_sharding
from loongtrain.launch import launch, under_torchrun
from loongtrain.parallel import ParallelConfig, init_parallel
from loongtrain.tools.harness import make_inputs

DISTRIBUTIONS = ("lognormal", "long+short")
BALANCES = ("zigzag", "documents", "locality")
RING_KINDS = ("fwd.ring_kv", "bwd.ring_kv", "bwd.ring_dkv")


def token_file_boundaries(path: str, seq: int, count: int) -> list[list[int]]:
    """Boundaries of the first ``count`` packed sequences of ``seq`` tokens of a token file
    (its documents, as the trainer's loader cuts them)."""
    from loongtrain.data.loader import TokenFileSource
    from loongtrain.data.tokens import TokenFile

    source = TokenFileSource(TokenFile(path), seq, pack=True)
    return [source.sample(i)[2].tolist() for i in range(min(count, source.train_sequences))]


def document_lengths(kind: str, seq: int, median: int, seed: int = 0) -> list[int]:
    """Boundaries ``[0, ..., seq]`` of a packed sequence drawn from ``kind``.

    ``lognormal``: lengths ``exp(N(ln median, 1))``, at least 1, capped at what is left.
    ``long+short``: one document of half the sequence, then 128-1024 token documents.
    """
    rng = random.Random(seed)
    cu = [0]
    if kind == "long+short":
        cu.append(seq // 2)
    elif kind != "lognormal":
        raise ValueError(f"unknown distribution {kind!r}; choose one of {list(DISTRIBUTIONS)}")
    while cu[-1] < seq:
        if kind == "lognormal":
            length = max(1, int(rng.lognormvariate(math.log(median), 1.0)))
        else:
            length = rng.randint(128, 1024)
        cu.append(min(seq, cu[-1] + length))
    return cu


def ring_critical_path(step_work: list[list[int]]) -> int:
    """Finish time of a plain ring whose rank ``c`` does ``step_work[c][s]`` at step ``s``
    (transfers free): ``start(c, s) = max(end(c, s-1), start(c-1, s-1))``."""
    cp = len(step_work)
    start, end = [0] * cp, [step_work[c][0] for c in range(cp)]
    for s in range(1, len(step_work[0])):
        start = [max(end[c], start[(c - 1) % cp]) for c in range(cp)]
        end = [start[c] + step_work[c][s] for c in range(cp)]
    return max(end)


def work_table(seq: int, cp: int, cu: list[int], balance: str) -> dict:
    """Per-rank work and the ring critical path of one sharding (pure; plain ring)."""
    bounds = tuple(cu)
    sharding = sequence_sharding(seq, 1, cp, bounds, balance)
    loads = sharding.work(bounds)
    plan = MaskPlan(sharding, bounds, True, None)

    def visible(c: int, src: int) -> int:
        total = 0
        for call in plan.calls(c, src):
            rows, cols = call.row1 - call.row0, call.col1 - call.col0
            total += rows * (rows + 1) // 2 if call.kind == CAUSAL else rows * cols
        return total

    ring = ParallelConfig(cp=cp)
    steps = [[visible(c, ring_source(c, ring, s, 0)) for s in range(cp)] for c in range(cp)]
    mean = sum(loads) / cp
    routes = plan.routes(ring)
    return {
        "balance": balance,
        "max_over_mean": max(loads) / mean,
        "critical_path": ring_critical_path(steps) / mean,
        "kernels": sum(len(plan.calls(c, src)) for c in range(cp) for src in range(cp)),
        "kv_blocks": sum(routes.kv_hops(c) for c in range(cp)),
        "minimum": routes.minimum_transfers(),
        "untrimmed": sum(full_routes(ring).kv_hops(c) for c in range(cp)),
    }


def _timed(state, full, cu, device, reps: int) -> tuple[float, float]:
    """Best forward+backward seconds (max over ranks) of the attention on ``full`` tensors with
    documents ``cu`` (None: one causal sequence), laid out by ``state``'s balance, and the
    ring MiB a rank sent in one forward+backward (mean over ranks)."""
    layout = sequence_layout(full[0].shape[1], state, cu)
    keys = {"layout": layout}
    q, k, v, dout = (shard_sequence(x, state, **keys).to(device) for x in full)
    times = []
    for rep in range(reps + 1):
        ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
        state.stats.reset()
        dist.barrier()
        t0 = time.perf_counter()
        head_context_attention(ql, kl, vl, state, causal=True, **keys).backward(dout)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if rep:
            times.append(time.perf_counter() - t0)
    elapsed = torch.tensor([min(times)], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    sent = torch.tensor([float(sum(state.stats.bytes.get(k, 0) for k in RING_KINDS))], dtype=torch.float64)
    dist.all_reduce(sent)
    return elapsed.item(), sent.item() / dist.get_world_size() / 2**20


def _bench_rank(device: torch.device, args: argparse.Namespace, cases: dict, rows: list) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    full = make_inputs(1, args.seq, args.heads, args.kv_heads, args.head_dim, getattr(torch, args.dtype))
    layouts = {"ring": ParallelConfig(cp=world)}
    if world >= 4 and world % 2 == 0:
        layouts[f"2D 2x{world // 2}"] = ParallelConfig(hp=2, cp=world // 2)
    if rank == 0:
        print(f"\n[2] {world} processes: forward+backward seconds (best of {args.reps}), ratio to full causal")
        print(f"{'layout':10s} {'documents':12s} {'balance':10s} {'f+b s':>8s} {'vs causal':>9s} {'ring MiB':>9s}")
    for name, config in layouts.items():
        states = {b: init_parallel(replace(config, balance=b), verify_inputs=False) for b in BALANCES}
        base, base_mib = _timed(states["zigzag"], full, None, device, args.reps)
        if rank == 0:
            print(f"{name:10s} {'(one)':12s} {'-':10s} {base:8.3f} {1.0:9.3f} {base_mib:9.2f}", flush=True)
            rows.append({"part": "time", "layout": name, "documents": "causal", "seconds": base, "ring_mib": base_mib})
        for kind, cu in cases.items():
            for balance, state in states.items():
                t, mib = _timed(state, full, cu, device, args.reps)
                if rank == 0:
                    print(f"{name:10s} {kind:12s} {balance:10s} {t:8.3f} {t / base:9.3f} {mib:9.2f}", flush=True)
                    rows.append({"part": "time", "layout": name, "documents": kind, "balance": balance,
                                 "seconds": t, "vs_causal": t / base, "ring_mib": mib})  # fmt: skip
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def draw_blocks(path: str, seq: int = 2048, cp: int = 4) -> None:
    """Which (query, key) pairs each rank computes for a packed example, under each balance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    # one long document, then short ones (scaled to seq)
    cu = [round(seq * x / 512) for x in (0, 240, 262, 300, 334, 380, 402, 450, 471, 512)]
    fig, axes = plt.subplots(1, len(BALANCES), figsize=(6 * len(BALANCES), 6.2))
    colors = ListedColormap(["white", "#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860"][: cp + 1])
    for ax, balance in zip(axes, BALANCES):
        sharding = sequence_sharding(seq, 1, cp, cu, balance)
        plan = MaskPlan(sharding, tuple(cu), True, None)
        grid = torch.zeros(seq, seq)
        content = [torch.tensor([p for s, n in sharding.content[c] for p in range(s, s + n)]) for c in range(cp)]
        kernels = 0
        for c in range(cp):
            for src in range(cp):
                for call in plan.calls(c, src):
                    kernels += 1
                    rows, cols = content[c][call.row0 : call.row1], content[src][call.col0 : call.col1]
                    sub = torch.ones(len(rows), len(cols), dtype=torch.bool)
                    if call.kind == CAUSAL:
                        sub = sub.tril()
                    elif call.kind == BAND:
                        raise AssertionError("no window in this picture")
                    block = grid[rows[:, None], cols[None, :]]
                    grid[rows[:, None], cols[None, :]] = torch.where(sub, float(c + 1), block)
        loads = sharding.work(tuple(cu))
        ratio = max(loads) / (sum(loads) / cp)
        ax.imshow(grid.numpy(), cmap=colors, vmin=0, vmax=cp, interpolation="nearest")
        for b in cu[1:-1]:
            ax.axhline(b - 0.5, color="black", lw=0.3)
            ax.axvline(b - 0.5, color="black", lw=0.3)
        ax.set(
            title=f"{balance}: {kernels} kernels, work max/mean {ratio:.2f}",
            xlabel="key position",
            ylabel="query position",
        )
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors(c + 1)) for c in range(cp)]
    fig.legend(handles, [f"context rank {c}" for c in range(cp)], loc="lower center", ncol=cp)
    fig.suptitle(f"Which (query, key) pairs each context rank computes: {len(cu) - 1} packed documents, S={seq}")
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> None:
    if args.picture:
        draw_blocks(args.picture, cp=args.nproc)
        print(f"wrote {args.picture}")
        return
    cp = args.nproc
    cases = {kind: document_lengths(kind, args.seq, args.median, args.seed) for kind in DISTRIBUTIONS}
    if args.tokens:
        for i, cu in enumerate(token_file_boundaries(args.tokens, args.seq, args.token_sequences)):
            cases[f"file#{i}"] = cu
    rows: list = []
    if not under_torchrun():
        print(
            f"[1] attention work per context rank, S={args.seq}, cp={cp} (pure arithmetic): max/mean over ranks, "
            f"the ring's critical path / ideal, and the key/value blocks one pass sends (all ranks) against the "
            f"minimum and the untrimmed ring"
        )
        print(
            f"{'documents':12s} {'docs':>5s} {'balance':10s} {'max/mean':>9s} {'critical':>9s} {'kernels':>8s} "
            f"{'KV blocks':>9s} {'minimum':>8s} {'untrimmed':>9s}"
        )
        for kind, cu in cases.items():
            for balance in BALANCES:
                r = work_table(args.seq, cp, cu, balance)
                rows.append({"part": "work", "documents": kind, "docs": len(cu) - 1, **r})
                print(
                    f"{kind:12s} {len(cu) - 1:5d} {balance:10s} {r['max_over_mean']:9.3f} {r['critical_path']:9.3f} "
                    f"{r['kernels']:8d} {r['kv_blocks']:9d} {r['minimum']:8d} {r['untrimmed']:9d}",
                    flush=True,
                )
    launch(_bench_rank, args.nproc, args, cases, rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=4, help="processes to spawn (ignored under torchrun)")
    parser.add_argument("--seq", type=int, default=32768, help="global sequence length")
    parser.add_argument("--median", type=int, default=2048, help="median document length of the lognormal mix")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document lengths")
    parser.add_argument(
        "--tokens", default=None, help="also the packed sequences of this token file (written by loongtrain prepare)"
    )
    parser.add_argument("--token-sequences", type=int, default=2, help="how many of the token file's sequences")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--reps", type=int, default=1, help="timed repetitions (best) after one warm-up")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    parser.add_argument("--picture", default=None, help="only draw the blocks picture to this PNG and exit")
