"""``loongtrain bench eval``: the evaluation's forward against a training step, tokens/s per
device at the same sequence length and layout.

For each case (``main``: the main job's config; ``large``: the same layout with a dim-512,
8-layer model on 8K-token sequences, one per step) every rank builds the run as
``loongtrain train`` does (:func:`~loongtrain.train.build_run`, scratch folder), times
``--steps`` training steps, then builds the evaluation's model on the same process groups
(:func:`~loongtrain.eval.model.build_eval_model`: forward only, no activation
checkpointing, the run's compute dtype) and times ``--steps`` calls of
:func:`~loongtrain.eval.runner.score_batch` on a training microbatch's shape (its rows of
that length; no autograd, per-token results gathered). Figures: the median over the timed calls of the slowest rank.
Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from loongtrain.apply import materialize
from loongtrain.eval.model import build_eval_model
from loongtrain.eval.runner import score_batch
from loongtrain.tools.bench.train import CASES, MAIN_CONFIG, case_config, launch_cases
from loongtrain.tools.harness import sync
from loongtrain.train.preflight import preflight
from loongtrain.train.trainer import build_run, to_device, train_step

STEPS = {"main": 10, "large": 3}


def _slowest(seconds: float, device: torch.device) -> float:
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def _bench_rank(device: torch.device, args: argparse.Namespace, folder: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    if rank == 0:
        print(f"{world} processes on {device.type}; median over the timed calls, slowest rank", flush=True)
        print(f"{'case':6s} {'seq':>6s} {'train step s':>12s} {'train tok/s/dev':>15s} {'eval fwd s':>10s} "
              f"{'eval tok/s/dev':>14s} {'ratio':>6s}", flush=True)  # fmt: skip
    for case in args.cases:
        steps = args.steps or STEPS[case]
        cfg = case_config(case, "eager", args.config, folder / case)
        spec = preflight(cfg, world)
        run = build_run(device, cfg, spec)
        o = cfg.optim
        times = []
        for i in range(steps + 1):
            batch = to_device(run.loader.next(), device)
            dist.barrier()
            t0 = time.perf_counter()
            train_step(run.model, run.optimizer, run.state, batch, lr=o.lr, grad_clip=o.grad_clip)
            sync(device)
            if i:  # the first step warms up
                times.append(time.perf_counter() - t0)
        train_s = _slowest(statistics.median(times), device)
        seq, batch_rows, state = cfg.data.seq_len, cfg.data.global_batch, run.state
        del run  # the training model and optimizer; the eval model uses the same process groups
        model = build_eval_model(device, cfg, spec, state)
        materialize(model, device, seed=cfg.run.seed)
        eval_rows = batch_rows // (state.dp * cfg.data.micro_batches)  # a training microbatch's rows per replica
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, spec.model.vocab_size, (eval_rows, seq), generator=gen)
        times = []
        for i in range(steps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            score_batch(model, state, tokens, torch.roll(tokens, -1, dims=1))
            sync(device)
            if i:
                times.append(time.perf_counter() - t0)
        eval_s = _slowest(statistics.median(times), device)
        train_tps = batch_rows * seq / train_s / world
        eval_tps = eval_rows * state.dp * seq / eval_s / world
        if rank == 0:
            print(f"{case:6s} {seq:6d} {train_s:12.3f} {train_tps:15,.0f} {eval_s:10.3f} {eval_tps:14,.0f} "
                  f"{eval_tps / train_tps:6.2f}", flush=True)  # fmt: skip
            rows.append({
                "case": case, "world": world, "seq_len": seq, "train_rows_per_step": batch_rows,
                "train_step_s": train_s, "train_tokens_per_s_per_device": train_tps, "eval_rows": eval_rows,
                "eval_forward_s": eval_s,
                "eval_tokens_per_s_per_device": eval_tps, "ratio": eval_tps / train_tps, "steps": steps,
            })  # fmt: skip
        del model
        dist.barrier()
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json}")


def main(args: argparse.Namespace) -> None:
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        raise SystemExit(f"bench eval: unknown case {unknown}; cases {list(CASES)}")
    launch_cases("bench eval", [(case, "eager", case) for case in args.cases], _bench_rank, args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=4, help="processes to spawn (ignored under torchrun)")
    parser.add_argument(
        "--config", type=Path, default=MAIN_CONFIG, help="the main job's config (the cases start from it)"
    )
    parser.add_argument("--cases", nargs="+", default=list(CASES), help=f"cases to run, of {list(CASES)}")
    parser.add_argument("--steps", type=int, default=0, help=f"timed calls per case (0: {STEPS})")
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this file")
