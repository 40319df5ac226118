"""``loongtrain bench train --peer transformers`` and ``--profile DIR``: training steps on one
device, loongtrain beside transformers, in one process and one run.

For each length, the rows are

- ``loongtrain <mode>``: the trainer's step (:func:`~loongtrain.tools.gpucheck.train.measure_training_step`:
  the model built by ``parallelize`` on a one-rank group, FSDP2's mixed precision, the
  config's ``[memory]`` options with each ``--checkpoint`` mode);
- with ``--peer transformers``, ``transformers ckpt`` and ``transformers no ckpt``: the same
  shape as a transformers model (``attn_implementation="sdpa"``) with the same initial weights
  (loongtrain's, mapped as the export maps them), float32 weights under ``torch.autocast`` of
  the same dtype, transformers' causal-LM loss on the same tokens, its activation
  checkpointing on and off, AdamW with the config's ``[optim]`` values (fused on CUDA) and
  ``clip_grad_norm_`` with the same clip.

The rows of a length run in this order: loongtrain's first ``--checkpoint`` mode, transformers
with and without checkpointing, then loongtrain's other modes (the comparison the run exists for
first, so that a budget cuts the extras).

Each row: median step time over ``--steps`` after a warm-up step, tokens/s, MFU (loongtrain's
:meth:`ModelConfig.flops_per_token` over the same peak for every row), peak memory, every
step's loss, its estimated and its wall seconds (loongtrain rows also the planner's prediction);
loongtrain rows add their tokens/s over each transformers row's (same run). A row that fails (out
of memory) is a row with its error; the next row starts from freed memory.

``--jsonl FILE``: each row as one JSON line the moment it is measured (after a first line with the
environment), so a run killed by a timeout keeps every finished row. ``--budget-s``: a row starts
only where its estimate (the planner's step times a measured factor, plus the build:
:func:`~loongtrain.tools.gpucheck.train.row_seconds`) ends inside the budget; else it is a skipped
row saying so.

``--profile DIR``: one more step of each row under ``torch.profiler`` (CPU, and CUDA on a
GPU), its Chrome trace in ``DIR/<length>-<row>.json`` and the top kernels by time and by calls
(:mod:`loongtrain.tools.bench.kernel_table`) printed and written to ``DIR/top_kernels.txt`` (a
row's table the moment it is measured) and ``DIR/top_kernels.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from loongtrain.apply import MemoryOptions
from loongtrain.config import ConfigError, OptimSection, load_config
from loongtrain.hf.families import hf_config_dict, require_transformers
from loongtrain.hf.folder import HFFormatError
from loongtrain.hf.weights import to_hf_tensors
from loongtrain.launch import launch, resolve_device, under_torchrun
from loongtrain.model import ModelConfig, build_model, init_value
from loongtrain.options import ACTIVATION_CHECKPOINT_CHOICES
from loongtrain.tools.bench.kernel_table import KernelTable, format_kernel_table, kernel_table, profiler_records
from loongtrain.tools.gpucheck.train import (
    PEER_STEP_FACTOR,
    Peak,
    TrainCase,
    auto_budget_bytes,
    measure_training_step,
    one_rank_state,
    planner_cluster,
    predict_step,
    random_tokens,
    resolve_auto_case,
    row_seconds,
    stated_peak,
    timed_steps,
)
from loongtrain.tools.harness import release_memory, sync
from loongtrain.train.model_setup import model_config_for
from loongtrain.train.spec import build_optimizer
from loongtrain.train.trainer import clip_grad_norm

PEERS = ("transformers",)
#: ``--model`` names: the GPU check's training model on this device (the ~1.1B Llama on CUDA, the
#: debug Llama on CPU, with that profile's auto budget); the config's ``[model]`` when not given
MODELS = ("gpu-check",)
STEPS = 3  # timed steps per row unless --steps says otherwise
WARMUP = 1
MATMUL_N = {"cuda": 8192, "cpu": 512}  # size of the measured matmul when the device's peak is not known
HF_CKPT, HF_NO_CKPT = "transformers ckpt", "transformers no ckpt"


@dataclass(frozen=True)
class PeerPlan:
    """What one ``bench train --peer/--profile`` run measures."""

    model: ModelConfig
    model_name: str
    lengths: tuple[int, ...]
    checkpoints: tuple[str, ...]  # loongtrain's activation checkpoint modes, one row each
    memory: MemoryOptions  # the config's [memory]; each row replaces activation_checkpoint
    optim: OptimSection
    device: str  # "cpu" or "cuda"
    dtype: str  # compute dtype: "bfloat16" or "float32"
    steps: int
    warmup: int
    peer: str | None  # None: loongtrain rows only (--profile alone)
    profile_dir: Path | None = None
    profile_top: int = 15
    peak_tflops: float | None = None  # None: the GPU's spec sheet, else a measured matmul
    auto_budget_gib: float = 0.0  # the auto row's memory.device_memory_gib (0: 90% of the GPU's)
    jsonl: Path | None = None  # each row as a JSON line the moment it is measured
    budget_s: float = 0.0  # rows whose estimate ends past this are skipped (0: no budget)


@dataclass
class PeerResult:
    """The rows, the environment they ran in, and each profiled row's kernel table."""

    rows: list[dict]
    environment: dict
    profiles: list[dict]


