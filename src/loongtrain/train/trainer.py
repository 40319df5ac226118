"""The training loop behind ``loongtrain train``.

``preflight`` validates a configuration against the world size without any process
group (so bad input fails before anything is spawned); ``train`` runs on every rank.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from loongtrain.attention.sharding import check_sequence_length
from loongtrain.config import ConfigError, TrainConfig, to_toml
from loongtrain.data import BatchLoader, PackedRecallTask, RecallTask, TokenFile, TokenFileError, TokenFileSource
from loongtrain.data.loader import rows_per_microbatch
from loongtrain.hf.run import init_weights, model_config_for
from loongtrain.model import ModelConfig, build_model
from loongtrain.parallel import ParallelConfig, init_parallel
from loongtrain.parallelize import check_model_fits, parallelize
from loongtrain.train.checkpoint import CheckpointManager, check_model_shape
from loongtrain.train.metrics import (
    MetricsWriter,
    device_peak_tflops,
    flops_per_token,
    mfu,
    peak_memory_bytes,
    plot_curves,
    read_metrics,
    reset_peak_memory,
)
from loongtrain.train.schedule import lr_at
from loongtrain.train.step import forward_backward

PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Plan:
    """What ``preflight`` resolved: the layout, the model shape and the data source."""

    layout: ParallelConfig
    model: ModelConfig
    task: RecallTask | PackedRecallTask | None  # the synthetic task, or None for a token file


def parallel_config(cfg: TrainConfig) -> ParallelConfig:
    p = cfg.parallel
    return ParallelConfig(
        hp=p.hp, cp=p.cp, window=p.window, placement=p.placement, dp=p.dp or None, context_order=p.context_order,
        balance=p.balance,
    )  # fmt: skip


def make_source(cfg: TrainConfig) -> RecallTask | PackedRecallTask | TokenFileSource:
    """The configured data source (a token file is memory-mapped, so this is cheap)."""
    d = cfg.data
    if d.source == "recall":
        recall = dict(
            seq_len=d.seq_len, keys=d.recall_keys, values=d.recall_values, facts=d.recall_facts,
            queries=d.recall_queries, filler=d.recall_filler, seed=d.seed,
        )  # fmt: skip
        return PackedRecallTask(doc_len=d.doc_len, **recall) if d.pack else RecallTask(**recall)
    file = TokenFile(d.path)
    eos = None
    if d.pack:
        eos = d.eos_id if d.eos_id >= 0 else file.eos
        if eos is None:
            raise ConfigError(
                f"data.pack=true needs the end-of-document token, but {d.path} records none (written before "
                f"loongtrain recorded it, or by a tokenizer without one); set data.eos_id"
            )
    return TokenFileSource(file, d.seq_len, d.seed, eos=eos)


def model_shape(mcfg: ModelConfig) -> dict:
    return dataclasses.asdict(mcfg)


def check_run_dir(run_dir: Path) -> None:
    """Raise ConfigError if ``run_dir`` cannot be created and written."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"run.output_dir={str(run_dir)!r} cannot be written ({e}); choose another folder") from None


def preflight(cfg: TrainConfig, world_size: int) -> Plan:
    """Every check that needs no process group; raises ConfigError/ValueError with the fix."""
    try:
        layout = parallel_config(cfg)
        dp = layout.resolve_dp(world_size)
        mcfg = model_config_for(cfg.model)  # a preset or the [model] init_from HF folder, with the RoPE keys
        check_model_fits(mcfg, layout.hp)
        check_sequence_length(cfg.data.seq_len, layout.hp, layout.cp)
        rows_per_microbatch(cfg.data.global_batch, dp, cfg.data.micro_batches)
        source = make_source(cfg)
    except TokenFileError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if isinstance(source, RecallTask | PackedRecallTask) and source.vocab_size > mcfg.vocab_size:
        raise ConfigError(
            f"the recall task needs {source.vocab_size} token ids but the model's vocabulary is "
            f"{mcfg.vocab_size}; set model.vocab_size >= {source.vocab_size} or use fewer keys/values/filler"
        )
    if isinstance(source, TokenFileSource):
        source.file.check_vocab(mcfg.vocab_size)
    run_dir = Path(cfg.run.output_dir)
    check_run_dir(run_dir)
    if cfg.checkpoint.resume:
        latest = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint.keep).latest()
        if latest is not None:
            check_model_shape(latest[1], CheckpointManager.read_state(latest[1]), model_shape(mcfg))
    return Plan(layout=layout, model=mcfg, task=None if isinstance(source, TokenFileSource) else source)


