"""What the guard's verdicts do to a running :class:`~loongtrain.train.trainer.Run`: the line
a stop ends the job with, a rollback to a checkpoint with the data moved past the spike, the
replica check every ``guard.replica_check_every`` steps, and the progress line's notes.
Collective where a docstring says so (every rank reaches them with the same verdict)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from loongtrain.apply.float8 import precompute_scales
from loongtrain.train.faults import say
from loongtrain.train.guard import (
    UNIFORM_LOSS_TOLERANCE,
    GuardStop,
    StepGuard,
    Verdict,
    check_replicas,
    first_nonfinite_state,
    format_samples,
    microbatch_samples,
)
from loongtrain.train.spec import model_shape

if TYPE_CHECKING:
    from loongtrain.train.report import Reporter
    from loongtrain.train.trainer import Run, StepOutput

#: a checkpoint set aside by a rollback (it holds the trajectory that led to the spike)
ROLLED_BACK_SUFFIX = ".rolled-back"
#: a checkpoint set aside because it holds a NaN or an infinity
NONFINITE_SUFFIX = ".nonfinite"
#: a checkpoint set aside at a stop: its weights are those a failing step trained from
FAILED_SUFFIX = ".failed"


def last_good_checkpoint(run: Run, weights_step: int | None = None) -> tuple[int, Path] | None:
    """The newest complete checkpoint that can be called good: older than ``weights_step`` (the
    step whose weights a failing step trained from: its checkpoint produced the failure), or
    the newest one when nothing failed."""
    done = run.checkpoints.complete()
    good = [(s, p) for s, p in done if weights_step is None or s < weights_step]
    return good[-1] if good else None


def set_aside_failed(run: Run, weights_step: int) -> None:
    """Collective, before a stop: rename the checkpoints of step ``weights_step`` and later (the
    weights the failing step trained from) to ``step-N.failed``, so that the printed resume
    command resumes from the last good one."""
    if dist.get_rank() == 0:
        for s, path in run.checkpoints.complete():
            if s >= weights_step:
                run.checkpoints.set_aside(path, FAILED_SUFFIX)
    dist.barrier()


def _failed_folders(run: Run, weights_step: int) -> list[Path]:
    return [path for s, path in run.checkpoints.steps(FAILED_SUFFIX) if s >= weights_step]


def _resume_after(run: Run, fix: str, weights_step: int | None = None) -> str:
    """Where to go on from, after ``fix``: the last good checkpoint (older than the weights a
    failing step came from, ``weights_step``), or the start."""
    good = last_good_checkpoint(run, weights_step)
    aside = ""
    if weights_step is not None:
        kept = [p.name for s, p in run.checkpoints.complete() if s >= weights_step]
        failed = [p.name for p in _failed_folders(run, weights_step)]
        if kept:
            aside = f" ({', '.join(kept)} holds the weights the failing step trained from: not called good)"
        elif failed:
            aside = (
                f" ({', '.join(failed)} holds the weights the failing step trained from: set aside, never resumed "
                f"from; rename it back to step-N if the cause was the data)"
            )
    if good is None:
        if aside:
            return f"no good checkpoint was saved{aside}: start again after you {fix}"
        return f"no checkpoint was saved yet: start again after you {fix}"
    return f"the last good checkpoint is {good[1]}{aside}: resume from it after you {fix}"


def _microbatch_text(run: Run, out: StepOutput, first_index: int) -> str:
    """Which microbatch's loss is not finite (the first), with its global sample indices."""
    losses = out.microbatch_losses
    bad = [m for m, loss in enumerate(losses) if not math.isfinite(loss)]
    m = bad[0] if bad else 0
    samples = microbatch_samples(first_index, m, run.loader.dp, run.loader.rows)
    which = f"microbatch {m} of {len(losses)}" if len(losses) > 1 else "the step's only microbatch"
    return f"{which} ({format_samples(samples)})"


def nonfinite_summary(out: StepOutput) -> str:
    """What was not finite in a stopped step: the loss or the gradient norm, and the first
    parameter with a non-finite gradient."""
    what = f"the loss is {out.loss}" if not math.isfinite(out.loss) else f"the gradient norm is {out.grad_norm}"
    return what + _culprit(out)


