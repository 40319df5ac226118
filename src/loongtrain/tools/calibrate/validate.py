"""``loongtrain plan --validate``: run the distributed attention (forward + backward) over
several layouts on local processes and compare the measured times with the cost model's
predictions for the calibrated ``local`` cluster (the layouts, predictions and targets
are ``loongtrain.planner.validation``).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist

from loongtrain.planner.specs import ClusterSpec
from loongtrain.planner.validation import (
    MEDIAN_ERROR_TARGET,
    PROBE_TOKENS,
    predict,
    probe_seconds,
    rescaled,
    summarize,
    validation_layouts,
)
from loongtrain.tools.calibrate.calibrate import load_average, time_block


def _probe(args: argparse.Namespace, gen: torch.Generator) -> tuple[float, float]:
    """Forward and backward seconds of the calibration's probe block, every rank at once."""
    from loongtrain.attention.schedule import BlockKind

    return time_block(PROBE_TOKENS, BlockKind.KV_FIRST_HALF, args.heads, args.head_dim, args.reps, gen)


def _validate_rank(device: torch.device, args: argparse.Namespace, cluster: ClusterSpec) -> None:
    from loongtrain.parallel import init_parallel
    from loongtrain.tools.harness import make_inputs, run_sharded_attention

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
    states = [init_parallel(layout.parallel, verify_inputs=False, zero_scopes=()) for _, layout in layouts]
    gen = torch.Generator().manual_seed(rank)
    probes = [_probe(args, gen)]
    times: list[list[tuple[float, float]]] = [[] for _ in layouts]
    for _ in range(args.rounds):  # rounds spread each layout's runs over time (the machine is noisy)
        for i, state in enumerate(states):
            run = run_sharded_attention(state, full, device, reps=args.reps)
            times[i].append((run.fwd_s, run.bwd_s))
    probes.append(_probe(args, gen))
    measured_probe = (statistics.mean(f for f, _ in probes), statistics.mean(b for _, b in probes))
    predicted_probe = probe_seconds(cluster, args.heads, args.head_dim)
    now = rescaled(cluster, measured_probe, predicted_probe)
    rows = []
    for (name, layout), samples in zip(layouts, times):
        fwd = statistics.median(f for f, _ in samples)
        bwd = statistics.median(b for _, b in samples)
        p_fwd, p_bwd = predict(now, layout, args.seq, args.heads, args.kv_heads, args.head_dim, e)
        raw_fwd, raw_bwd = predict(cluster, layout, args.seq, args.heads, args.kv_heads, args.head_dim, e)
        measured, predicted = fwd + bwd, p_fwd + p_bwd
        row = {
            "layout": name,
            "measured_fwd_s": fwd,
            "measured_bwd_s": bwd,
            "predicted_fwd_s": p_fwd,
            "predicted_bwd_s": p_bwd,
            "error": (predicted - measured) / measured,
            "error_without_rescaling": (raw_fwd + raw_bwd - measured) / measured,
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
    summary["median_abs_error_without_rescaling"] = statistics.median(abs(r["error_without_rescaling"]) for r in rows)
    summary["probe_drift"] = [m / p for m, p in zip(measured_probe, predicted_probe)]
    print(f"load average {load_start:.1f} before, {load_average():.1f} after (other processes share the cores)")
    print(
        f"drift since calibration (probe block: {PROBE_TOKENS} tokens, measured / predicted): forward "
        f"x{summary['probe_drift'][0]:.2f}, backward x{summary['probe_drift'][1]:.2f}; predictions above use the "
        f"rescaled rates; without rescaling the median |error| is {summary['median_abs_error_without_rescaling']:.1%}"
    )
    print(
        f"median |error| {summary['median_abs_error']:.1%} (target <= {MEDIAN_ERROR_TARGET:.0%}: "
        f"{'met' if summary['median_ok'] else 'MISSED'}); predicted fastest: {summary['predicted_fastest']}; "
        f"measured fastest two: {', '.join(summary['measured_best_two'])} "
        f"({'met' if summary['fastest_ok'] else 'MISSED'})"
    )
    if getattr(args, "json", False):
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))


def run(args: argparse.Namespace, cluster: ClusterSpec) -> None:
    """Spawn ``args.nproc`` processes and print the measured-vs-predicted table."""
    from loongtrain.launch import launch

    if cluster.devices_per_node != args.nproc:
        print(
            f"note: cluster {cluster.name!r} was calibrated with {cluster.devices_per_node} processes, "
            f"validating with {args.nproc}: compute contention differs, expect larger errors"
        )
    launch(_validate_rank, args.nproc, args, cluster)
