"""The training loop behind ``loongtrain train``, in four parts (as torchtitan splits it):

- :func:`build_run`: one rank's model, optimizer, data and checkpoints, resumed when asked;
- :func:`train_step`: ONE optimizer step on a list of microbatches (the seam where packed
  documents and compilation plug in: it passes the microbatches through untouched);
- :class:`~loongtrain.train.report.Reporter`: what rank 0 writes and prints;
- :func:`train`: the short loop that ties them together.

:func:`~loongtrain.train.preflight.preflight` checks a config before any process exists and
returns the :class:`~loongtrain.train.spec.RunSpec` the run is built from.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from loongtrain.apply import parallelize
from loongtrain.apply.float8 import precompute_scales
from loongtrain.attention.backends import backend_for, set_attention_kernel
from loongtrain.config import ConfigError, TrainConfig, to_toml
from loongtrain.data import BatchLoader
from loongtrain.model import build_model
from loongtrain.options import checkpoint_label
from loongtrain.parallel import ParallelState, init_parallel
from loongtrain.planner.policy import CheckpointPolicy
from loongtrain.train.checkpoint import (
    CheckpointManager,
    DiskFullError,
    check_data_fingerprint,
    disk_full_message,
    is_disk_full,
)
from loongtrain.train.collectives import broadcast_object
from loongtrain.train.faults import quiet_disk_full_in_threads, restart_notice, say
from loongtrain.train.guard import GuardStop, StepGuard, Verdict, first_nonfinite_gradient
from loongtrain.train.guard_actions import (
    apply_optimizer_config,
    check_finite_before_save,
    check_replicas_due,
    guard_note,
    load_newest_finite,
    refuse_nonfinite_weights,
    rollback,
    set_aside_failed,
    spike_line,
    stall_line,
    stall_note,
    stop_message,
)
from loongtrain.train.layouts import PerBatchLayouts
from loongtrain.train.memory_policy import resolve_memory_policy
from loongtrain.train.metrics import (
    batch_flops_per_token,
    device_peak_tflops,
    mfu,
    peak_memory_bytes,
    reset_peak_memory,
)
from loongtrain.train.model_setup import init_weights
from loongtrain.train.preflight import preflight
from loongtrain.train.report import Reporter, StepMetrics
from loongtrain.train.run_folder import METRICS_FILE, RunStart, start_run, trim_metrics
from loongtrain.train.schedule import lr_at
from loongtrain.train.spec import RunSpec, build_optimizer, model_shape, source_fingerprint, source_identity
from loongtrain.train.stages import check_stage_shape, keep_stage_source, load_stage, stage_checkpoint
from loongtrain.train.step import SourceNumbers, forward_backward
from loongtrain.train.tracking import Trackers, open_trackers

__all__ = ["Run", "RunSpec", "StepOutput", "TrainResult", "build_run", "preflight", "train", "train_step"]

Beat = Callable[[int, str], None]  # the watchdog's progress(step, phase)
#: steps after a resume onto changed data whose loss is printed beside the history before the change
DATA_CHANGE_STEPS = 3
#: Called by :func:`train` with (run, steps done, reporter, beat) before the first step of a
#: fresh run (0) and after every step: what a layer above adds to training (``loongtrain.eval``).
AfterStep = Callable[["Run", int, Reporter, Beat], None]


def _no_beat(step: int, phase: str) -> None:
    pass


def to_device(microbatches: list, device: torch.device) -> list:
    """The microbatches (each a :class:`~loongtrain.data.Microbatch`) on ``device``."""
    return [mb.to(device) for mb in microbatches]


# -- building the run ---------------------------------------------------------------------


@dataclass
class Run:
    """Everything one rank trains with, built once by :func:`build_run`."""

    cfg: TrainConfig
    spec: RunSpec
    device: torch.device
    state: ParallelState
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loader: BatchLoader
    checkpoints: CheckpointManager
    folder: RunStart  # how the run folder was taken over (fresh, moved aside, resumed, restarted)
    start: int  # the step this run continues from (0 for a fresh run)
    resumed_from: Path | None
    choose: PerBatchLayouts | None = None  # parallel.layout = per_batch: a microbatch -> the state it runs on
    policy: CheckpointPolicy | None = None  # memory.activation_checkpoint = auto: what the planner chose
    # the guard's rollbacks so far and the sample ranges they skipped (kept in every checkpoint)
    guard_record: dict = field(default_factory=lambda: {"rollbacks": 0, "skipped_samples": []})
    stage_from: Path | None = None  # checkpoint.init_from: the checkpoint this stage started from
    data_fingerprint: str | None = None  # the data's identity, recorded in every checkpoint (made once)
    guard: StepGuard | None = None  # judges every step; its history travels with the checkpoints
    data_identity: dict | None = None  # what the fingerprint digests (a resume on changed data names it)
    optimizer_changes: tuple[str, ...] = ()  # [optim] values the config changed on a loaded state
    pending_prune: int | None = None  # the newest checkpoint, until a step trained from it is applied
    data_change: str | None = None  # a resume onto changed data (checkpoint.allow_data_change): what changed

    def save_due(self, done: int) -> bool:
        """Whether a checkpoint is due after ``done`` steps."""
        c = self.cfg.checkpoint
        return bool(c.every and done % c.every == 0) or (done == self.cfg.run.steps and c.save_final)

    def save(self, done: int) -> None:
        """Collective: checkpoint the model, optimizer, data position and the guard's history
        after ``done`` steps, once every weight and optimizer state is seen to be finite (else
        :class:`GuardStop`: nothing is written). The older checkpoints beyond ``keep`` are
        deleted only once a step trained from this one's weights is applied (:meth:`confirm`)."""
        guard = self.guard or StepGuard(self.cfg.guard.options())  # (a Run built without build_run)
        check_finite_before_save(self, guard, done)
        shape, layout = model_shape(self.spec.model), str(self.spec.parallel)
        data = {**self.loader.state_dict(), "fingerprint": self.data_fingerprint, "identity": self.data_identity}
        guard_state = {**self.guard_record, **guard.state_dict()}
        trainer_state = {"data": data, "model_shape": shape, "layout": layout, "guard": guard_state}
        final = done == self.cfg.run.steps
        self.checkpoints.save(done, self.model, self.optimizer, trainer_state, prune=final)
        self.pending_prune = None if final else done

    def confirm(self) -> None:
        """A step trained from the newest checkpoint's weights was applied: it is trusted, so the
        checkpoints beyond ``keep`` go (rank 0)."""
        if self.pending_prune is not None and dist.get_rank() == 0:
            self.checkpoints.prune(self.pending_prune)
        self.pending_prune = None