@dataclass
class TrainResult:
    steps_run: int
    final_step: int
    losses: list[float]
    eval_loss: float
    eval_accuracy: float
    wall_s: float
    tokens_per_s_per_device: float


class _Progress:
    """A one-line progress bar on an interactive terminal (rank 0 only)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled

    def update(self, step: int, text: str) -> None:
        if self.enabled:
            width = 24
            done = int(width * step / self.total)
            sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{self.total} {text}\033[K")
            sys.stdout.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()


def _to(batches, device):
    return [mb.to(device) for mb in batches]


def _grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def evaluate(model, state, loader: BatchLoader, batches: int, device) -> tuple[float, float]:
    """Mean loss and accuracy over ``batches`` held-out global batches."""
    loss = acc = 0.0
    for i in range(batches):
        result = forward_backward(model, state, _to(loader.eval_batch(i), device), backward=False)
        loss += result.loss / batches
        acc += result.accuracy / batches
    return loss, acc


def train(device: torch.device, cfg: TrainConfig, plan: Plan) -> TrainResult:
    """Run (or resume) the configured training on this rank; collective over all ranks.

    ``plan`` comes from :func:`preflight` for this world size.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(cfg.run.output_dir)
    state = init_parallel(plan.layout, device=device, verify_inputs=cfg.parallel.verify_inputs)
    param_dtype = PARAM_DTYPES[cfg.parallel.param_dtype]
    model = build_model(plan.model)
    parallelize(
        model, state, checkpoint=cfg.parallel.checkpoint, checkpoint_every=cfg.parallel.checkpoint_every,
        zero=cfg.parallel.zero, param_dtype=None if param_dtype == torch.float32 else param_dtype,
        reshard_after_forward=cfg.parallel.reshard_after_forward,
    )  # fmt: skip
    init_weights(model, device, cfg.model, run_dir, seed=cfg.run.seed)  # random, or the init_from HF weights
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay
    )
    loader = BatchLoader(
        make_source(cfg), cfg.data.global_batch, cfg.data.micro_batches, state.dp, state.coords.dp,
        mask_documents=cfg.data.document_masks,
    )  # fmt: skip
    checkpoints = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint.keep)
    start = 0
    latest = checkpoints.latest() if cfg.checkpoint.resume else None
    if latest is not None:
        trainer_state = checkpoints.load(latest[1], model, optimizer, model_shape(plan.model))
        start = trainer_state["step"]
        loader.load_state_dict(trainer_state["data"])

    writer = None
    if rank == 0:
        (run_dir / "config.toml").write_text(to_toml(cfg))
        writer = MetricsWriter(run_dir, cfg.run.tensorboard)
        describe = (
            f"loongtrain train: {world} process(es) on {device.type} ({dist.get_backend()}), layout dp={state.dp} "
            f"hp={state.hp} cp={state.cp} window={plan.layout.window} {plan.layout.placement}, "
            f"zero={cfg.parallel.zero}, checkpoint={cfg.parallel.checkpoint}, compute {cfg.parallel.param_dtype}\n"
            f"model {cfg.model.preset} ({plan.model.num_params() / 1e6:.2f}M parameters), data {cfg.data.source}: "
            f"{cfg.data.global_batch} x {cfg.data.seq_len} tokens per step"
        )
        if latest is not None:
            describe += f"\nresumed from {latest[1]} at step {start}"
            if start >= cfg.run.steps:
                describe += (
                    f"; run.steps={cfg.run.steps} is already reached, so nothing is trained (raise run.steps to "
                    "continue, or set checkpoint.resume=false or another run.output_dir to start over)"
                )
        print(describe, flush=True)

    tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
    flops_tok = flops_per_token(plan.model, cfg.data.seq_len)
    peak = cfg.run.peak_tflops or device_peak_tflops(device, param_dtype)
    interactive = cfg.run.progress == "on" or (cfg.run.progress == "auto" and sys.stdout.isatty())
    progress = _Progress(cfg.run.steps, rank == 0 and interactive)
    losses: list[float] = []
    wall0 = time.perf_counter()
    step_times: list[float] = []
    for step in range(start, cfg.run.steps):
        lr = lr_at(step, lr=o.lr, warmup_steps=o.warmup_steps, total_steps=cfg.run.steps, min_lr_ratio=o.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        reset_peak_memory(device)
        t0 = time.perf_counter()
        result = forward_backward(model, state, _to(loader.next(), device))
        grad_norm = _grad_norm(model, o.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        step_times.append(dt)
        losses.append(result.loss)
        memory = torch.tensor([peak_memory_bytes(device)], dtype=torch.float64, device=device)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        tps = tokens_per_step / dt / world
        util = mfu(tps, flops_tok, peak)
        if rank == 0:
            record = {
                "kind": "train", "step": step + 1, "loss": result.loss, "accuracy": result.accuracy,
                "grad_norm": grad_norm, "lr": lr, "step_s": dt, "tokens_per_s_per_device": tps,
                "tflops_per_device": tps * flops_tok / 1e12, "mfu": util, "peak_memory_gib": memory.item() / 2**30,
            }  # fmt: skip
            writer.write(record)
            line = (
                f"loss {result.loss:.4f} acc {result.accuracy:.3f} | gnorm {grad_norm:.2f} lr {lr:.2e} | "
                f"{tps:,.0f} tok/s/dev {tps * flops_tok / 1e12:.3f} TFLOP/s"
                + (f" MFU {util:.1%}" if util is not None else "")
                + f" | mem {memory.item() / 2**30:.2f} GiB"
            )
            if (step + 1) % cfg.run.log_every == 0 or step + 1 == cfg.run.steps or step == start:
                progress.clear()
                print(f"step {step + 1:5d}/{cfg.run.steps} {line}", flush=True)
            progress.update(step + 1, f"loss {result.loss:.4f} acc {result.accuracy:.3f}")
        if cfg.run.eval_every and (step + 1) % cfg.run.eval_every == 0 and step + 1 < cfg.run.steps:
            ev_loss, ev_acc = evaluate(model, state, loader, cfg.run.eval_batches, device)
            if rank == 0:
                writer.write({"kind": "eval", "step": step + 1, "loss": ev_loss, "accuracy": ev_acc})
        last = step + 1 == cfg.run.steps
        if (cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0) or (last and cfg.checkpoint.save_final):
            checkpoints.save(
                step + 1, model, optimizer,
                {"data": loader.state_dict(), "model_shape": model_shape(plan.model), "layout": str(plan.layout)},
            )  # fmt: skip
    wall = time.perf_counter() - wall0
    ev_loss, ev_acc = evaluate(model, state, loader, cfg.run.eval_batches, device)
    steady = step_times[1:] or step_times
    tps = tokens_per_step / (sum(steady) / len(steady)) / world if steady else 0.0
    if rank == 0:
        progress.clear()
        writer.write({"kind": "eval", "step": cfg.run.steps, "loss": ev_loss, "accuracy": ev_acc})
        writer.close()
        chance = plan.task.chance if plan.task is not None else None
        plot_curves(read_metrics(run_dir / "metrics.jsonl"), run_dir / "curves.png", chance)
        ran = cfg.run.steps - start
        done = (
            f"{ran} step(s) in {wall:.1f} s ({tps:,.0f} tokens/s per device after the first step)"
            if ran
            else ("no steps to run")
        )
        chance_text = f" (chance {chance:.3f})" if chance is not None else ""
        print(
            f"done: {done}\n"
            f"final evaluation on {cfg.run.eval_batches} held-out batch(es): loss {ev_loss:.4f}, "
            f"accuracy {ev_acc:.3f}{chance_text}\n"
            f"run folder: {run_dir} (config.toml, metrics.jsonl, curves.png, checkpoints/)",
            flush=True,
        )
    return TrainResult(
        steps_run=cfg.run.steps - start, final_step=cfg.run.steps, losses=losses, eval_loss=ev_loss,
        eval_accuracy=ev_acc, wall_s=wall, tokens_per_s_per_device=tps,
    )  # fmt: skip