def _culprit(out: StepOutput) -> str:
    culprit = out.nonfinite_gradient
    return f"; first parameter with a non-finite gradient: {culprit}" if culprit else "; every gradient is finite"


def stop_message(run: Run, guard: StepGuard, step: int, out: StepOutput, first_index: int) -> str:
    """The one line a stopped step ends the job with: the step, what was not finite (or the
    spikes/skips), the first parameter with a non-finite gradient, the microbatch and its
    samples, the last good checkpoint and what to change before resuming from it."""
    v, o = out.verdict, guard.options
    if v.reason in ("loss", "gradients"):
        if v.reason == "loss":
            what = f"the loss is {out.loss} in {_microbatch_text(run, out, first_index)}"
        else:
            samples = range(first_index, first_index + run.cfg.data.global_batch)
            finite = f"the loss {out.loss:.4f} is finite; {format_samples(samples)}"
            what = f"the gradient norm is {out.grad_norm} ({finite})"
        what += _culprit(out)
        fix = "lower optim.lr (or raise optim.warmup_steps)"
        skip = "raise guard.max_skips" if o.nonfinite == "skip" else "set guard.nonfinite=skip to skip such steps"
        fix += f", or {skip}"
    else:
        what = spike_text(guard, out)
        fix = "raise guard.spike_sigma or guard.max_skips, or set guard.spike=warn to train on"
    if o.nonfinite == "skip" or v.reason == "spike":
        why = f"{guard.skipped_in_a_row + 1} steps in a row would be skipped, more than guard.max_skips={o.max_skips}"
    else:
        why = "guard.nonfinite=stop"
    return (
        f"step {step}: {what}. Stopped by the guard ({why}): the update was not applied and nothing was saved from "
        f"this state; {_resume_after(run, fix, guard.weights_step(step))}"
    )


def guard_note(v: Verdict) -> str:
    """The step's mark in ``metrics.jsonl`` and on the progress line ("" for a plain step)."""
    if v.action == "skip":
        return "skipped: spike" if v.reason == "spike" else f"skipped: non-finite {v.reason}"
    return "spike" if v.reason == "spike" else ""


def stall_note(began: int | None) -> str:
    """The mark of the step at which a stall is seen (``metrics.jsonl``'s ``guard``), or ""."""
    return f"stalled since step {began}" if began is not None else ""


def stall_line(run: Run, guard: StepGuard, step: int, began: int) -> str:
    """One line for a run that stopped learning (``guard.stalled``): since when, by which rule,
    and what to change."""
    o = guard.options
    rule = (
        f"a gradient norm of exactly 0 or a loss within {UNIFORM_LOSS_TOLERANCE:g} of ln(vocab_size) = "
        f"{guard.stall.uniform_loss:.4f} (the uniform distribution's: nothing learnt)"
    )
    fix = "lower optim.lr (a step too large can saturate the model), or check that the data has targets"
    if o.stalled == "stop":
        return (
            f"step {step}: the run stopped learning at step {began} ({guard.stall.count} steps in a row of {rule}); "
            f"stopped (guard.stalled=stop); {_resume_after(run, fix, began)}"
        )
    return (
        f"step {step}: warning: the run stopped learning at step {began} ({guard.stall.count} steps in a row of "
        f"{rule}); training goes on (guard.stalled=warn; set guard.stalled=stop to end such a run): {fix}"
    )


def spike_text(guard: StepGuard, out: StepOutput) -> str:
    return f"loss spike {out.loss:.4f} above {out.verdict.threshold:.4f} ({guard.spikes.describe()})"


def spike_line(guard: StepGuard, step: int, out: StepOutput) -> str:
    done = "trained on (guard.spike=warn)" if out.verdict.applied else "not applied (guard.spike=skip)"
    return f"step {step}: {spike_text(guard, out)}; {done}"


