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
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from loongtrain.config import TrainConfig
from loongtrain.eval.generated import GENERATED_TASKS, RECALL_TASKS
from loongtrain.eval.jobs import USER_ERRORS, resolve_target, run_job, world_sizes
from loongtrain.eval.model import Weights
from loongtrain.eval.plan import EvalPlan, make_plan
from loongtrain.train.cli import split_overrides

if TYPE_CHECKING:
    from loongtrain.train.spec import RunSpec

PREFIX = "loongtrain eval: "


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

    def run(self, device) -> dict:
        return evaluate_job(device, self)


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
        "--eval.depths 5 --eval.needles 4); loongtrain train --help-config lists them ([eval] included)."
    )
    parser.add_argument_group(
        "generated tasks (RULER's, answered by free generation beside the needle grid)",
        f"--eval.generated TASK[,TASK...] or --eval.generated all, TASK one of: {', '.join(GENERATED_TASKS)} "
        f"(a model trained on the recall task's token ids: {', '.join(RECALL_TASKS)}); "
        "--eval.generated_tokens: new tokens per answer",
    )


def prepare(args: argparse.Namespace, extra: list[str], world: int, local: int) -> Job:
    """Resolve and check everything (no process group); raises a user error in one line."""
    overrides = split_overrides(extra) + ([f"eval.tokens={args.tokens}"] if args.tokens else [])
    target = resolve_target(
        args.target, overrides, world, local, config=args.config, step=args.step, random_weights=args.random_weights
    )
    cfg, spec = target.cfg, target.spec
    plan = make_plan(cfg, spec.model, spec.parallel.hp, spec.parallel.cp, target.run_dir,
                     task="text" if target.hf else None)  # fmt: skip
    default_out = Path("runs") / "eval" / target.path.name if target.hf else target.path / "eval" / target.name
    return Job(cfg, spec, plan, target.weights, str(args.out or default_out), str(target.path))


def evaluate_job(device, job: Job) -> dict:
    """Collective: build, load and evaluate; rank 0 writes and prints. Returns the summary."""
    import torch.distributed as dist

    from loongtrain.eval.model import build_eval_model, load_eval_weights
    from loongtrain.eval.report import write_outputs
    from loongtrain.eval.runner import run_generated, run_loss_by_position, run_needles
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
    generated = run_generated(model, state, plan, progress=progress)
    tokens = sum(n for n, _, _ in plan.cells)
    meta = {
        "target": job.target, "weights": loaded, "layout": layout, "world": world, "plan": plan.describe(),
        "needle_seconds": needles.seconds, "needle_tokens": tokens,
        "tokens_per_s_per_device": tokens / needles.seconds / world if needles.seconds else None,
    }  # fmt: skip
    if rank == 0:
        title = f"{Path(job.target).name}: {loaded.split('/')[-1]}"
        paths = write_outputs(Path(job.out), needles, loss, meta, title, generated)
        print(needles.table(), flush=True)
        for report in generated:
            print(report.table(), flush=True)
        if loss is not None:
            print(loss.table(), flush=True)
        rate = f" ({meta['tokens_per_s_per_device']:,.0f} tokens/s per device)" if needles.seconds else ""
        written = ", ".join(paths.values())
        print(f"{tokens:,} needle tokens in {needles.seconds:.1f} s{rate}; wrote {written}", flush=True)
    return {"effective_context": needles.effective_context, "accuracy": needles.accuracy,
            **{f"generated_{r.task}": r.accuracy for r in generated}}  # fmt: skip


def main(args: argparse.Namespace, extra: list[str]) -> None:
    if args.debug:
        os.environ["LOONGTRAIN_DEBUG"] = "1"
    try:
        world, local = world_sizes(args.nproc)
        job = prepare(args, extra, world, local)
    except USER_ERRORS as e:
        say(str(e))
        raise SystemExit(2) from None
    raise SystemExit(run_job(job, world, PREFIX))
