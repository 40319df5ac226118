"""The planning side of ``loongtrain plan``: rank the layouts of a model on a cluster, price
one layout, draw a schedule, or find the longest sequence that trains. Pure (no torch).

    loongtrain plan --cluster a100 --model 7b-gqa --seq-len 1M --devices 64
    loongtrain plan ... --layout hp=8,cp=8,ring_window=4,placement=context_first,zero=dp_sp,ckpt=sc++
    loongtrain plan ... --layout hp=1,cp=8,ckpt=full,loss_chunk=1024,mlp_tile=8192,offload=activations
    loongtrain plan --cluster h100 --model llama3-8b --devices 8 --max-seq-len
    loongtrain plan --model /path/to/hf/folder ...     # a Hugging Face model folder (config.json)

The measuring side (``--calibrate``, ``--validate``, ``--check-groups``) is
``loongtrain.tools.calibrate``; the command that joins both is ``loongtrain.plan_cli``, which
passes the group check in (:func:`run`), so nothing here imports above the planner.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable

from loongtrain.planner.specs import PlanError

#: ``check_groups(candidate, devices_per_node) -> lines``: builds the layout's process groups
#: (the measuring side; passed in by ``loongtrain.plan_cli``)
GroupCheck = Callable[..., list[str]]
#: ``per_batch(args, cluster, workload, candidate) -> {"per_batch": ..., "per_batch_text": ...}``:
#: ``--documents``' prediction, which prices layouts with the attention's layout code (torch;
#: passed in by ``loongtrain.plan_cli``)
PerBatchPrediction = Callable[..., dict]

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


#: ``--layout`` keys -> the option they set (``w`` is short for ``ring_window``)
_LAYOUT_KEYS = {
    "dp": "dp",
    "hp": "hp",
    "cp": "cp",
    "ring_window": "ring_window",
    "w": "ring_window",
    "placement": "placement",
    "zero": "zero",
    "ckpt": "activation_checkpoint",
    "activation_checkpoint": "activation_checkpoint",
    "every": "activation_checkpoint_every",
    "loss_chunk": "loss_chunk",
    "mlp_tile": "mlp_tile",
    "head_groups": "head_groups",
    "span": "activation_checkpoint_span",
    "layers": "activation_checkpoint_layers",
    "offload": "offload",
}
_INT_KEYS = (
    "dp", "hp", "cp", "ring_window", "activation_checkpoint_every", "loss_chunk", "mlp_tile", "head_groups",
    "activation_checkpoint_span", "activation_checkpoint_layers",
)  # fmt: skip
_OFFLOADS = {
    "none": (False, False),
    "activations": (True, False),
    "states": (False, True),
    "both": (True, True),
}
#: old keys refused with their new name (one name per idea)
_RENAMED = {"window": "ring_window (the Double-Ring-Attention inner ring size)"}


DEFAULT_GLOBAL_BATCH = 4 * 2**20  # tokens per optimizer step (LLaMA-2's 4M-token batch)


def _tokens_arg(text: str) -> int:
    try:
        return parse_length(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_candidate(text: str, devices: int, default_checkpoint: str = "full"):
    """``"hp=8,cp=8,ring_window=4,placement=head_first,zero=dp_sp,ckpt=sc++,offload=activations"``
    -> ``Candidate`` (dp derived from ``devices``; memory options the library's defaults)."""
    from loongtrain.options import MemoryOptions
    from loongtrain.parallel.config import ParallelConfig
    from loongtrain.planner.cost import Candidate

    values: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = (x.strip() for x in part.partition("="))
        if key in _RENAMED:
            raise PlanError(f"--layout: {key}= was renamed; use {_RENAMED[key]}")
        if not sep or key not in _LAYOUT_KEYS:
            raise PlanError(f"--layout: cannot read {part!r}; use key=value with keys {sorted(_LAYOUT_KEYS)}")
        name = _LAYOUT_KEYS[key]
        if name in _INT_KEYS:
            if not value.isdigit():
                raise PlanError(f"--layout: {key}={value!r} must be a non-negative integer")
            values[name] = int(value)
        elif name == "offload":
            if value not in _OFFLOADS:
                raise PlanError(f"--layout: offload={value!r}; use one of {list(_OFFLOADS)}")
            values["offload_activations"], values["offload_states"] = _OFFLOADS[value]
        else:
            values[name] = value
    hp, cp = values.pop("hp", 1), values.pop("cp", 1)
    if hp < 1 or cp < 1:
        raise PlanError("--layout: hp and cp must be positive")
    if "dp" not in values and devices % (hp * cp) != 0:
        raise PlanError(f"--layout: hp*cp = {hp}*{cp} = {hp * cp} does not divide devices={devices}")
    dp = values.pop("dp", max(1, devices // (hp * cp)))
    zero = values.pop("zero", "dp_sp")
    parallel_keys = {k: values.pop(k) for k in ("ring_window", "placement") if k in values}
    values.setdefault("activation_checkpoint", default_checkpoint)
    try:
        parallel = ParallelConfig(hp=hp, cp=cp, dp=dp, **parallel_keys)
    except ValueError as exc:
        raise PlanError(f"--layout: {exc}") from None
    try:
        memory = MemoryOptions(**values)
    except ValueError as exc:
        raise PlanError(f"--layout: {exc}") from None
    return Candidate(parallel, zero, memory)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the planning options of ``loongtrain plan`` on ``parser``."""
    what = parser.add_argument_group("what to plan")
    what.add_argument("--cluster", default=None, help="preset a100|h100|h800|h200, 'local', or a TOML file (a100)")
    what.add_argument(
        "--model",
        default="7b-gqa",
        help="model preset (7b-mha, 7b-gqa, 13b, llama3-8b, olmo3-7b, gemma3-4b, debug) or a Hugging Face "
        "model folder (config.json)",
    )
    what.add_argument(
        "--seq-len", type=_lengths_arg, default=None, help="tokens per sequence, e.g. 128K, 1M (a list: a sweep)"
    )
    what.add_argument("--devices", type=_ints_arg, default=None, help="devices, whole nodes (a list: a sweep)")
    what.add_argument(
        "--global-batch",
        type=_tokens_arg,
        default=None,
        metavar="TOKENS",
        help="tokens per optimizer step over all replicas, a multiple of the sequence length (4M)",
    )
    what.add_argument("--micro-batch", type=int, default=1, help="sequences per forward/backward (1)")
    what.add_argument(
        "--max-seq-len",
        action="store_true",
        help="find the longest sequence that trains on --devices (one sequence per step), with its layout",
    )
    what.add_argument(
        "--documents",
        default=None,
        metavar="FILE|MIX",
        help="also predict per-batch layouts for packed documents of these lengths: a token file from loongtrain "
        "prepare, or lognormal:median=1024,sigma=1.5[,max=L]",
    )
    what.add_argument(
        "--float8",
        default="",
        choices=("", "tensorwise", "rowwise", "rowwise_with_gw_hp"),
        metavar="RECIPE",
        help="plan FP8 training of the blocks' linears (torchao recipe: tensorwise, rowwise, rowwise_with_gw_hp); "
        "the winner is also priced in bf16, side by side",
    )
    what.add_argument(
        "--float8-all-gather", action="store_true", help="with --float8 tensorwise: ZeRO gathers weights in float8"
    )
    out = parser.add_argument_group("output")
    out.add_argument("--top", type=int, default=10, help="rows of the table (10)")
    out.add_argument("--json", action="store_true", help="print JSON instead of tables")
    out.add_argument(
        "--layout",
        default=None,
        help="also price this layout: keys hp, cp, ring_window (w), placement, dp, zero, ckpt, every, layers (only "
        "the first this many layers checkpointed), loss_chunk, mlp_tile, head_groups, span, "
        "offload=none|activations|states|both; e.g. hp=8,cp=8,ring_window=4,ckpt=sc++",
    )
    out.add_argument("--timeline", default=None, metavar="PNG", help="simulate one layer of the winner (or --layout)")


def _workload(args: argparse.Namespace, model, seq_len: int):
    from loongtrain.planner.cost import Workload

    tokens = args.global_batch if args.global_batch is not None else DEFAULT_GLOBAL_BATCH
    float8 = dict(float8=getattr(args, "float8", ""), float8_all_gather=getattr(args, "float8_all_gather", False))
    return Workload.from_tokens(model, seq_len, tokens, micro_batch=args.micro_batch, **float8)


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

    if args.layout or args.timeline or args.documents or getattr(args, "check_groups", False):
        raise PlanError("--layout, --timeline, --documents and --check-groups take one --seq-len and one --devices")
    rows, lines = [], []
    for seq in args.seq_len:
        for devices in args.devices:
            try:
                result = search_layouts(cluster, _workload(args, model, seq), devices)
            except PlanError as exc:
                rows.append({"seq_len": seq, "devices": devices, "error": str(exc)})
                lines.append(f"{format_length(seq):>5s} {devices:4d}  {exc}")
                continue
            if args.json:
                rows.append(json_report(result, args.model, args.top))
            lines.append(sweep_row(result))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    batch = args.global_batch if args.global_batch is not None else DEFAULT_GLOBAL_BATCH
    print(
        f"loongtrain plan sweep: {args.model} on '{cluster.name}', global batch "
        f"{format_length(batch)} tokens per step (sequences per step = global batch / length)"
    )
    print("best layout per case (hf/cf: head_first/context_first; a2a, ring: exposed seconds per step);")
    print("right: the best MFU of each baseline family under the same model ('-': no valid layout fits)")
    print(SWEEP_HEADER)
    print("\n".join(lines))


def _check_request(args: argparse.Namespace) -> None:
    """Bad input, in one line, before anything runs."""
    if args.top < 1:
        raise PlanError(f"--top={args.top} must be at least 1")
    if getattr(args, "float8_all_gather", False) and getattr(args, "float8", "") != "tensorwise":
        raise PlanError("--float8-all-gather sends one scale per weight: it needs --float8 tensorwise")
    if isinstance(args.micro_batch, bool) or args.micro_batch < 1:
        raise PlanError(f"--micro-batch={args.micro_batch} must be a positive integer")
    if args.max_seq_len:
        if args.devices is None:
            raise PlanError("--max-seq-len needs --devices (the devices to fill)")
        if args.seq_len is not None:
            raise PlanError("--max-seq-len finds the length itself; drop --seq-len")
        if args.global_batch is not None:
            raise PlanError("--max-seq-len plans one sequence per optimizer step; drop --global-batch")
        if args.layout or args.timeline or args.documents or getattr(args, "check_groups", False):
            raise PlanError("--layout, --timeline, --documents and --check-groups take --seq-len, not --max-seq-len")
        return
    if args.seq_len is None or args.devices is None:
        raise PlanError("--seq-len and --devices are required to plan (or --max-seq-len, --calibrate, --validate)")


def _max_seq_len(args: argparse.Namespace, cluster, model) -> None:
    from loongtrain.planner.maxlen import max_seq_len
    from loongtrain.planner.report import max_seq_len_json, max_seq_len_text

    answers = [max_seq_len(cluster, model, devices, args.micro_batch) for devices in args.devices]
    if args.json:
        out = [max_seq_len_json(a, args.model) for a in answers]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=1))
        return
    print("\n\n".join(max_seq_len_text(a, args.model) for a in answers))
    if any(model.windows):
        for answer in answers:
            print(_beside_every_layer_full(cluster, model, answer, args.micro_batch))


def _beside_every_layer_full(cluster, model, answer, micro_batch: int) -> str:
    """The same model with every layer full at the longest length's best layout, and its own longest."""
    from loongtrain.planner.estimate import estimate
    from loongtrain.planner.maxlen import max_seq_len

    full = dataclasses.replace(model, layer_kinds=(), sliding_window=0)
    kinds = sorted({k.name for k in model.kinds})
    best = mine = answer.result.best  # the longest length's search already estimated its best layout
    theirs = estimate(cluster, dataclasses.replace(answer.result.workload, model=full), best.candidate)
    longest = max_seq_len(cluster, full, answer.result.devices, micro_batch).seq_len
    return (
        f"layer kinds {kinds} vs every layer full, {answer.result.devices} devices: longest {answer.seq_len} vs "
        f"{longest} tokens; at {answer.seq_len} tokens on {best.candidate.label()} {mine.step_s:.3g} s vs "
        f"{theirs.step_s:.3g} s per step (attention ring {mine.ring_s:.3g} vs {theirs.ring_s:.3g} s, compute "
        f"{mine.compute_s:.3g} vs {theirs.compute_s:.3g} s): the sliding layers save "
        f"{1 - mine.step_s / theirs.step_s:.0%}"
    )


def _plan(args: argparse.Namespace, check_groups: GroupCheck | None, per_batch: PerBatchPrediction | None) -> None:
    from loongtrain.planner.estimate import estimate
    from loongtrain.planner.report import (
        json_report,
        layout_dict,
        layout_lines,
        precision_rows,
        precision_text,
        text_report,
    )
    from loongtrain.planner.search import check_candidate, search_layouts
    from loongtrain.planner.specs import cluster_spec, model_spec

    _check_request(args)
    cluster = cluster_spec(args.cluster or "a100")
    model = model_spec(args.model)
    if getattr(args, "float8", "") and cluster.fp8_matmul_tflops <= 0:
        raise PlanError(
            f"--float8: cluster {cluster.name!r} has no FP8 matmul units (fp8_matmul_tflops=0; A100 and older), where "
            f"float8 only runs emulated; plan without --float8, or set fp8_matmul_tflops in a cluster file"
        )
    if args.max_seq_len:
        _max_seq_len(args, cluster, model)
        return
    if len(args.seq_len) > 1 or len(args.devices) > 1:
        _sweep(args, cluster, model)
        return
    devices = args.devices[0]
    workload = _workload(args, model, args.seq_len[0])
    candidate = None
    if args.layout:  # a bad --layout is refused before the search runs
        candidate = parse_candidate(args.layout, devices)
        check_candidate(workload, candidate, devices, cluster)
    if getattr(args, "check_groups", False) and check_groups is None:
        raise PlanError("--check-groups builds process groups: run it through `loongtrain plan`")
    result = search_layouts(cluster, workload, devices)
    chosen = estimate(cluster, workload, candidate) if candidate is not None else None
    target = chosen if chosen is not None else result.best
    extra: dict = {}
    if args.timeline:
        extra["timeline"] = _timeline(cluster, workload, target.candidate, args.timeline)
    if getattr(args, "check_groups", False):
        extra["group_check"] = check_groups(target.candidate, cluster.devices_per_node)
    if args.documents:
        if per_batch is None:
            raise PlanError("--documents prices layouts with the attention's code: run it through `loongtrain plan`")
        extra.update(per_batch(args, cluster, workload, target.candidate))
    if getattr(args, "float8", ""):
        bf16 = estimate(cluster, dataclasses.replace(workload, float8="", float8_all_gather=False), target.candidate)
        extra["precision"] = precision_rows(bf16, estimate(cluster, workload, target.candidate), args.float8)
    if args.json:
        extra.pop("per_batch_text", None)
        out = json_report(result, args.model, args.top)
        if chosen is not None:
            out["layout"] = layout_dict(result, chosen)
        print(json.dumps({**out, **extra}, indent=1))
        return
    print(text_report(result, args.model, args.top))
    if "precision" in extra:
        print("\n" + precision_text(extra["precision"]))
    if chosen is not None:
        print("\n" + "\n".join(layout_lines(result, chosen)))
    if "per_batch" in extra:
        print("\n" + extra["per_batch_text"])
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


def run(
    args: argparse.Namespace, check_groups: GroupCheck | None = None, per_batch: PerBatchPrediction | None = None
) -> None:
    """Plan as ``args`` ask (a table, a sweep, a layout, a timeline, the longest sequence);
    ``check_groups`` builds the chosen layout's groups for ``--check-groups``, ``per_batch``
    predicts ``--documents``."""
    _plan(args, check_groups, per_batch)
