"""``loongtrain plan``: rank the layouts of a model on a cluster, draw a schedule, calibrate
the local machine, or validate the cost model against measured runs.

    loongtrain plan --cluster a100 --model 7b-gqa --seq-len 1M --devices 64
    loongtrain plan ... --timeline plan.png --check-groups
    loongtrain plan ... --layout hp=8,cp=8,ring_window=4,placement=context_first,zero=dp_sp,ckpt=sc++
    loongtrain plan --calibrate            # writes clusters/local.toml
    loongtrain plan --validate             # measured vs predicted on local processes

Planning imports no torch; ``--calibrate``, ``--validate`` and ``--check-groups`` import
their measuring code (``loongtrain.bench``) when asked for.
"""

from __future__ import annotations

import argparse
import json
import sys

from loongtrain.planner.specs import PlanError

_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30}


def parse_length(text: str) -> int:
    """``"128K"`` -> 131072, ``"1M"`` -> 1048576 (binary suffixes), ``"4096"`` -> 4096."""
    raw = str(text).strip()
    scale = _SUFFIXES.get(raw[-1:].upper(), 1)
    number = raw[:-1] if scale > 1 else raw
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"length {text!r} is not a number with an optional K/M/G suffix (e.g. 128K, 1M)") from None
    if value != int(value) or value < 1:
        raise ValueError(f"length {text!r} must be a positive whole number of tokens")
    return int(value)


