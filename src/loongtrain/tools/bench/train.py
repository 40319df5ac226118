"""``loongtrain bench train``: the trainer's step, eager vs compiled vs the whole-shard loss,
and where its time goes.

For each case (``main``: the main job's config as it is; ``large``: the same layout with a
dim-512, 8-layer model on 8K-token sequences) and each mode (``whole-loss``: eager with
``memory.loss_chunk = 0``, the loss over all of a rank's tokens at once as before the
chunked loss; ``eager``: the defaults; ``compiled``: ``run.compile``; asked for by name,
``float8-<recipe>``: the blocks' linears in float8, emulated on a CPU), every
rank builds the run exactly as ``loongtrain train`` does (:func:`~loongtrain.train.build_run`
in a scratch folder, no checkpoints), warms up, times ``--steps`` calls of
:func:`~loongtrain.train.train_step`, then profiles one more step and splits its wall time
into attention kernels, communication wait, other compute and framework (Python, hooks,
autograd bookkeeping): see :mod:`loongtrain.tools.bench.step_profile`.

The figures are the median step over the timed steps (slowest rank), tokens/s per device,
and the breakdown averaged over ranks. Run it with nothing else on the machine.

``--peer transformers`` and ``--profile DIR`` run instead on one device in one process, at
``--lengths``: loongtrain beside transformers, and the top kernels of a profiled step; see
:mod:`loongtrain.tools.bench.peer`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from loongtrain.config import ConfigError, TrainConfig, load_config
from loongtrain.launch import launch
from loongtrain.options import FLOAT8_RECIPES
from loongtrain.tools.bench.step_profile import PARTS, breakdown, spans_of
from loongtrain.tools.harness import sync
from loongtrain.train.preflight import preflight
from loongtrain.train.trainer import Run, build_run, to_device, train_step

#: The main job's config (scripts/main.sh) and the overrides of the larger case.
MAIN_CONFIG = Path(__file__).resolve().parents[4] / "configs" / "debug_cpu.toml"
CASES: dict[str, list[str]] = {
    "main": [],
    "large": [
        "model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_dim=1408",
        "data.seq_len=8192", "data.global_batch=1",
    ],
}  # fmt: skip
#: mode -> its overrides; speed-ups are relative to the first mode run
MODES: dict[str, list[str]] = {
    "whole-loss": ["memory.loss_chunk=0"], "eager": [], "compiled": ["run.compile=true"],
    **{f"float8-{r}": ["float8.enabled=true", f"float8.recipe_name={r}"] for r in FLOAT8_RECIPES},
}  # fmt: skip
#: the modes run unless --modes names others (the float8 ones are asked for by name)
DEFAULT_MODES = ["whole-loss", "eager", "compiled"]
STEP_RANGE = "loongtrain::bench_step"
# the compiled blocks are built in the first step(s)
WARMUP = {"compiled": 3, **{mode: 2 for mode in MODES if mode != "compiled"}}
STEPS = {"main": 20, "large": 4}  # timed steps per case unless --steps says otherwise


def case_config(case: str, mode: str, config: Path, folder: Path, device: torch.device | None = None) -> TrainConfig:
    """The config of one case and mode: its overrides, no checkpoints, a scratch run folder.
    A float8 mode on a CPU emulates the float8 matmuls (CPUs have no FP8 units; without
    ``emulate`` torch's reference ``_scaled_mm`` runs, about 100x slower)."""
    cpu = device is not None and device.type == "cpu"
    emulate = ["float8.emulate=true"] if cpu and mode.startswith("float8") else []
    overrides = [
        *CASES[case], *MODES[mode], *emulate, f"run.output_dir={folder}",
        "checkpoint.every=0", "checkpoint.save_final=false", "checkpoint.resume=false", "run.progress=off",
    ]  # fmt: skip
    return load_config(config, overrides)


def _step(run: Run, batch: list) -> None:
    """One optimizer step on ``batch`` (on the device), finished on the device."""
    o = run.cfg.optim
    train_step(run.model, run.optimizer, run.state, batch, lr=o.lr, grad_clip=o.grad_clip)
    sync(run.device)


def _timed_steps(run: Run, count: int) -> list[float]:
    times = []
    for _ in range(count):
        batch = to_device(run.loader.next(), run.device)
        dist.barrier()
        t0 = time.perf_counter()
        _step(run, batch)
        times.append(time.perf_counter() - t0)
    return times


def _profiled_step(run: Run) -> dict[str, float]:
    batch = to_device(run.loader.next(), run.device)
    cuda = run.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    dist.barrier()
    with profile(activities=activities) as prof:
        with record_function(STEP_RANGE):
            _step(run, batch)
    spans, start, end = spans_of(prof.events(), STEP_RANGE, device_kernels=cuda)
    return {"wall_s": end - start, **breakdown(spans, start, end)}


def _bench_rank(device: torch.device, args: argparse.Namespace, folder: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows, width = [], max(10, *(len(m) for m in args.modes))
    if rank == 0:
        counts = ", ".join(f"{case} {args.steps or STEPS[case]}" for case in args.cases)
        print(f"{world} processes on {device.type}; median step of the slowest rank over {counts} steps after warm-up")
        head = f"{'case':6s} {'mode':{width}s} {'step s':>7s} {'tok/s/dev':>9s} {'speedup':>7s}  breakdown of one step"
        print(head, flush=True)
    for case in args.cases:
        first_s = None
        for mode in args.modes:
            cfg = case_config(case, mode, args.config, folder / f"{case}-{mode}", device)
            spec = preflight(cfg, world)
            run = build_run(device, cfg, spec)
            t_first = time.perf_counter()
            _timed_steps(run, WARMUP[mode])
            warmup_s = time.perf_counter() - t_first
            step_s = statistics.median(_timed_steps(run, args.steps or STEPS[case]))
            parts = _profiled_step(run)
            slowest = torch.tensor([step_s], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            gathered: list = [None] * world
            dist.all_gather_object(gathered, parts)
            if rank == 0:
                step_s = slowest.item()
                tokens = cfg.data.global_batch * cfg.data.seq_len
                mean = {k: statistics.fmean(g[k] for g in gathered) for k in ("wall_s", *PARTS)}
                share = {k: mean[k] / mean["wall_s"] for k in PARTS}
                first_s = first_s or step_s
                speedup = first_s / step_s
                text = "  ".join(f"{k} {share[k]:5.1%}" for k in PARTS)
                print(
                    f"{case:6s} {mode:{width}s} {step_s:7.3f} {tokens / step_s / world:9.0f} {speedup:7.2f}  {text} "
                    f"(profiled step {mean['wall_s']:.3f} s; warm-up {warmup_s:.1f} s)",
                    flush=True,
                )
                rows.append({
                    "case": case, "mode": mode, "world": world, "tokens_per_step": tokens, "step_s": step_s,
                    "tokens_per_s_per_device": tokens / step_s / world, f"speedup_vs_{args.modes[0]}": speedup,
                    "warmup_s": warmup_s, "profiled_step_s": mean["wall_s"], "share": share,
                    "per_rank": gathered,
                })  # fmt: skip
            del run
            dist.barrier()
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json}")


def main(args: argparse.Namespace) -> None:
    if args.peer is not None or args.profile is not None:  # one device, one process
        from loongtrain.tools.bench import peer

        peer.main(args)
        return
    unknown = [c for c in args.cases if c not in CASES] + [m for m in args.modes if m not in MODES]
    if unknown:
        raise SystemExit(f"bench train: unknown case or mode {unknown}; cases {list(CASES)}, modes {list(MODES)}")
    runs = [(case, mode, f"{case}-{mode}") for case in args.cases for mode in args.modes]
    launch_cases("bench train", runs, _bench_rank, args)


def launch_cases(command: str, runs: list[tuple[str, str, str]], rank_fn, args: argparse.Namespace) -> None:
    """Write each ``(case, mode, name)``'s config into ``<tmp>/<name>`` (a bad ``--config``
    fails here, in one line, before any process is spawned), run ``rank_fn(device, args,
    tmp)`` on ``args.nproc`` ranks, and remove the folder."""
    folder = Path(tempfile.mkdtemp(prefix=f"loongtrain-{command.replace(' ', '-')}-"))
    try:
        for case, mode, name in runs:
            case_config(case, mode, args.config, folder / name)
    except ConfigError as e:
        shutil.rmtree(folder, ignore_errors=True)
        raise SystemExit(f"{command}: {e}") from None
    try:
        launch(rank_fn, args.nproc, args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=4, help="processes to spawn (ignored under torchrun)")
    parser.add_argument(
        "--config", type=Path, default=MAIN_CONFIG, help="the main job's config (the cases start from it)"
    )
    parser.add_argument("--cases", nargs="+", default=list(CASES), help=f"cases to run, of {list(CASES)}")
    parser.add_argument(
        "--modes",
        nargs="+",
        default=DEFAULT_MODES,
        help=f"modes to run, of {list(MODES)} (default %(default)s; speed-ups vs the first)",
    )
    parser.add_argument(
        "--steps", type=int, default=0, help=f"timed steps per case and mode (0: {STEPS}; one device: 0 is 3)"
    )
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    one = parser.add_argument_group(
        "one device, one process (--peer and/or --profile; --cases, --modes and --nproc do not apply)"
    )
    one.add_argument(
        "--peer", default=None, metavar="NAME",
        help="also train the same model shape in this library, same weights, tokens, precision, AdamW and clip: "
        "transformers (SDPA, its checkpointing on and off)",
    )  # fmt: skip
    one.add_argument(
        "--profile", default=None, metavar="DIR",
        help="profile one more step of each row: a Chrome trace per row and top_kernels.txt/.json in DIR",
    )  # fmt: skip
    one.add_argument("--profile-top", type=int, default=15, help="kernels listed by time and by calls")
    one.add_argument(
        "--jsonl", default=None, metavar="FILE",
        help="each row as one JSON line the moment it is measured (a run killed by a timeout keeps them)",
    )  # fmt: skip
    one.add_argument(
        "--budget-s", type=float, default=0.0,
        help="skip the rows whose estimate (the planner's step x a measured factor + the build) ends past this "
        "many seconds (0: no budget)",
    )  # fmt: skip
    one.add_argument(
        "--lengths", type=int, nargs="+", default=[32768, 131072], help="tokens per sequence, rows each (%(default)s)"
    )
    one.add_argument(
        "--model", default=None,
        help="gpu-check: the GPU check's training model on this device (on CUDA its 1.1B Llama: dim 2048, 16 layers, "
        "16/4 heads; on CPU the debug Llama) and its auto budget; default: --config's [model]",
    )  # fmt: skip
    one.add_argument(
        "--checkpoint", nargs="+", default=None, metavar="MODE",
        help="loongtrain's activation checkpoint modes, a row each (default: --config's memory.activation_checkpoint)",
    )  # fmt: skip
    one.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: cuda if visible")
    one.add_argument(
        "--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
        help="compute dtype, fp32 weights (auto: bfloat16 on cuda, float32 on cpu)",
    )  # fmt: skip
    one.add_argument(
        "--peak-tflops", type=float, default=None,
        help="peak dense TFLOP/s for MFU (default: the GPU's spec sheet, else a measured matmul)",
    )  # fmt: skip