def rollback(
    run: Run, guard: StepGuard, reporter: Reporter, spike_step: int, out: StepOutput,
    write: Callable[..., None] = lambda fn, *args: fn(*args),
) -> int:  # fmt: skip
    """Collective: answer a spike at ``spike_step`` (1-based) under ``guard.spike=rollback``:
    reload the newest intact checkpoint at least ``guard.rollback_back`` steps before it, move
    the data past the spike's batch (and ``guard.rollback_skip_steps`` more), set the newer
    checkpoints aside, log it; returns the step training continues from. Raises
    :class:`GuardStop` past ``guard.max_rollbacks`` or without such a checkpoint."""
    o, cfg = guard.options, run.cfg
    record = run.guard_record
    spike = f"step {spike_step}: {spike_text(guard, out)}"
    if record["rollbacks"] >= o.max_rollbacks:
        raise GuardStop(
            f"{spike}; guard.max_rollbacks={o.max_rollbacks} rollbacks were already made in this run, so it stops "
            f"here (nothing was applied or saved from this step); "
            f"{_resume_after(run, 'raise guard.max_rollbacks or guard.spike_sigma')}"
        )
    latest_allowed = spike_step - o.rollback_back
    loaded = load_newest_finite(run, at_most=latest_allowed)
    if loaded is None:
        raise GuardStop(
            f"{spike}; guard.spike=rollback needs a checkpoint at or before step {latest_allowed} and there is none "
            f"(nothing was applied or saved from this step): set checkpoint.every (e.g. {max(1, latest_allowed)}) so "
            f"that one exists, or guard.spike=skip"
        )
    to_step, path, trainer_state = loaded
    precompute_scales(run.model)  # float8 all-gather: the scales of the loaded weights
    apply_optimizer_config(run.optimizer, cfg.optim)
    gb = cfg.data.global_batch
    skipped = range(int(trainer_state["data"]["next_index"]), run.loader.next_index + o.rollback_skip_steps * gb)
    run.loader.next_index = skipped.stop
    record["rollbacks"] += 1
    record["skipped_samples"].append([skipped.start, skipped.stop])
    guard.spikes.forget_after(to_step)
    guard.skipped_in_a_row = 0
    guard.stall.load({})  # the stalled steps counted so far are among those rolled back
    set_aside_newer_checkpoints(run, to_step)
    write(  # rank 0's records: the trainer's WriteFailures keeps a full disk for the step's reduction
        reporter.rollback,
        to_step,
        {
            "kind": "rollback", "step": to_step, "spike_step": spike_step, "loss": out.loss,
            "threshold": out.verdict.threshold, "checkpoint": str(path),
            "skipped_samples": [skipped.start, skipped.stop], "rollbacks": record["rollbacks"],
        },
        f"{spike}; rolled back to {path.name} (rollback {record['rollbacks']} of {o.max_rollbacks}), "
        f"skipping {format_samples(skipped)} ({len(skipped) // gb} global batch(es))",
    )  # fmt: skip
    return to_step


def set_aside_newer_checkpoints(run: Run, step: int) -> None:
    """Collective: rename the checkpoints after ``step`` to ``step-N.rolled-back`` (kept, never
    resumed from: they hold the trajectory that led to the spike)."""
    if dist.get_rank() == 0:
        for s, path in run.checkpoints.steps():
            if s > step:
                run.checkpoints.set_aside(path, ROLLED_BACK_SUFFIX)
    dist.barrier()


def refuse_nonfinite_weights(run: Run, where: object) -> None:
    """Collective: raise :class:`~loongtrain.train.checkpoint.CheckpointError` naming the first
    parameter (or optimizer state) of the freshly loaded model that holds a NaN or an infinity."""
    from loongtrain.train.checkpoint import CheckpointError

    name = first_nonfinite_state(run.model, run.optimizer, run.state.device)
    if name is not None:
        raise CheckpointError(
            f"{where} holds non-finite weights (NaN or infinity) in {name}; training on them would make every step "
            f"NaN: set that checkpoint aside (rename it, e.g. to {getattr(where, 'name', 'step-N')}.nonfinite) to "
            f"resume from an older one"
        )