def _lengths_arg(text: str) -> list[int]:
    try:
        return [parse_length(part) for part in text.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ints_arg(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or a comma-separated list of them") from None


_LAYOUT_KEYS = {"dp": "dp", "hp": "hp", "cp": "cp", "ring_window": "ring_window", "w": "ring_window"}
_LAYOUT_KEYS["placement"] = "placement"
_LAYOUT_KEYS.update({"zero": "zero", "ckpt": "checkpoint", "checkpoint": "checkpoint"})


DEFAULT_GLOBAL_BATCH = 4 * 2**20  # tokens per optimizer step (LLaMA-2's 4M-token batch)


def _tokens_arg(text: str) -> int:
    try:
        return parse_length(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_candidate(text: str, devices: int):
    """``"hp=8,cp=8,ring_window=4,placement=head_first,zero=dp_sp,ckpt=sc++"`` -> ``Candidate`` (dp derived)."""
    from loongtrain.planner.cost import Candidate

    values: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in _LAYOUT_KEYS:
            raise PlanError(f"--layout: cannot read {part!r}; use key=value with keys {sorted(_LAYOUT_KEYS)}")
        name = _LAYOUT_KEYS[key.strip()]
        value = value.strip()
        if name in ("dp", "hp", "cp", "ring_window"):
            if not value.isdigit():
                raise PlanError(f"--layout: {key}={value!r} must be a positive integer")
            values[name] = int(value)
        else:
            values[name] = value
    hp, cp = values.setdefault("hp", 1), values.setdefault("cp", 1)
    if hp < 1 or cp < 1:
        raise PlanError("--layout: hp and cp must be positive")
    if "dp" not in values and devices % (hp * cp) != 0:
        raise PlanError(f"--layout: hp*cp = {hp}*{cp} = {hp * cp} does not divide devices={devices}")
    values.setdefault("dp", max(1, devices // (hp * cp)))
    return Candidate(**values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``loongtrain plan``'s options on ``parser``."""
    what = parser.add_argument_group("what to plan")
    what.add_argument("--cluster", default=None, help="preset a100|h100|h800|h200, 'local', or a TOML file (a100)")
    what.add_argument("--model", default="7b-gqa", help="model preset: 7b-mha, 7b-gqa, 13b, llama3-8b, debug")
    what.add_argument(
        "--seq-len", type=_lengths_arg, default=None, help="tokens per sequence, e.g. 128K, 1M (a list: a sweep)"
    )
    what.add_argument("--devices", type=_ints_arg, default=None, help="devices, whole nodes (a list: a sweep)")
    what.add_argument(
        "--global-batch",
        type=_tokens_arg,
        default=DEFAULT_GLOBAL_BATCH,
        metavar="TOKENS",
        help="tokens per optimizer step over all replicas, a multiple of the sequence length (4M)",
    )
    what.add_argument("--micro-batch", type=int, default=1, help="sequences per forward/backward (1)")
    out = parser.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="rows of the table (10)")
    out.add_argument("--json", action="store_true", help="print JSON instead of tables")
    out.add_argument("--layout", default=None, help="also price this layout, e.g. hp=8,cp=8,ring_window=4,ckpt=sc++")
    out.add_argument("--timeline", default=None, metavar="PNG", help="simulate one layer of the winner (or --layout)")
    out.add_argument("--check-groups", action="store_true", help="build the winner's groups on the fake backend")
    mode = parser.add_argument_group("measure this machine")
    mode.add_argument("--calibrate", action="store_true", help="measure gloo and CPU kernels, write the local cluster")
    mode.add_argument("--validate", action="store_true", help="time the attention over layouts vs the prediction")
    mode.add_argument("--nproc", type=int, default=4, help="processes to spawn for --calibrate/--validate (4)")
    mode.add_argument("--out", default=None, help="cluster file to write with --calibrate (clusters/local.toml)")
    mode.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement")
    mode.add_argument("--rounds", type=int, default=3, help="--validate: sweeps over the layouts (3)")
    mode.add_argument("--heads", type=int, default=8, help="--validate/--calibrate: query heads (8)")
    mode.add_argument("--kv-heads", type=int, default=8, help="--validate: key/value heads (8)")
    mode.add_argument("--head-dim", type=int, default=64, help="--validate/--calibrate: head dim (64)")


def _workload(args: argparse.Namespace, model, seq_len: int):
    from loongtrain.planner.cost import Workload

    return Workload.from_tokens(model, seq_len, args.global_batch, micro_batch=args.micro_batch)


def _timeline(cluster, workload, layout, path: str) -> dict:
    from loongtrain.planner.report import format_length
    from loongtrain.planner.simulate import simulate_layer
    from loongtrain.planner.timeline import draw_timelines

    fwd, bwd = simulate_layer(cluster, workload, layout)
    title = (
        f"one layer's attention, {layout.label()} on '{cluster.name}', "
        f"{format_length(workload.seq_len)} tokens (rank c=0 of its context group)"
    )
    written = draw_timelines(fwd, bwd, path, title)
    return {
        "path": str(written),
        "forward_s": fwd.makespan,
        "forward_exposed_s": fwd.exposed(0),
        "backward_s": bwd.makespan,
        "backward_exposed_s": bwd.exposed(0),
    }


def _sweep(args: argparse.Namespace, cluster, model) -> None:
    """One summary row per (sequence length, devices); infeasible cases say why."""
    from loongtrain.planner.report import SWEEP_HEADER, format_length, json_report, sweep_row
    from loongtrain.planner.search import search_layouts

    if args.layout or args.timeline or args.check_groups:
        raise PlanError("--layout, --timeline and --check-groups take one --seq-len and one --devices")
    rows, lines = [], []
    for seq in args.seq_len:
        for devices in args.devices:
            try:
                result = search_layouts(cluster, _workload(args, model, seq), devices)
            except PlanError as exc:
                rows.append({"seq_len": seq, "devices": devices, "error": str(exc)})
                lines.append(f"{format_length(seq):>5s} {devices:4d}  {exc}")
                continue
            rows.append(json_report(result, args.model, args.top))
            lines.append(sweep_row(result))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(
        f"loongtrain plan sweep: {args.model} on '{cluster.name}', global batch "
        f"{format_length(args.global_batch)} tokens per step (sequences per step = global batch / length)"
    )
    print("best layout per case (hf/cf: head_first/context_first; a2a, ring: exposed seconds per step);")
    print("right: the best MFU of each baseline family under the same model ('-': no valid layout fits)")
    print(SWEEP_HEADER)
    print("\n".join(lines))


def _plan(args: argparse.Namespace) -> None:
    from loongtrain.planner.estimate import estimate
    from loongtrain.planner.report import HEADER, json_report, row_dict, row_text, text_report
    from loongtrain.planner.search import check_candidate, search_layouts
    from loongtrain.planner.specs import cluster_spec, model_spec

    if args.seq_len is None or args.devices is None:
        raise PlanError("--seq-len and --devices are required to plan (or use --calibrate / --validate)")
    if args.top < 1:
        raise PlanError(f"--top={args.top} must be at least 1")
    cluster = cluster_spec(args.cluster or "a100")
    model = model_spec(args.model)
    if len(args.seq_len) > 1 or len(args.devices) > 1:
        _sweep(args, cluster, model)
        return
    devices = args.devices[0]
    workload = _workload(args, model, args.seq_len[0])
    result = search_layouts(cluster, workload, devices)
    chosen = None
    if args.layout:
        candidate = parse_candidate(args.layout, devices)
        check_candidate(workload, candidate, devices)
        chosen = estimate(cluster, workload, candidate)
    target = chosen if chosen is not None else result.best
    extra: dict = {}
    if args.timeline:
        extra["timeline"] = _timeline(cluster, workload, target.candidate, args.timeline)
    if args.check_groups:
        from loongtrain.bench.groups import check_groups  # builds process groups: imports torch

        extra["group_check"] = check_groups(target.candidate, cluster.devices_per_node)
    if args.json:
        out = json_report(result, args.model, args.top)
        if chosen is not None:
            out["layout"] = row_dict(chosen)
        print(json.dumps({**out, **extra}, indent=1))
        return
    print(text_report(result, args.model, args.top))
    if chosen is not None:
        rank = next((i + 1 for i, e in enumerate(result.ranked) if e.candidate == chosen.candidate), None)
        where = f"rank {rank} of {len(result.ranked)}" if rank else "does not fit in memory"
        print(f"\n--layout ({where}; {chosen.step_s / result.best.step_s:.2f}x the winner's time):")
        print(HEADER)
        print(row_text("*", chosen))
    if "timeline" in extra:
        t = extra["timeline"]
        print(
            f"\ntimeline of {target.candidate.label()}: {t['path']} (forward {t['forward_s'] * 1e3:.1f} ms, "
            f"{t['forward_exposed_s'] * 1e3:.1f} exposed; backward {t['backward_s'] * 1e3:.1f} ms, "
            f"{t['backward_exposed_s'] * 1e3:.1f} exposed)"
        )
    if "group_check" in extra:
        print(f"\ngroups built by init_parallel (fake backend, {target.candidate.devices} ranks) match the plan:")
        print("\n".join(f"  {line}" for line in extra["group_check"]))


def _run(args: argparse.Namespace) -> None:
    if args.calibrate and args.validate:
        raise PlanError("--calibrate and --validate are separate runs; calibrate first, then validate")
    if args.calibrate or args.validate:
        if args.nproc < 2:
            raise PlanError(f"--nproc={args.nproc}: calibration and validation need at least 2 processes")
    if args.calibrate:
        from loongtrain.bench import calibrate  # spawns processes: imports torch

        args.reps = args.reps or 7
        args.calib_heads, args.calib_head_dim = args.heads, args.head_dim
        calibrate.run(args)
        return
    if args.validate:
        from loongtrain.bench import validate  # spawns processes: imports torch
        from loongtrain.planner.specs import cluster_spec

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
    _plan(args)


def main(args: argparse.Namespace) -> None:
    """Run ``loongtrain plan``; user errors print one message and exit with status 2."""
    try:
        _run(args)
    except PlanError as exc:
        print(f"loongtrain plan: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="loongtrain plan", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    main(_parser.parse_args())
