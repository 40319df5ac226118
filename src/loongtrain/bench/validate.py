"""``loongtrain plan --validate``: run the distributed attention (forward + backward) over
several layouts on local processes and compare the measured times with the cost model's
predictions for the calibrated ``local`` cluster.

Targets: median absolute error of forward+backward at most 25%, and the layout
predicted fastest among the two measured fastest.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist

from loongtrain.model.config import ModelConfig
from loongtrain.planner.calibrate import load_average
from loongtrain.planner.cost import Layout, Workload, attention_seconds
from loongtrain.planner.search import head_degree_ok
from loongtrain.planner.specs import ClusterSpec
from loongtrain.planner.topology import analyze

MEDIAN_ERROR_TARGET = 0.25


def validation_layouts(world: int, heads: int, kv_heads: int) -> list[tuple[str, Layout]]:
    """At least six distinct layouts of ``world`` ranks: rings, double ring, Ulysses, 2D, data parallel."""
    m = ModelConfig(dim=heads * 8, n_heads=heads, n_kv_heads=kv_heads)
    out: list[tuple[str, Layout]] = [(f"ring cp={world}", Layout(1, 1, world))]
    for w in (x for x in range(2, world) if world % x == 0):
        out.append((f"double ring cp={world} w={w}", Layout(1, 1, world, w)))
    if head_degree_ok(m, world):
        out.append((f"ulysses hp={world}", Layout(1, world, 1)))
    for hp in (x for x in range(2, world) if world % x == 0 and head_degree_ok(m, x)):
        cp = world // hp
        out.append((f"2D {hp}x{cp} head_first", Layout(1, hp, cp, 1, "head_first")))
        out.append((f"2D {hp}x{cp} context_first", Layout(1, hp, cp, 1, "context_first")))
    if world % 2 == 0 and world >= 4:
        half = world // 2
        out.append((f"dp=2 x ring cp={half}", Layout(2, 1, half)))
        if head_degree_ok(m, half):
            out.append((f"dp=2 x ulysses hp={half}", Layout(2, half, 1)))
    return out


def predict(c: ClusterSpec, layout: Layout, seq: int, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int):
    """Predicted (forward, backward) seconds of one attention call of ``layout``."""
    model = ModelConfig(vocab_size=8, dim=heads * head_dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads)
    w = Workload(model, seq, batch=layout.dp, dtype_bytes=dtype_bytes)
    topo = analyze(layout.hp, layout.cp, layout.window, layout.placement, c.devices_per_node)
    t = attention_seconds(c, w, layout, topo)
    return t.fwd, t.bwd


def _validate_rank(device: torch.device, args: argparse.Namespace, cluster: ClusterSpec) -> None:
    from loongtrain.bench.common import make_inputs, run_sharded_attention
    from loongtrain.parallel import init_parallel

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    e = torch.empty((), dtype=dtype).element_size()
    layouts = validation_layouts(world, args.heads, args.kv_heads)
    load_start = load_average()
    full = make_inputs(1, args.seq, args.heads, args.kv_heads, args.head_dim, dtype)
    if rank == 0:
        print(
            f"validation: distributed attention fwd+bwd on {world} gloo processes, S={args.seq}, "
            f"H={args.heads}, G={args.kv_heads}, d={args.head_dim}, {args.dtype}; median over {args.rounds} rounds "
            f"of {args.reps} runs (slowest rank); predictions for cluster {cluster.name!r}"
        )
        print(
            f"{'layout':28s} {'meas fwd':>8s} {'meas bwd':>8s} {'meas f+b':>8s} "
            f"{'pred fwd':>8s} {'pred bwd':>8s} {'pred f+b':>8s} {'error':>7s}",
            flush=True,
        )
    states = [init_parallel(layout.parallel_config(), verify_inputs=False) for _, layout in layouts]
    times: list[list[tuple[float, float]]] = [[] for _ in layouts]
    for _ in range(args.rounds):  # rounds spread each layout's runs over time (the machine is noisy)
        for i, state in enumerate(states):
            run = run_sharded_attention(state, full, device, reps=args.reps)
            times[i].append((run.fwd_s, run.bwd_s))
    rows = []
    for (name, layout), samples in zip(layouts, times):
        fwd = statistics.median(f for f, _ in samples)
        bwd = statistics.median(b for _, b in samples)
        p_fwd, p_bwd = predict(cluster, layout, args.seq, args.heads, args.kv_heads, args.head_dim, e)
        measured, predicted = fwd + bwd, p_fwd + p_bwd
        row = {
            "layout": name,
            "measured_fwd_s": fwd,
            "measured_bwd_s": bwd,
            "predicted_fwd_s": p_fwd,
            "predicted_bwd_s": p_bwd,
            "error": (predicted - measured) / measured,
        }
        rows.append(row)
        if rank == 0:
            print(
                f"{name:28s} {fwd:8.3f} {bwd:8.3f} {measured:8.3f} "
                f"{p_fwd:8.3f} {p_bwd:8.3f} {predicted:8.3f} {row['error']:+7.1%}",
                flush=True,
            )
    if rank != 0:
        return
    summary = summarize(rows)
    print(f"load average {load_start:.1f} before, {load_average():.1f} after (other processes share the cores)")
    print(
        f"median |error| {summary['median_abs_error']:.1%} (target <= {MEDIAN_ERROR_TARGET:.0%}: "
        f"{'met' if summary['median_ok'] else 'MISSED'}); predicted fastest: {summary['predicted_fastest']}; "
        f"measured fastest two: {', '.join(summary['measured_best_two'])} "
        f"({'met' if summary['fastest_ok'] else 'MISSED'})"
    )
    if getattr(args, "json", False):
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))


def summarize(rows: list[dict]) -> dict:
    """Median absolute error of fwd+bwd and whether the predicted fastest is among the measured best two."""

    def total(row, kind):
        return row[f"{kind}_fwd_s"] + row[f"{kind}_bwd_s"]

    median = statistics.median(abs(r["error"]) for r in rows)
    predicted_fastest = min(rows, key=lambda r: total(r, "predicted"))["layout"]
    best_two = [r["layout"] for r in sorted(rows, key=lambda r: total(r, "measured"))[:2]]
    return {
        "median_abs_error": median,
        "median_ok": median <= MEDIAN_ERROR_TARGET,
        "predicted_fastest": predicted_fastest,
        "measured_best_two": best_two,
        "fastest_ok": predicted_fastest in best_two,
    }


def run(args: argparse.Namespace, cluster: ClusterSpec) -> None:
    """Spawn ``args.nproc`` processes and print the measured-vs-predicted table."""
    from loongtrain.launch import launch

    if cluster.devices_per_node != args.nproc:
        print(
            f"note: cluster {cluster.name!r} was calibrated with {cluster.devices_per_node} processes, "
            f"validating with {args.nproc}: compute contention differs, expect larger errors"
        )
    launch(_validate_rank, args.nproc, args, cluster)
