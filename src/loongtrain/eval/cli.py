"""``loongtrain eval TARGET``: the long-context evaluation of a run's checkpoint or of a
Hugging Face folder, on the launcher and layouts of training.

TARGET is a run folder (its ``config.toml``; the newest intact checkpoint, or ``--step N``)
or a Hugging Face model folder (``config.json``: evaluated as ``[model] init_from``). Any
config key can be overridden as in training (``--parallel.hp 2``, ``--eval.lengths 1K,2K``,
``--model.rope_scaling yarn``). Everything is checked in the launching process first, so
bad input ends in one line before any worker starts; then every rank builds the model for
forward only, loads the model weights (no optimizer states), and runs the needle grid and
the loss by position. Rank 0 writes ``eval.json``, ``needles.png``/``.txt`` and
``loss_by_position.png``/``.txt`` into ``--out`` (default ``<run>/eval/step-N/``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loongtrain.config import ConfigError, TrainConfig, load_config
from loongtrain.data.tokens import TokenFileError
from loongtrain.eval.model import Weights, checkpoint_candidates
from loongtrain.eval.plan import EvalPlan, make_plan
from loongtrain.launch import check_device, single_process_env, under_torchrun
from loongtrain.train.checkpoint import CheckpointError
from loongtrain.train.cli import split_overrides

if TYPE_CHECKING:
    from loongtrain.train.spec import RunSpec

PREFIX = "loongtrain eval: "
USER_ERRORS = (ConfigError, TokenFileError, CheckpointError)


def say(message: str) -> None:
    print(PREFIX + message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Job:
    """Everything the workers need (picklable)."""

    cfg: TrainConfig
    spec: RunSpec
    plan: EvalPlan
    weights: Weights
    out: str
    target: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="a run folder (its checkpoints) or a Hugging Face model folder")
    parser.add_argument("--step", type=int, default=None, help="evaluate checkpoint step-N (default: newest intact)")
    parser.add_argument(
        "--random-weights", action="store_true", help="evaluate the run's random initial weights (a chance baseline)"
    )
    parser.add_argument("--tokens", default=None, help="token file of real text (sets eval.tokens)")
    parser.add_argument("--out", default=None, help="output folder (default <run>/eval/step-N or runs/eval/<name>)")
    parser.add_argument("--config", default=None, help="TOML config for a Hugging Face folder (a run has its own)")
    parser.add_argument("--nproc", type=int, default=1, help="processes (ignored under torchrun)")
    parser.add_argument("--debug", action="store_true", help="full tracebacks")
    parser.epilog = (
        "Config keys as in training: --section.key value (e.g. --parallel.hp 2 --eval.lengths 1K,2K,4K "
        "--eval.depths 5 --eval.needles 4); `loongtrain train --help-config` lists them ([eval] included)."
    )


def _spec(cfg: TrainConfig, world: int, local: int) -> RunSpec:
    """What ``preflight`` resolves for training, less what only training needs (data, run
    folder, optimizer, resume)."""
    from loongtrain.apply import check_model_fits
    from loongtrain.train.spec import model_spec

    try:
        spec = model_spec(cfg)
        spec.parallel.resolve_dp(world)
        check_model_fits(spec.model, spec.parallel.hp)
        check_device(cfg.run.device, local)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return spec


def prepare(args: argparse.Namespace, extra: list[str], world: int, local: int) -> Job:
    """Resolve and check everything (no process group); raises a user error in one line."""
    target = Path(args.target)
    overrides = split_overrides(extra) + ([f"eval.tokens={args.tokens}"] if args.tokens else [])
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {args.nproc}")
    if (target / "config.toml").is_file():
        if args.config:
            raise ConfigError(f"{target} is a run folder with its own config.toml; --config is for HF folders")
        cfg = load_config(target / "config.toml", overrides)
        hf, run_dir = False, target
    elif (target / "config.json").is_file():
        if args.step is not None:
            raise ConfigError(f"--step {args.step}: {target} is a Hugging Face folder, not a run with checkpoints")
        cfg = load_config(args.config, [*overrides, f"model.init_from={target}"])
        hf, run_dir = True, None
    else:
        raise ConfigError(
            f"{target} is neither a run folder (no config.toml) nor a Hugging Face model folder (no config.json)"
        )
    spec = _spec(cfg, world, local)
    plan = make_plan(cfg, spec.model, spec.parallel.hp, spec.parallel.cp, run_dir, task="text" if hf else None)
    if args.random_weights:
        weights, name = Weights("random", seed=cfg.run.seed), "random-init"
    elif hf:
        weights, name = Weights("hf", str(target)), target.name
    else:
        steps = checkpoint_candidates(target / "checkpoints", args.step, spec.model)
        weights, name = Weights("checkpoint", str(target / "checkpoints"), steps), f"step-{steps[0]}"
    default_out = Path("runs") / "eval" / target.name if hf else target / "eval" / name
    return Job(cfg, spec, plan, weights, str(args.out or default_out), str(target))


def evaluate_job(device, job: Job) -> dict:
    """Collective: build, load and evaluate; rank 0 writes and prints. Returns the summary."""
    import torch.distributed as dist

    from loongtrain.eval.model import build_eval_model, load_eval_weights
    from loongtrain.eval.report import write_outputs
    from loongtrain.eval.runner import run_loss_by_position, run_needles
    from loongtrain.parallel import init_parallel

    cfg, spec, plan = job.cfg, job.spec, job.plan
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    state = init_parallel(spec.parallel, device=device, zero_scopes=(cfg.parallel.zero,))
    model = build_eval_model(device, cfg, spec, state)
    loaded = load_eval_weights(model, device, job.weights, say=say if rank == 0 else lambda m: None)
    p = spec.parallel
    layout = (
        f"dp={state.dp} hp={p.hp} cp={p.cp} ring_window={p.ring_window} {p.placement} balance={p.balance}, "
        f"zero={cfg.parallel.zero}, compute {cfg.parallel.param_dtype}"
    )
    if rank == 0:
        print(
            f"loongtrain eval: {world} process(es) on {device.type}, layout {layout}\n"
            f"model {cfg.model.init_from or cfg.model.preset} ({spec.model.num_params() / 1e6:.2f}M parameters), "
            f"weights: {loaded} (loaded in {time.perf_counter() - t0:.1f} s)\n{plan.describe()}",
            flush=True,
        )
    last = [time.perf_counter()]

    def progress(done: int, total: int) -> None:
        if rank == 0 and (time.perf_counter() - last[0] > 30 or done == total):
            last[0] = time.perf_counter()
            print(f"  {done}/{total} sequences", flush=True)

    needles = run_needles(model, state, plan, progress=progress)
    loss = run_loss_by_position(model, state, plan, progress=progress)
    tokens = sum(n for n, _, _ in plan.cells)
    meta = {
        "target": job.target, "weights": loaded, "layout": layout, "world": world, "plan": plan.describe(),
        "needle_seconds": needles.seconds, "needle_tokens": tokens,
        "tokens_per_s_per_device": tokens / needles.seconds / world if needles.seconds else None,
    }  # fmt: skip
    if rank == 0:
        title = f"{Path(job.target).name}: {loaded.split('/')[-1]}"
        paths = write_outputs(Path(job.out), needles, loss, meta, title)
        print(needles.table(), flush=True)
        if loss is not None:
            print(loss.table(), flush=True)
        rate = f" ({meta['tokens_per_s_per_device']:,.0f} tokens/s per device)" if needles.seconds else ""
        written = ", ".join(paths.values())
        print(f"{tokens:,} needle tokens in {needles.seconds:.1f} s{rate}; wrote {written}", flush=True)
    return {"effective_context": needles.effective_context, "accuracy": needles.accuracy}


def eval_worker(job: Job) -> dict:
    """One rank of ``loongtrain eval`` (the elastic agent's entry, or the process itself)."""
    import torch.distributed as dist

    from loongtrain.launch import allow_ctrl_c, init_distributed
    from loongtrain.train.faults import ERROR, FATAL, WorkerReport, debug_enabled, exception_line, write_report

    allow_ctrl_c()
    rank = int(os.environ.get("RANK", "0"))
    try:
        device = init_distributed(timeout_s=max(600.0, job.cfg.run.timeout_s * 2), device=job.cfg.run.device)
        result = evaluate_job(device, job)
    except USER_ERRORS as e:
        if not write_report(WorkerReport(rank, FATAL, str(e))) and rank == 0:
            say(str(e))
        result = {"fatal": str(e)}
    except Exception as e:
        if debug_enabled():
            traceback.print_exc()
        if not write_report(WorkerReport(rank, ERROR, exception_line(e))):
            say(f"rank {rank} failed: {exception_line(e)}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


def _supervise(job: Job, nproc: int) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from loongtrain.launch import elastic_run
    from loongtrain.train.faults import REPORT_DIR_ENV, ProcessEnd, debug_enabled, read_reports, root_cause

    report_dir = tempfile.mkdtemp(prefix="loongtrain-eval-reports-")
    os.environ[REPORT_DIR_ENV] = report_dir
    try:
        results = elastic_run(eval_worker, job, nproc=nproc, quiet=not debug_enabled())
    except KeyboardInterrupt:
        say("interrupted; nothing was written")
        return 130
    except ChildFailedError as e:
        ends = [ProcessEnd(r, f.exitcode, f.signal_name() if f.exitcode < 0 else None) for r, f in e.failures.items()]
        say(root_cause(read_reports(Path(report_dir)), ends))
        return 1
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)
        os.environ.pop(REPORT_DIR_ENV, None)
    fatal = [r["fatal"] for r in results.values() if isinstance(r, dict) and "fatal" in r]
    if fatal:
        say(fatal[0])
        return 2
    return 0


def main(args: argparse.Namespace, extra: list[str]) -> None:
    if args.debug:
        os.environ["LOONGTRAIN_DEBUG"] = "1"
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    else:
        world = local = args.nproc
    try:
        job = prepare(args, extra, world, local)
    except USER_ERRORS as e:
        say(str(e))
        raise SystemExit(2) from None
    if under_torchrun():
        raise SystemExit(2 if "fatal" in eval_worker(job) else 0)
    if world == 1:  # in this process: no launcher start-up
        single_process_env()
        raise SystemExit(2 if "fatal" in eval_worker(job) else 0)
    raise SystemExit(_supervise(job, world))