def build_run(device: torch.device, cfg: TrainConfig, spec: RunSpec, beat: Beat = _no_beat) -> Run:
    """Collective: take over the run folder (rank 0), build the parallel model, optimizer
    and data loader, and load the newest intact checkpoint when resuming."""
    rank = dist.get_rank()
    run_dir = Path(cfg.run.output_dir)
    checkpoint_dir = run_dir / "checkpoints"
    folder: RunStart | str | None = None
    if rank == 0:
        try:
            folder = start_run(run_dir, cfg.checkpoint.resume, os.environ.get("TORCHELASTIC_RUN_ID"))
            CheckpointManager(checkpoint_dir, cfg.checkpoint.keep).remove_leftovers()
        except OSError as e:
            folder = f"cannot take over the run folder {run_dir} ({e}); fix its permissions or choose another one"
    folder = broadcast_object(folder)
    if isinstance(folder, str):
        raise ConfigError(folder)

    beat(0, "build")
    try:
        set_attention_kernel(cfg.attention.kernel, device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    spec, policy = resolve_memory_policy(cfg, spec, device)  # memory.activation_checkpoint = auto
    state = init_parallel(
        spec.parallel, device=device, verify_inputs=cfg.parallel.verify_inputs, zero_scopes=(cfg.parallel.zero,)
    )  # only the mesh this run shards over
    choose = None
    if cfg.parallel.layout == "per_batch":
        choose = PerBatchLayouts.build(
            state, spec.model, spec.param_dtype, cfg.parallel.verify_inputs, spec.memory.head_groups
        )
    alternatives = choose.alternatives if choose is not None else ()
    model = build_model(spec.model)
    parallelize(
        model, state, memory=spec.memory, zero=cfg.parallel.zero,
        param_dtype=None if spec.param_dtype == torch.float32 else spec.param_dtype,
        reshard_after_forward=cfg.parallel.reshard_after_forward, compile=cfg.run.compile, alternatives=alternatives,
        float8=spec.float8,
    )  # fmt: skip
    init_weights(model, device, spec.init_from, run_dir, seed=cfg.run.seed)  # random, or the init_from HF weights
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    loader = BatchLoader(
        spec.source, cfg.data.global_batch, cfg.data.micro_batches, state.dp, state.coords.dp,
        mask_documents=cfg.data.document_masks,
    )  # fmt: skip
    checkpoints = CheckpointManager(checkpoint_dir, cfg.checkpoint.keep, run_id=folder.run_id, say=say)

    guard = StepGuard(
        cfg.guard.options(), uniform_loss=math.log(spec.model.vocab_size), loss_from=cfg.optim.warmup_steps
    )  # fmt: skip
    run = Run(
        cfg, spec, device, state, model, optimizer, loader, checkpoints, folder, 0, None, choose, policy,
        data_fingerprint=source_fingerprint(loader.source), guard=guard, data_identity=source_identity(loader.source),
    )  # fmt: skip
    if folder.resuming:
        beat(0, "load")
        loaded = load_newest_finite(run)  # a checkpoint holding a NaN is set aside, an older one tried
        if loaded is not None:
            step, path, trainer_state = loaded
            run.data_change = check_data_fingerprint(
                path, trainer_state, run.data_fingerprint, cfg.checkpoint.allow_data_change, run.data_identity
            )  # fmt: skip (preflight said what changed, when it is allowed)
            run.start, run.resumed_from = trainer_state["step"], path
            loader.load_state_dict(trainer_state["data"])
            saved_guard = trainer_state.get("guard") or {}
            run.guard_record = {key: saved_guard.get(key, value) for key, value in run.guard_record.items()}
            guard.load_state_dict(saved_guard)  # the spike history: judged from the first step
            run.optimizer_changes = tuple(apply_optimizer_config(optimizer, cfg.optim))
    if run.resumed_from is None and cfg.checkpoint.init_from:  # a new stage: its first weights from another run
        beat(0, "load")
        run.stage_from = stage_checkpoint(cfg.checkpoint.init_from)
        check_stage_shape(run.stage_from, model_shape(spec.model))
        load_stage(run.stage_from, model, optimizer, cfg.checkpoint.init_optimizer)
        if cfg.checkpoint.init_optimizer:
            run.optimizer_changes = tuple(apply_optimizer_config(optimizer, cfg.optim))
        if rank == 0:
            keep_stage_source(run.stage_from, run_dir)  # an imported model's config and tokenizer, for export/eval
        refuse_nonfinite_weights(run, run.stage_from)
    precompute_scales(model)  # float8 all-gather: the scales of the weights as initialised or loaded
    if rank == 0:
        trim_metrics(run_dir / METRICS_FILE, run.start)  # steps after the checkpoint are trained again
        (run_dir / "config.toml").write_text(to_toml(cfg))
    return run


def describe(run: Run) -> str:
    """What rank 0 prints at start-up: layout, model, data, and how the run folder was taken."""
    cfg, spec, state = run.cfg, run.spec, run.state
    text = (
        f"loongtrain train: {dist.get_world_size()} process(es) on {run.device.type} ({dist.get_backend()}), "
        f"layout dp={state.dp} hp={state.hp} cp={state.cp} ring_window={spec.parallel.ring_window} "
        f"{spec.parallel.placement}, zero={cfg.parallel.zero}, "
        f"activation checkpoint {checkpoint_label(spec.memory, spec.model.n_layers)}, "
        f"compute {cfg.parallel.param_dtype}, "
        f"attention kernel {backend_for(run.device, spec.param_dtype).name}"
        f"{', compiled blocks' if cfg.run.compile else ''}\n"
        f"model {cfg.model.init_from or cfg.model.preset} ({spec.model.num_params() / 1e6:.2f}M parameters), "
        f"data {cfg.data.source}: "
        f"{cfg.data.global_batch} x {cfg.data.seq_len} tokens per step"
    )
    if getattr(run.model, "float8_plan", None) is not None:
        text += f"\n{run.model.float8_plan.describe()}"
    if run.policy is not None:
        text += f"\nmemory.activation_checkpoint=auto: {run.policy.describe()}"
    if run.choose is not None:
        splits = ", ".join(f"{c.hp}x{c.cp} (ring_window {c.ring_window})" for c in run.choose.configs)
        text += f"\nparallel.layout=per_batch: each microbatch on the fastest of hp x cp = {splits}"
    if source_names(run.loader.source):  # a mixture: one line per source
        text += f"\ndata mixture of {len(source_names(run.loader.source))} sources:\n  "
        text += run.loader.source.describe().replace("\n", "\n  ")
    elif hasattr(run.loader.source, "describe"):  # a token file: its targets and what was left out
        text += f"\ntoken file {run.loader.source.describe()}"
    if run.folder.moved_to is not None:
        text += f"\nstarting a new run: the previous run in {cfg.run.output_dir} was moved to {run.folder.moved_to}"
    if run.folder.restarted:
        text += f"\n{restart_notice()}"
    if run.stage_from is not None:
        loaded = "weights and optimizer state" if cfg.checkpoint.init_optimizer else "weights"
        text += f"\na new stage: {loaded} from {run.stage_from}; steps, schedule and data start afresh"
    if run.optimizer_changes:
        text += f"\noptimizer settings from the config (the checkpoint held others): {', '.join(run.optimizer_changes)}"
    if run.resumed_from is not None:
        text += f"\nresumed from {run.resumed_from} at step {run.start}"
        if run.guard is not None and run.guard.spikes.history:
            text += f"; the guard's loss history: {run.guard.spikes.describe()}"
        if run.start >= cfg.run.steps:
            text += (
                f"; run.steps={cfg.run.steps} is already reached, so nothing is trained (raise run.steps to "
                "continue, or set checkpoint.resume=false to start a new run)"
            )
    return text


# -- one step ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepOutput:
    """Global results of one optimizer step (the same on every rank)."""

    loss: float
    accuracy: float
    grad_norm: float
    layouts: tuple[str, ...] = ()  # hp x cp of each of this replica's microbatches
    verdict: Verdict = Verdict("apply")  # what the guard decided (no guard: applied)
    microbatch_losses: tuple[float, ...] = ()  # each microbatch's share of the loss
    nonfinite_gradient: str | None = None  # a stopped step: the first parameter whose gradient is not finite
    sources: tuple[SourceNumbers, ...] = ()  # a mixture: each source's loss, targets and tokens

    @property
    def applied(self) -> bool:
        """Whether the optimizer applied this step's update."""
        return self.verdict.applied


def gradient_norm(model: torch.nn.Module) -> torch.Tensor:
    """The global gradient norm (as ``clip_grad_norm_`` computes it; a DTensor under ZeRO)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads)


def _as_float(norm: torch.Tensor) -> float:
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm to ``max_norm`` (0: no clipping); returns the norm before clipping."""
    norm = gradient_norm(model)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, norm)
    return _as_float(norm)


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: ParallelState, microbatches: list,
    *, lr: float, grad_clip: float, choose: Callable | None = None, guard: StepGuard | None = None,
    source_names: tuple[str, ...] = (),
) -> StepOutput:  # fmt: skip
    """ONE optimizer step on this replica's ``microbatches`` (on the device; each is what
    :func:`~loongtrain.train.step.forward_backward` takes), at learning rate ``lr``;
    ``choose``: each microbatch's layout (``parallel.layout = per_batch``). ``guard`` judges
    the step from its loss and gradient norm before the update (:class:`StepGuard`): a step it
    does not apply leaves the weights and the optimizer untouched (its gradients are dropped).
    ``source_names``: a mixture's sources, whose losses the step also reports."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    result = forward_backward(model, state, microbatches, choose=choose, source_names=source_names)
    norm_tensor = gradient_norm(model)
    norm = _as_float(norm_tensor)  # the one host read of the norm, before any update
    verdict = guard.judge(result.loss, norm) if guard is not None else Verdict("apply")
    culprit = None
    if verdict.applied:
        if grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), grad_clip, norm_tensor)
        optimizer.step()
        precompute_scales(model)  # float8 all-gather with precomputed scales: the new weights' (else nothing)
    elif verdict.action == "stop" and verdict.reason in ("loss", "gradients"):
        culprit = first_nonfinite_gradient(model, state.device)  # the failure path's one collective
    optimizer.zero_grad(set_to_none=True)
    return StepOutput(
        loss=result.loss, accuracy=result.accuracy, grad_norm=norm, layouts=result.layouts, verdict=verdict,
        microbatch_losses=result.microbatch_losses, nonfinite_gradient=culprit, sources=result.sources,
    )  # fmt: skip


class Evaluation(NamedTuple):
    loss: float
    accuracy: float
    sources: dict[str, float]  # a mixture: each source's loss per target token over the batches


def evaluate(run: Run, batches: int) -> Evaluation:
    """Mean loss and accuracy over ``batches`` held-out global batches (and, for a mixture, the
    loss of each source: its summed loss over its targets in those batches)."""
    loss = acc = 0.0
    names = source_names(run.loader.source)
    sums, targets = [0.0] * len(names), [0] * len(names)
    for i in range(batches):
        batch = to_device(run.loader.eval_batch(i), run.device)
        result = forward_backward(
            run.model, run.state, batch, backward=False, choose=run.choose, source_names=names
        )  # fmt: skip
        loss += result.loss / batches
        acc += result.accuracy / batches
        for g, numbers in enumerate(result.sources):
            sums[g] += numbers.loss * numbers.targets if numbers.targets else 0.0
            targets[g] += numbers.targets
    return Evaluation(loss, acc, {name: s / n if n else math.nan for name, s, n in zip(names, sums, targets)})


def source_names(source: object) -> tuple[str, ...]:
    """The names of a mixture's sources (ids index them), or () for one source."""
    return tuple(getattr(source, "names", ()))


