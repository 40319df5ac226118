"""``loongtrain plan``: the planner's command line (``loongtrain.planner.cli``, pure) joined
with its measuring side (``loongtrain.tools.calibrate``: ``--calibrate``, ``--validate``,
``--check-groups``, ``--documents``), which imports torch and is imported only when asked for.

    loongtrain plan --cluster a100 --model 7b-gqa --seq-len 1M --devices 64 --check-groups
    loongtrain plan --cluster h100 --model llama3-8b --seq-len 128K --devices 64 --documents docs.tok
    loongtrain plan --calibrate            # writes clusters/local.toml
    loongtrain plan --validate             # measured vs predicted on local processes
    loongtrain plan --calibrate-gpu runs/gpu_check.json   # a GPU's cluster file from the GPU check
"""

from __future__ import annotations

import argparse
import sys

from loongtrain.planner import cli as planner_cli
from loongtrain.planner.specs import PlanError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register every option of ``loongtrain plan``: planning, then measuring."""
    planner_cli.add_arguments(parser)
    parser.add_argument_group("output").add_argument(
        "--check-groups", action="store_true", help="build the winner's groups on the fake backend"
    )
    mode = parser.add_argument_group("measure this machine")
    mode.add_argument("--calibrate", action="store_true", help="measure gloo and CPU kernels, write the local cluster")
    mode.add_argument("--validate", action="store_true", help="time the attention over layouts vs the prediction")
    mode.add_argument(
        "--calibrate-gpu", default=None, metavar="REPORT",
        help="fit a GPU's cluster file to a GPU check report (runs/gpu_check.json of scripts/gpu_check.sh); "
        "--cluster: the preset to start from (default: by the report's GPU), --out: where (clusters/NAME.toml)",
    )  # fmt: skip
    mode.add_argument("--nproc", type=int, default=4, help="processes to spawn for --calibrate/--validate (4)")
    mode.add_argument("--out", default=None, help="cluster file to write with --calibrate (clusters/local.toml)")
    mode.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement")
    mode.add_argument("--rounds", type=int, default=3, help="--validate: sweeps over the layouts (3)")
    mode.add_argument("--heads", type=int, default=8, help="--validate/--calibrate: query heads (8)")
    mode.add_argument("--kv-heads", type=int, default=8, help="--validate: key/value heads (8)")
    mode.add_argument("--head-dim", type=int, default=64, help="--validate/--calibrate: head dim (64)")


def _check_groups(candidate, devices_per_node: int) -> list[str]:
    from loongtrain.tools.calibrate.groups import check_groups  # builds process groups: imports torch

    return check_groups(candidate, devices_per_node)


def _per_batch(args: argparse.Namespace, cluster, workload, candidate) -> dict:
    import dataclasses

    from loongtrain.tools.calibrate.per_batch import (  # imports torch
        document_lengths,
        per_batch_text,
        predict_per_batch,
    )

    steps = 8
    lengths, about = document_lengths(args.documents, workload.seq_len * workload.batch * steps)
    pred = predict_per_batch(cluster, workload, candidate, lengths, about, steps)
    return {
        "per_batch": {**dataclasses.asdict(pred), "gain": pred.gain},
        "per_batch_text": per_batch_text(pred, candidate, cluster.name),
    }


def _calibrate_gpu(args: argparse.Namespace) -> None:
    from loongtrain.planner import calibrate_gpu
    from loongtrain.planner.specs import CLUSTER_PRESETS, cluster_spec

    name = args.cluster
    if name is None:
        env = calibrate_gpu.read_report(args.calibrate_gpu)["environment"]
        gpu = env.get("gpu", "")
        name = next((preset for preset in CLUSTER_PRESETS if gpu and preset.upper() in gpu), None)
        if name is None:
            made_on = f"GPU {gpu!r}" if gpu else f"{env.get('device', '?')} (no GPU)"
            raise PlanError(f"--calibrate-gpu: the report was made on {made_on}, which no preset matches; pass "
                            "--cluster PRESET_OR_FILE")  # fmt: skip
    print(calibrate_gpu.run(args.calibrate_gpu, cluster_spec(name), args.out))


def _run(args: argparse.Namespace) -> None:
    if args.calibrate_gpu:
        _calibrate_gpu(args)
        return
    if args.calibrate and args.validate:
        raise PlanError("--calibrate and --validate are separate runs; calibrate first, then validate")
    if args.calibrate or args.validate:
        if args.nproc < 2:
            raise PlanError(f"--nproc={args.nproc}: calibration and validation need at least 2 processes")
    if args.calibrate:
        from loongtrain.tools.calibrate import calibrate  # spawns processes: imports torch

        args.reps = args.reps or 7
        args.calib_heads, args.calib_head_dim = args.heads, args.head_dim
        calibrate.run(args)
        return
    if args.validate:
        from loongtrain.planner.specs import cluster_spec
        from loongtrain.tools.calibrate import validate  # spawns processes: imports torch

        cluster = cluster_spec(args.cluster or "local")
        args.dtype = "float32"  # the dtype --calibrate measures
        args.reps = args.reps or 3  # odd: run_sharded_attention takes sorted(times)[reps // 2]
        if args.seq_len and len(args.seq_len) > 1:
            raise PlanError("--validate takes one --seq-len")
        args.seq = args.seq_len[0] if args.seq_len else 8192
        if args.seq % (2 * args.nproc) != 0:
            raise PlanError(f"--seq-len={args.seq} must be a multiple of 2*nproc = {2 * args.nproc}")
        validate.run(args, cluster)
        return
    planner_cli.run(args, check_groups=_check_groups, per_batch=_per_batch)


def main(args: argparse.Namespace) -> None:
    """Run ``loongtrain plan``; user errors print one message and exit with status 2."""
    try:
        _run(args)
    except PlanError as exc:
        print(f"loongtrain plan: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