def _say(message: str) -> None:
    print(f"[bench train] {message}", file=sys.stderr, flush=True)


def hf_model(cfg: ModelConfig, device: torch.device, max_positions: int, seed: int = 0) -> torch.nn.Module:
    """``cfg``'s shape as a transformers causal LM on ``device`` (float32, SDPA attention) holding
    the initial weights loongtrain's ``materialize(model, device, seed)`` gives its own model."""
    transformers = require_transformers()
    hf_cfg = transformers.AutoConfig.for_model(**hf_config_dict(cfg, None, "float32", max_positions))
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=torch.float32)
    ours = {name: init_value(cfg, name, p.shape, seed, device) for name, p in build_model(cfg).named_parameters()}
    missing, unexpected = model.load_state_dict(to_hf_tensors(cfg, ours), strict=False)
    tied = {"lm_head.weight"} if cfg.tie_embeddings else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"transformers model and loongtrain weights differ: missing {missing}, extra {unexpected}")
    return model


def _enable_checkpointing(model: torch.nn.Module) -> None:
    """transformers' activation checkpointing of every layer (non-reentrant)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def measure_hf_step(
    cfg: ModelConfig,
    seq: int,
    checkpointing: bool,
    dtype: torch.dtype,
    device: torch.device,
    steps: int,
    warmup: int,
    peak: Peak,
    optim: OptimSection,
    profile_step: Callable[[Callable[[], float]], object] | None = None,
) -> dict:
    """transformers' training step on ``cfg``'s shape with loongtrain's initial weights and tokens
    (seed 0): the keys of :func:`~loongtrain.tools.gpucheck.train.measure_training_step`'s result.
    ``profile_step``: called after the timed steps with a function that runs one more step."""
    model = hf_model(cfg, device, max(cfg.max_positions, seq))
    model.train()
    if checkpointing:
        _enable_checkpointing(model)
    o = optim
    optimizer = build_optimizer(model.parameters(), o)  # the trainer's AdamW: fused on a GPU
    data = random_tokens(cfg, seq, device)
    tokens, labels = data[:, :-1], data[:, 1:]
    autocast = dtype != torch.float32
    losses: list[float] = []

    def step() -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            logits = model(input_ids=tokens, use_cache=False).logits
            # transformers' causal-LM loss with the targets given (every position predicts one)
            loss = model.loss_function(logits=logits, labels=None, vocab_size=cfg.vocab_size, shift_labels=labels)
        del logits
        loss.backward()
        clip_grad_norm(model, o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        sync(device)
        return time.perf_counter() - t0

    return timed_steps(step, steps, warmup, device, seq, cfg.flops_per_token(seq), peak, losses, profile_step)


def _slug(text: str) -> str:
    """``loongtrain sc++`` -> ``loongtrain-scpp``: a file name or key."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower().replace("+", "p")).strip("-")