def peak_memory_gib(device: torch.device) -> float:
    """Collective: the largest peak memory of any rank since the last reset, in GiB."""
    return peak_memory_and_flag(device)[0]


def peak_memory_and_flag(device: torch.device, flag: bool = False) -> tuple[float, bool]:
    """Collective: :func:`peak_memory_gib`, and whether any rank raised ``flag`` (in the same
    reduction: a failure one rank met, e.g. rank 0's full disk, reaches every rank at no cost)."""
    values = torch.tensor([peak_memory_bytes(device), float(flag)], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    peak, raised = values.tolist()
    return peak / 2**30, bool(raised)


class WriteFailures:
    """Rank 0's writes to the run folder (metrics, evaluation records) that met a full disk: the
    first is kept and the others are skipped; every rank learns of it at the next step's
    reduction (:func:`peak_memory_and_flag`) and stops there together, in one line."""

    def __init__(self) -> None:
        self.error: OSError | None = None

    def peak_memory_gib(self, device: torch.device, run: Run) -> float:
        """Collective: :func:`peak_memory_gib`, raising :class:`DiskFullError` on every rank
        when rank 0 met a full disk since the last call."""
        peak, full = peak_memory_and_flag(device, self.error is not None)
        if full:
            raise DiskFullError(disk_full_message(Path(run.cfg.run.output_dir), self.error, run.checkpoints))
        return peak

    def call(self, fn: Callable, *args, **kwargs) -> None:
        """``fn`` (rank 0's writes alone), skipped once the disk is full."""
        if self.error is None:
            self.catch(fn, *args, **kwargs)

    def catch(self, fn: Callable, *args, **kwargs) -> None:
        """``fn``, always run (it may hold collectives before rank 0's writes: the evaluations of
        ``after_step``, a rollback's load), a full disk its writes meet kept for the reduction."""
        try:
            fn(*args, **kwargs)
        except OSError as e:
            if not is_disk_full(e):
                raise
            self.error = self.error or e


#: The transfer kinds as the step's metrics group them (``AttentionStats`` kinds).
COMM_KINDS = {
    "ring_kv_mib": ("fwd.ring_kv", "bwd.ring_kv"),
    "ring_dkv_mib": ("bwd.ring_dkv",),
    "all_to_all_mib": ("fwd.all_to_all", "bwd.all_to_all"),
    "zero_all_gather_mib": ("zero.all_gather",),
    "zero_reduce_mib": ("zero.reduce_scatter", "zero.all_reduce"),
}


def comm_mib_per_device(state: ParallelState, choose: PerBatchLayouts | None = None) -> dict[str, float]:
    """Collective: MiB each device sent since ``state.stats`` was reset, by :data:`COMM_KINDS`
    (ZeRO's gradient reduction: reduce-scatter plus, with HSDP, the replicas' all-reduce)
    (mean over devices: with documents, ranks send different amounts). With a layout per
    microbatch (``choose``) the other layouts' states count too (reset with ``state``'s:
    :func:`reset_stats`)."""
    sent: dict[str, int] = {}
    for stats in _counters(state, choose):
        for kind, n in stats.bytes.items():
            sent[kind] = sent.get(kind, 0) + n
    totals = [float(sum(sent.get(kind, 0) for kind in kinds)) for kinds in COMM_KINDS.values()]
    mean = torch.tensor(totals, dtype=torch.float64, device=state.device)
    dist.all_reduce(mean)
    return {name: value / dist.get_world_size() / 2**20 for name, value in zip(COMM_KINDS, mean.tolist())}


def _counters(state: ParallelState, choose: PerBatchLayouts | None) -> list:
    return [state.stats] if choose is None else choose.counters


def reset_stats(state: ParallelState, choose: PerBatchLayouts | None = None) -> None:
    """Reset the attention counters of ``state`` and of the other layouts' states."""
    for stats in _counters(state, choose):
        stats.reset()


# -- the loop ------------------------------------------------------------------------------


def run_trackers(run: Run) -> Trackers | None:
    """Rank 0: the ``[metrics]`` section's W&B and MLflow runs (None when both are off), sent
    the resolved config and, for a mixture, the data-inspect table."""
    cfg = run.cfg
    if not (cfg.metrics.wandb or cfg.metrics.mlflow):
        return None
    trackers = open_trackers(
        cfg.metrics, Path(cfg.run.output_dir), dataclasses.asdict(cfg), to_toml(cfg), run.stage_from
    )  # fmt: skip
    if source_names(run.loader.source):
        from loongtrain.train.data_inspect import inspect_data

        trackers.table_from("data/inspect", lambda: inspect_data(cfg).columns_and_rows())
    return trackers


@dataclass
class TrainResult:
    steps_run: int
    final_step: int
    losses: list[float]
    eval_loss: float
    eval_accuracy: float
    wall_s: float
    tokens_per_s_per_device: float


def train(
    device: torch.device, cfg: TrainConfig, spec: RunSpec, beat: Beat | None = None, after_step: AfterStep | None = None
) -> TrainResult:
    """Run (or resume) the configured training on this rank; collective over all ranks.

    ``spec`` comes from :func:`preflight` for this world size; ``beat(step, phase)`` is
    told whenever the rank moves on (the stalled-rank watchdog); ``after_step`` (collective)
    runs before the first step of a fresh run and after every step. The ``[guard]`` section
    judges every step before its update (:mod:`loongtrain.train.guard`): a step it stops on
    raises :class:`~loongtrain.train.guard.GuardStop`, a rollback continues from a checkpoint.
    """
    beat = beat or _no_beat
    run = build_run(device, cfg, spec, beat)
    r, o = cfg.run, cfg.optim
    guard = run.guard
    reporter = Reporter(
        Path(r.output_dir), enabled=dist.get_rank() == 0, total_steps=r.steps, log_every=r.log_every,
        first_step=run.start, tensorboard=r.tensorboard, progress=r.progress,
        trackers=run_trackers(run) if dist.get_rank() == 0 else None,
    )  # fmt: skip
    if reporter.enabled:
        quiet_disk_full_in_threads()  # TensorBoard's writer thread: the loop below says it in one line
    failed, step = True, run.start
    try:
        if reporter.enabled:
            reporter.say(f"{describe(run)}\n{reporter.metrics_status}")
        world = dist.get_world_size()
        tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
        peak = r.peak_tflops or device_peak_tflops(device, spec.param_dtype)
        losses: dict[int, float] = {}  # step -> loss (a rollback forgets the steps after its checkpoint)
        step_times: list[float] = []
        failures = WriteFailures()
        if after_step is not None and run.start == 0:
            failures.catch(after_step, run, 0, reporter, beat)
        check_replicas_due(run, run.start)
        wall0 = time.perf_counter()
        names = source_names(run.loader.source)
        while step < r.steps:
            beat(step, "train")
            lr = lr_at(step, lr=o.lr, warmup_steps=o.warmup_steps, total_steps=r.steps, min_lr_ratio=o.min_lr_ratio)
            reset_peak_memory(device)
            reset_stats(run.state, run.choose)
            t0 = time.perf_counter()
            first_index = run.loader.next_index
            batch = run.loader.next()
            out = train_step(
                run.model, run.optimizer, run.state, to_device(batch, device), lr=lr, grad_clip=o.grad_clip,
                choose=run.choose, guard=guard, source_names=names,
            )  # fmt: skip
            if out.verdict.action == "stop":
                set_aside_failed(run, guard.weights_step(step + 1))  # the printed resume skips them
                raise GuardStop(stop_message(run, guard, step + 1, out, first_index))
            if out.verdict.action == "rollback":
                beat(step, "rollback")
                step = rollback(run, guard, reporter, step + 1, out, failures.catch)
                losses = {s: loss for s, loss in losses.items() if s <= step}
                continue
            guard.record(step + 1, out.loss, out.verdict)
            watch = out.applied and guard.options.stalled != "off"
            stalled_since = guard.stall.update(step + 1, out.loss, out.grad_norm) if watch else None
            if stalled_since is not None and guard.options.stalled == "stop":
                raise GuardStop(stall_line(run, guard, step + 1, stalled_since))
            if out.applied:
                run.confirm()  # a step trained from the newest checkpoint's weights was applied
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            flops_tok = batch_flops_per_token(spec.model, batch)  # this replica's documents and sliding window
            step_times.append(dt)
            losses[step + 1] = out.loss
            tps = tokens_per_step / dt / world
            peak_gib = failures.peak_memory_gib(device, run)  # (a full disk met by rank 0 stops every rank here)
            failures.call(reporter.step, StepMetrics(
                step=step + 1, loss=out.loss, accuracy=out.accuracy, grad_norm=out.grad_norm, lr=lr, step_s=dt,
                tokens_per_s_per_device=tps, tflops_per_device=tps * flops_tok / 1e12, mfu=mfu(tps, flops_tok, peak),
                peak_memory_gib=peak_gib, layouts=",".join(out.layouts),
                guard=guard_note(out.verdict) or stall_note(stalled_since), memory_is_rss=device.type != "cuda",
                sources=out.sources, **comm_mib_per_device(run.state, run.choose),
            ))  # fmt: skip
            if out.verdict.reason == "spike" and reporter.enabled:
                reporter.say(spike_line(guard, step + 1, out))
            if stalled_since is not None:  # guard.stalled = warn: once, beside the step's line
                reporter.say(stall_line(run, guard, step + 1, stalled_since))
            if run.data_change and step < run.start + DATA_CHANGE_STEPS and guard.spikes.history:
                reporter.say(f"step {step + 1}: loss {out.loss:.4f} on the changed data, beside the loss history "
                             f"before the change: {guard.spikes.describe()}")  # fmt: skip
            step += 1
            check_replicas_due(run, step)
            if r.eval_every and step % r.eval_every == 0 and step < r.steps:
                beat(step, "evaluation")
                failures.call(reporter.evaluation, step, *evaluate(run, r.eval_batches))
            if after_step is not None:
                failures.catch(after_step, run, step, reporter, beat)
            if run.save_due(step):
                if guard.skipped_in_a_row:  # a skipped step changes nothing: nothing new to save
                    reporter.say(
                        f"step {step}: checkpoint step-{step} not written: the last {guard.skipped_in_a_row} step(s) "
                        f"were skipped, so the weights are still those step {guard.weights_step(step + 1)} left, "
                        f"which the skipped steps failed on"
                    )
                else:
                    beat(step, "checkpoint save")
                    run.save(step)
        wall = time.perf_counter() - wall0
        failures.peak_memory_gib(device, run)  # the last step's records too
        beat(r.steps, "final evaluation")
        ev_loss, ev_acc, ev_sources = evaluate(run, r.eval_batches)
        steady = step_times[1:] or step_times
        tps = tokens_per_step / (sum(steady) / len(steady)) / world if steady else 0.0
        reporter.finish(
            steps_run=max(0, r.steps - run.start), wall_s=wall, tokens_per_s=tps, eval_batches=r.eval_batches,
            eval_loss=ev_loss, eval_accuracy=ev_acc, chance=spec.task.chance if spec.task is not None else None,
            eval_sources=ev_sources,
        )  # fmt: skip
        failed = False
    except GuardStop as e:  # the guard's stop, in metrics.jsonl and the tracked runs too
        reporter.record({"kind": "stop", "step": step, "message": str(e)})
        raise
    except OSError as e:
        if not is_disk_full(e):
            raise
        raise DiskFullError(disk_full_message(Path(r.output_dir), e, run.checkpoints)) from None
    finally:
        try:
            reporter.close(failed)
        except OSError as e:  # a full disk again while flushing: the error above says it
            if not is_disk_full(e):
                raise
    return TrainResult(
        steps_run=max(0, r.steps - run.start), final_step=r.steps, losses=[losses[k] for k in sorted(losses)],
        eval_loss=ev_loss, eval_accuracy=ev_acc, wall_s=wall, tokens_per_s_per_device=tps,
    )  # fmt: skip
