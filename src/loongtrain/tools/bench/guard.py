"""``loongtrain bench guard``: what the trainer's guard and a mixture's per-source numbers cost
a training step: host reads of tensor values (each one a device synchronisation on a GPU)
counted per step, and the step time, beside the same step without them.

Rows, on the main job's layout (``configs/debug_cpu.toml``: 4 processes, hp=2 x cp=2, sc++),
its ``debug`` model on packed token files (three synthetic sources written here):

- ``one file``: the step as ``train_step`` takes it with no guard, on one token file;
- ``one file, guarded``: the same with the trainer's guard (``[guard]``'s defaults: non-finite
  stop, spike warn): the decision reads only the loss and the gradient norm the step already
  brings to the host;
- ``mixture, guarded``: three sources, their losses, targets and tokens per source summed in
  the step's one all-reduce.

Then a checkpoint save of the guarded row, timed whole and its check that every weight and
AdamW state is finite (what the guard adds to a save; steps that do not save have none).

Host reads are counted in one extra step per row under a ``TorchFunctionMode`` that sees every
``item``, ``tolist``, ``float``/``int``/``bool`` of a tensor and ``numpy`` (on a GPU each reads
device memory; here they are counted alike). The step times are medians of ``--steps`` steps
per row, the rows interleaved step by step (so that the machine's drift falls on all of them),
slowest rank; beside them the guard's own Python per step (judging and recording). Run it with
nothing else on the machine.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from loongtrain.config import load_config
from loongtrain.data import write_tokens
from loongtrain.launch import launch
from loongtrain.options import GuardOptions
from loongtrain.tools.bench.train import MAIN_CONFIG
from loongtrain.tools.harness import sync
from loongtrain.train.guard import StepGuard, first_nonfinite_state
from loongtrain.train.preflight import preflight
from loongtrain.train.trainer import Run, build_run, source_names, to_device, train_step

#: what reads a tensor's value into Python (a device synchronisation when the tensor is on a GPU)
HOST_READS = frozenset({"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy"})
SOURCES = {"code": (0.3, 600), "books": (0.3, 900), "short": (0.4, 60)}  # weight, median document length


class HostReads(TorchFunctionMode):
    """Counts the host reads of tensor values made while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def write_sources(folder: Path, tokens: int = 400_000) -> dict[str, Path]:
    """Three token files of lognormal documents (ids below the debug model's vocabulary)."""
    out = {}
    for i, (name, (_, median)) in enumerate(SOURCES.items()):
        rng = np.random.default_rng(i)
        lengths = np.maximum(2, rng.lognormal(np.log(median), 1.0, 4 * tokens // median).astype(np.int64))
        ids = rng.integers(1, 250, int(lengths.sum()))
        ids[np.cumsum(lengths) - 1] = 255
        out[name] = folder / f"{name}.tok"
        write_tokens(out[name], ids, vocab_size=256, eos=255)
    return out


def row_overrides(row: str, files: dict[str, Path], folder: Path) -> list[str]:
    common = [
        f"run.output_dir={folder / row.replace(' ', '-').replace(',', '')}", "checkpoint.every=0", "checkpoint.keep=1",
        "checkpoint.save_final=false", "checkpoint.resume=false", "run.progress=off", "run.tensorboard=false",
        "data.source=tokens", "data.pack=true",
    ]  # fmt: skip
    if row.startswith("mixture"):
        return common + [f"data.sources.{n}.{k}={v}" for n, p in files.items()
                         for k, v in (("path", p), ("weight", SOURCES[n][0]))]  # fmt: skip
    return [*common, f"data.path={files['code']}"]


ROWS = ("one file", "one file, guarded", "mixture, guarded")


def _step(run: Run, guard: StepGuard | None) -> float:
    o = run.cfg.optim
    batch = to_device(run.loader.next(), run.device)
    dist.barrier()
    t0 = time.perf_counter()
    out = train_step(run.model, run.optimizer, run.state, batch, lr=o.lr, grad_clip=o.grad_clip, guard=guard,
                     source_names=source_names(run.loader.source))  # fmt: skip
    if guard is not None:
        guard.record(1, out.loss, out.verdict)
    sync(run.device)
    return time.perf_counter() - t0


def _bench_rank(device: torch.device, args: argparse.Namespace, folder: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    files = {name: folder / f"{name}.tok" for name in SOURCES}
    runs, guards = {}, {}
    for row in ROWS:
        cfg = load_config(args.config, row_overrides(row, files, folder))
        runs[row] = build_run(device, cfg, preflight(cfg, world))
        guards[row] = StepGuard(GuardOptions()) if "guarded" in row else None
        for _ in range(2):  # warm-up
            _step(runs[row], guards[row])
    reads = {}
    for row in ROWS:
        with HostReads() as counter:
            _step(runs[row], guards[row])
        reads[row] = counter.count
    times: dict[str, list[float]] = {row: [] for row in ROWS}
    for _ in range(args.steps):
        for row in ROWS:
            times[row].append(_step(runs[row], guards[row]))
    # a checkpoint save: the finiteness check it starts with (one reduction) beside the whole save
    run = runs["one file, guarded"]
    with HostReads() as counter:
        first_nonfinite_state(run.model, run.optimizer, run.device)
    check_reads = counter.count
    check_s, save_s = [], []
    for i in range(args.saves):
        dist.barrier()
        t0 = time.perf_counter()
        first_nonfinite_state(run.model, run.optimizer, run.device)
        check_s.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        run.save(i + 1)
        save_s.append(time.perf_counter() - t0)
        run.confirm()  # prunes to checkpoint.keep as a step trained from the save would (not timed)
    guard = StepGuard(GuardOptions())
    t0 = time.perf_counter()
    for i in range(10_000):  # the guard's own work per step: judge, then record
        guard.record(i, 2.0 + 1e-3 * (i % 7), guard.judge(2.0 + 1e-3 * (i % 7), 1.0))
    guard_s = (time.perf_counter() - t0) / 10_000
    medians = torch.tensor([statistics.median(times[row]) for row in ROWS], dtype=torch.float64, device=device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    counts = torch.tensor([reads[row] for row in ROWS], dtype=torch.float64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    saving = torch.tensor([statistics.median(check_s), statistics.median(save_s)], dtype=torch.float64, device=device)
    dist.all_reduce(saving, op=dist.ReduceOp.MAX)
    if rank == 0:
        cfg = runs[ROWS[0]].cfg
        print(
            f"{world} processes on {device.type}, {cfg.parallel.hp}x{cfg.parallel.cp} ({cfg.model.preset} model, "
            f"{cfg.data.global_batch} x {cfg.data.seq_len} packed tokens per step); median of {args.steps} "
            f"interleaved steps, slowest rank; host reads of tensor values in one step (most of any rank)"
        )
        print(f"{'row':20s} {'host reads':>10s} {'step ms':>8s} {'vs one file':>11s}")
        base = medians[0].item()
        for row, median, count in zip(ROWS, medians.tolist(), counts.tolist()):
            print(f"{row:20s} {int(count):10d} {median * 1e3:8.1f} {median / base:10.3f}x")
        print(f"the guard's own Python per step: {guard_s * 1e6:.1f} us ({guard_s / base:.4%} of the plain step)")
        check, save = saving.tolist()
        print(
            f"a checkpoint save (median of {args.saves}, slowest rank): {save * 1e3:.1f} ms, of which the check that "
            f"every weight and AdamW state is finite: {check * 1e3:.2f} ms ({check / save:.1%}; {check_reads} host "
            f"read(s), one reduction); steps that do not save: no check"
        )


def main(args: argparse.Namespace) -> None:
    folder = Path(tempfile.mkdtemp(prefix="loongtrain-bench-guard-"))
    try:
        write_sources(folder)
        launch(_bench_rank, args.nproc, args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=4, help="processes to spawn (ignored under torchrun)")
    parser.add_argument("--config", type=Path, default=MAIN_CONFIG, help="the layout and model (the main job's)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row (interleaved)")
    parser.add_argument("--saves", type=int, default=5, help="timed checkpoint saves (with their finiteness check)")