def _profiler(device: torch.device, path: Path, top: int, found: list) -> Callable[[Callable[[], float]], None]:
    """A ``profile_step``: runs the step under ``torch.profiler``, writes its Chrome trace to
    ``path`` and appends the step's kernel table to ``found``."""
    from torch.profiler import ProfilerActivity, profile

    def run(step: Callable[[], float]) -> None:
        cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            step()
        prof.export_chrome_trace(str(path))
        found.append(kernel_table(profiler_records(prof, device_kernels=cuda), top))

    return run


def _error(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:200]


class _Lines:
    """``path`` written one flushed JSON line at a time (nothing without a path)."""

    def __init__(self, path: Path | None) -> None:
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "w")  # noqa: SIM115 - written line by line for the whole run

    def write(self, obj: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(obj, default=str) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _work(plan: PeerPlan, seq: int, dtype: torch.dtype, device: torch.device, state, peak: Peak, cluster) -> list:
    """A length's rows in their order: ``(who, checkpoint, estimate s, planner's prediction, measure)``."""
    profiled = 1 if plan.profile_dir is not None else 0
    steps = plan.warmup + plan.steps + profiled
    ours = []
    for mode in plan.checkpoints:
        case = TrainCase(seq, mode, memory=dataclasses.replace(plan.memory, activation_checkpoint=mode))
        if mode == "auto":  # the planner's policy for this length and device, as the trainer resolves it
            budget_bytes = auto_budget_bytes(device, plan.auto_budget_gib)
            case, _ = resolve_auto_case(case, plan.model, dtype, budget_bytes, device.type == "cuda")
        measure = functools.partial(measure_training_step, state, plan.model, case, dtype, device, plan.steps,
                                    plan.warmup, peak, optim=plan.optim)  # fmt: skip
        pred = predict_step(cluster, plan.model, case, dtype) if cluster is not None else None
        estimate = row_seconds(cluster, plan.model, case, dtype, steps) if plan.budget_s else 0.0
        who = f"loongtrain {mode}" + (f" ({case.policy})" if case.policy else "")
        ours.append((who, mode, estimate, pred, measure))
    theirs = []
    if plan.peer == "transformers":
        for who, on in ((HF_CKPT, True), (HF_NO_CKPT, False)):
            measure = functools.partial(measure_hf_step, plan.model, seq, on, dtype, device, plan.steps,
                                        plan.warmup, peak, plan.optim)  # fmt: skip
            # loongtrain's plan with the same checkpointing: its step and (a lower bound of) transformers' peak
            same = TrainCase(seq, "full" if on else "none")
            pred = predict_step(cluster, plan.model, same, dtype) if cluster is not None else None
            estimate = row_seconds(cluster, plan.model, same, dtype, steps, PEER_STEP_FACTOR) if plan.budget_s else 0.0
            theirs.append((who, same.checkpoint, estimate, pred, measure))
    return ours[:1] + theirs + ours[1:]


def _skip_reason(budget, estimate: float, pred: dict | None, device: torch.device, transformers: bool) -> str | None:
    """Why a row does not start: its estimate ends past the budget, or (on a GPU) the planner's peak
    for it (for transformers, of loongtrain with its checkpointing: less than theirs) exceeds the
    device's memory."""
    if budget.exhausted(estimate):
        left = max(0.0, budget.seconds - budget.elapsed())
        return f"estimated {estimate:.0f} s, {left:.0f} s of the time budget of {budget.seconds:.0f} s left"
    if device.type == "cuda" and transformers and pred is not None:
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        if pred["memory_gib"] > total:
            return f"does not fit: the planner's peak for loongtrain so checkpointed is {pred['memory_gib']:.0f} GiB"
    return None


def _rows_on_one_rank(device: torch.device, plan: PeerPlan, result: PeerResult) -> None:
    """Body run in a one-rank process group (``launch`` with ``nproc=1``): fills ``result``, each row
    written to ``plan.jsonl`` (and its kernel table to ``top_kernels.txt``) as it finishes."""
    from loongtrain.tools.gpucheck.check import Budget

    budget = Budget(plan.budget_s)
    state = one_rank_state()
    dtype = getattr(torch, plan.dtype)
    peak = stated_peak(device, dtype, plan.peak_tflops, MATMUL_N.get(device.type, 512))
    cluster, planner_note = planner_cluster(device, None)
    result.environment.update(
        device=str(device), gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        torch=torch.__version__, dtype=plan.dtype, peak_tflops=peak.tflops, peak_source=peak.source,
        model=plan.model_name, model_shape=dataclasses.asdict(plan.model), params=plan.model.num_params(),
        steps=plan.steps, warmup=plan.warmup, optim=dataclasses.asdict(plan.optim), planner_cluster=planner_note,
        budget_s=plan.budget_s,
    )  # fmt: skip
    if plan.peer == "transformers":
        import transformers

        result.environment["transformers"] = transformers.__version__
    lines = _Lines(plan.jsonl)
    lines.write({"environment": result.environment})
    tables_path = plan.profile_dir / "top_kernels.txt" if plan.profile_dir is not None else None
    try:
        for seq in plan.lengths:
            for who, checkpoint, estimate, pred, measure in _work(plan, seq, dtype, device, state, peak, cluster):
                row: dict = {"length": seq, "who": who, "checkpoint": checkpoint, "error": None,
                             "estimate_s": estimate}  # fmt: skip
                if who.startswith("loongtrain"):
                    row["planner"] = pred
                why = _skip_reason(budget, estimate, pred, device, not who.startswith("loongtrain"))
                profiled = len(result.profiles)
                if why is not None:
                    row["skipped"] = why
                    _say(f"{who} at {seq} tokens: skipped ({why})")
                else:
                    t0 = time.perf_counter()
                    _measure_row(row, measure, plan, device, seq, who, result)
                    row["wall_s"] = time.perf_counter() - t0
                result.rows.append(row)
                lines.write({"row": row, "t_s": round(budget.elapsed(), 1)})
                if tables_path is not None and len(result.profiles) > profiled:
                    with open(tables_path, "a") as f:
                        f.write(("\n\n" if profiled else "") + _table_text(result.profiles[-1]))
    finally:
        lines.close()
    add_ratios(result.rows)


def _measure_row(row: dict, measure, plan: PeerPlan, device: torch.device, seq: int, who: str, result) -> None:
    """Measure one row into ``row`` (its error where it fails), profiled where ``plan`` says."""
    _say(f"{who} at {seq} tokens ...")
    tables: list[KernelTable] = []
    profile_step, trace = None, None
    if plan.profile_dir is not None:
        trace = plan.profile_dir / f"{seq}-{_slug(who)}.json"
        profile_step = _profiler(device, trace, plan.profile_top, tables)
    try:
        row.update(measure(profile_step=profile_step))
    except Exception as exc:  # noqa: BLE001 - a failed row (out of memory included) is reported
        row["error"] = _error(exc)
        _say(f"{who} at {seq} tokens: {row['error']}")
    finally:
        release_memory(device)
    if tables:
        result.profiles.append({"length": seq, "who": who, "trace": str(trace), "table": tables[0]})


def _table_text(profile: dict) -> str:
    """A profiled row's kernel table as text, titled with the row and its trace."""
    title = f"{profile['who']} at {profile['length']} tokens (trace {profile['trace']})"
    return format_kernel_table(profile["table"], title)


def add_ratios(rows: list[dict]) -> None:
    """Give each loongtrain row its tokens/s over each transformers row's of the same length
    (``vs_<row>``; None where either failed)."""
    for row in rows:
        if not row["who"].startswith("loongtrain"):
            continue
        for peer in rows:
            if peer["length"] == row["length"] and peer["who"].startswith("transformers"):
                ok = row.get("tokens_per_s") and peer.get("tokens_per_s")
                row[f"vs_{_slug(peer['who']).replace('-', '_')}"] = (
                    row["tokens_per_s"] / peer["tokens_per_s"] if ok else None
                )


def run_peer(plan: PeerPlan) -> PeerResult:
    """Measure ``plan``'s rows in a one-rank process group in this process."""
    if plan.profile_dir is not None:
        plan.profile_dir.mkdir(parents=True, exist_ok=True)
        (plan.profile_dir / "top_kernels.txt").write_text("")  # each profiled row's table goes here as it ends
    result = PeerResult(rows=[], environment={}, profiles=[])
    launch(_rows_on_one_rank, 1, plan, result, device=plan.device)
    return result


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_rows(rows: list[dict]) -> str:
    """The rows as a fixed-width table (a failed row shows its error, a skipped one why)."""
    peers = [HF_CKPT, HF_NO_CKPT] if any(r["who"].startswith("transformers") for r in rows) else []
    keys = [f"vs_{_slug(p).replace('-', '_')}" for p in peers]
    head = f"{'length':>8s} {'who':20s} {'step s':>8s} {'tok/s':>9s} {'MFU':>6s} {'peak GiB':>8s} {'loss 1':>7s}"
    head += "".join(f" {'vs ' + p.removeprefix('transformers '):>11s}" for p in peers)
    lines = [head]
    for r in rows:
        line = f"{r['length']:8d} {r['who']:20s} "
        if r.get("skipped"):
            lines.append(line + f"skipped: {r['skipped']}")
            continue
        if r["error"] is not None:
            lines.append(line + f"failed: {r['error']}")
            continue
        line += (
            f"{r['step_s']:8.3f} {r['tokens_per_s']:9.0f} {_num(r['mfu'], '6.1%')} {r['peak_memory_gib']:8.2f} "
            f"{r['losses'][0]:7.4f}"
        )
        line += "".join(f" {_num(r.get(k), '10.2f') + ('x' if r.get(k) else ''):>11s}" for k in keys)
        lines.append(line.rstrip())
    return "\n".join(lines)


def _header(plan: PeerPlan, env: dict) -> str:
    where = env.get("gpu") or env["device"]
    ratio = "; loongtrain tokens/s over each transformers row's, same run" if plan.peer else ""
    return (
        f"one {where}, {plan.dtype}, {plan.model_name} ({env['params'] / 1e6:.1f}M parameters); median of "
        f"{plan.steps} steps after {plan.warmup} warm-up; MFU over {env['peak_tflops']:.4g} TFLOP/s "
        f"({env['peak_source']}){ratio}"
    )


def plan_from_args(args: argparse.Namespace) -> PeerPlan:
    """The plan of ``bench train --peer/--profile``; a SystemExit naming the bad value otherwise."""
    if args.peer is not None and args.peer not in PEERS:
        raise SystemExit(f"bench train: unknown --peer {args.peer!r}; choose one of {list(PEERS)}")
    bad = [n for n in args.lengths if n < 1]
    if bad:
        raise SystemExit(f"bench train: --lengths must be positive token counts, got {bad}")
    if args.steps < 0:
        raise SystemExit(f"bench train: --steps={args.steps} must be 0 (the default count) or more")
    if args.profile_top < 1:
        raise SystemExit(f"bench train: --profile-top={args.profile_top} must be at least 1")
    unknown = [m for m in args.checkpoint or () if m not in ACTIVATION_CHECKPOINT_CHOICES]
    if unknown:
        raise SystemExit(f"bench train: --checkpoint {unknown}: name modes of {list(ACTIVATION_CHECKPOINT_CHOICES)}")
    if args.model is not None and args.model not in MODELS:
        raise SystemExit(f"bench train: unknown --model {args.model!r}; choose one of {list(MODELS)}")
    if under_torchrun():
        raise SystemExit("bench train: --peer/--profile run on one device in one process; run them without torchrun")
    if args.budget_s < 0:
        raise SystemExit(f"bench train: --budget-s={args.budget_s} must be 0 (no budget) or more")
    try:
        cfg = load_config(args.config)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device cuda but no CUDA device is visible (torch {torch.__version__}); use cpu")
        device = resolve_device(args.device, 1)
        auto_gib = cfg.memory.device_memory_gib
        if args.model == "gpu-check":  # the GPU check's training model on this device, with its auto budget
            from loongtrain.tools.gpucheck.check import PROFILES

            profile = PROFILES["cuda" if device == "cuda" else "cpu"]
            model, name = profile.train_model, f"the GPU check's {profile.train_model_name}"
            auto_gib = auto_gib or profile.auto_budget_gib
        else:
            model, name = model_config_for(cfg.model), f"{Path(args.config).name}'s model"
    except (ConfigError, HFFormatError, ValueError) as e:
        raise SystemExit(f"bench train: {e}") from None
    if args.peer == "transformers":
        try:
            require_transformers()
        except HFFormatError as e:
            raise SystemExit(f"bench train: --peer transformers: {e}") from None
    dtype = args.dtype if args.dtype != "auto" else "bfloat16" if device == "cuda" else "float32"
    memory = cfg.memory.options()
    checkpoints = tuple(args.checkpoint or (memory.activation_checkpoint,))
    if "auto" in checkpoints and device != "cuda" and not auto_gib:
        raise SystemExit(
            f"bench train: --checkpoint auto fills the device's memory, and on {device} there is none to read: set "
            f"memory.device_memory_gib in {args.config} or name full, sc++ or none"
        )
    memory = dataclasses.replace(memory, activation_checkpoint="none", device_memory_gib=0.0)  # each row sets its own
    return PeerPlan(
        model=model, model_name=name, lengths=tuple(args.lengths),
        checkpoints=checkpoints, memory=memory, optim=cfg.optim, auto_budget_gib=auto_gib,
        device=device, dtype=dtype, steps=args.steps or STEPS, warmup=WARMUP, peer=args.peer,
        profile_dir=Path(args.profile) if args.profile else None, profile_top=args.profile_top,
        peak_tflops=args.peak_tflops, jsonl=Path(args.jsonl) if args.jsonl else None, budget_s=args.budget_s,
    )  # fmt: skip


def main(args: argparse.Namespace) -> None:
    """``bench train --peer/--profile``: measure, print the table (and the kernel tables), write files."""
    plan = plan_from_args(args)
    result = run_peer(plan)
    print(_header(plan, result.environment))
    print(format_rows(result.rows), flush=True)
    if plan.profile_dir is not None:
        text = "\n\n".join(_table_text(p) for p in result.profiles)
        print(f"\ntop {plan.profile_top} kernels of one profiled step per row\n{text}")
        (plan.profile_dir / "top_kernels.txt").write_text(text + "\n")
        tables = [{**p, "table": p["table"].as_dict()} for p in result.profiles]
        (plan.profile_dir / "top_kernels.json").write_text(json.dumps(tables, indent=1) + "\n")
        print(f"wrote {len(result.profiles)} trace(s), top_kernels.txt and top_kernels.json to {plan.profile_dir}")
    if args.json:
        report = {"environment": result.environment, "rows": result.rows}
        Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