def load_newest_finite(run: Run, at_most: int | None = None) -> tuple[int, Path, dict] | None:
    """Collective: load the newest intact checkpoint (at most step ``at_most``) whose weights and
    optimizer states are all finite; returns (step, folder, trainer state), or None if there is
    none. A checkpoint holding a NaN or an infinity is set aside as ``step-N.nonfinite`` (one
    line says so) and the next older one is tried; with ``checkpoint.on_damaged = "stop"`` it
    raises :class:`~loongtrain.train.checkpoint.CheckpointError` instead."""
    cfg = run.cfg
    while True:
        found = run.checkpoints.find_resumable(cfg.checkpoint.on_damaged, at_most=at_most)
        if found is None:
            return None
        step, path = found
        trainer_state = run.checkpoints.load(path, run.model, run.optimizer, model_shape(run.spec.model))
        name = first_nonfinite_state(run.model, run.optimizer, run.state.device)
        if name is None:
            return step, path, trainer_state
        if cfg.checkpoint.on_damaged == "stop":
            refuse_nonfinite_weights(run, path)
        if dist.get_rank() == 0:
            aside = run.checkpoints.set_aside(path, NONFINITE_SUFFIX)
            say(f"checkpoint {path} holds non-finite values in {name}; kept it as {aside.name}, trying an older one")
        dist.barrier()
        at_most = step - 1


def check_finite_before_save(run: Run, guard: StepGuard, done: int) -> None:
    """Collective, before checkpoint ``done`` is written: raise :class:`GuardStop` if a weight or
    an optimizer state is not finite (the update of step ``done`` made it so: an AdamW epsilon of
    0, a learning rate that overflows); the checkpoint is not written, so no checkpoint of bad
    values ever becomes visible. One reduction per save."""
    name = first_nonfinite_state(run.model, run.optimizer, run.state.device)
    if name is None:
        return
    fix = "lower optim.lr or raise optim.eps (AdamW divides by sqrt(v) + eps)"
    raise GuardStop(
        f"after step {done}: the update left non-finite values (NaN or infinity) in {name}; checkpoint "
        f"step-{done} was not written (a checkpoint must be finite to be trusted); "
        f"{_resume_after(run, fix, guard.weights_step(done + 1))}"
    )


#: the optimizer hyperparameters a resume takes from the config: (config key, param group key, index)
OPTIMIZER_KEYS = (("beta1", "betas", 0), ("beta2", "betas", 1), ("eps", "eps", None),
                  ("weight_decay", "weight_decay", None))  # fmt: skip


def apply_optimizer_config(optimizer, o) -> list[str]:
    """Set the AdamW hyperparameters of ``o`` (the ``[optim]`` section) on every parameter group
    of ``optimizer`` after a state was loaded into it (a checkpoint's saved settings would win
    otherwise); returns one ``optim.KEY OLD -> NEW`` entry per value that changed. The learning
    rate follows the config's schedule at every step, clipping reads ``optim.grad_clip``. Every
    AdamW setting here can change on a loaded state (its moments are kept as they are)."""
    changes: dict[str, str] = {}
    for group in optimizer.param_groups:
        for key, group_key, index in OPTIMIZER_KEYS:
            new = float(getattr(o, key))
            value = group[group_key]
            old = float(value[index] if index is not None else value)
            if old != new:
                changes.setdefault(key, f"optim.{key} {old:g} -> {new:g}")
        group["betas"] = (float(o.beta1), float(o.beta2))
        group["eps"], group["weight_decay"] = float(o.eps), float(o.weight_decay)
    return list(changes.values())


def check_replicas_due(run: Run, step: int) -> None:
    """Collective: the replica check at the start and every ``guard.replica_check_every`` steps;
    raises :class:`GuardStop` naming the parameter and the ranks that disagree."""
    every = run.cfg.guard.replica_check_every
    if not every or (step % every and step != run.start):
        return
    problem = check_replicas(run.model, dist.get_world_size(), run.state.dp, run.cfg.parallel.zero, run.state.device)
    if problem is not None:
        raise GuardStop(
            f"after step {step}: {problem}; stopped (guard.replica_check_every={every}) before it spreads; "
            f"{_resume_after(run, 'check the machines of those ranks')}"
        )
