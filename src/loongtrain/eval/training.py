"""``loongtrain train`` with the ``[eval]`` section: the long-context evaluation every
``eval.every`` steps (and once before the first step of a fresh run), on the training
model as it is sharded, under ``torch.no_grad``.

Rank 0 writes ``<run>/eval/step-N/`` (heatmap, loss curve, tables, JSON), one
``{"kind": "long_context", ...}`` record per evaluation in ``metrics.jsonl`` (and
TensorBoard), ``<run>/eval/progress.png`` (retrieval by length against the step), and
prints one line. The trainer knows nothing of this module: the
``train`` command (:mod:`loongtrain.cli`) hands :func:`after_step` and :func:`check` to
:func:`loongtrain.train.cli.main`.
"""

from __future__ import annotations

import weakref
from pathlib import Path

from loongtrain.config import TrainConfig
from loongtrain.eval.plan import EvalPlan, NeedleBuilder, make_plan
from loongtrain.eval.report import length_label, plot_progress, write_outputs
from loongtrain.eval.runner import run_generated, run_loss_by_position, run_needles
from loongtrain.train.metrics import read_metrics
from loongtrain.train.report import Reporter
from loongtrain.train.run_folder import METRICS_FILE
from loongtrain.train.spec import RunSpec
from loongtrain.train.trainer import Beat, Run

EVAL_DIR = "eval"

# the plan and context builder of the training run in this process (the tokenizer is read
# once), held beside a weak reference to its run: an id() would match a later run that
# reused the address of a collected one
_PLAN: tuple[weakref.ref[Run], EvalPlan, NeedleBuilder] | None = None


def check(cfg: TrainConfig, spec: RunSpec, world: int) -> None:
    """The ``[eval]`` section's checks for this layout, before any process starts."""
    if cfg.eval.every:
        make_plan(cfg, spec.model, spec.parallel.hp, spec.parallel.cp, Path(cfg.run.output_dir))


def _plan(run: Run) -> tuple[EvalPlan, NeedleBuilder]:
    global _PLAN
    if _PLAN is None or _PLAN[0]() is not run:
        cfg, spec = run.cfg, run.spec
        plan = make_plan(cfg, spec.model, spec.parallel.hp, spec.parallel.cp, Path(cfg.run.output_dir))
        _PLAN = (weakref.ref(run), plan, NeedleBuilder(plan))
    return _PLAN[1], _PLAN[2]


def after_step(run: Run, done: int, reporter: Reporter, beat: Beat) -> None:
    """Collective: the evaluation when ``done`` steps are a multiple of ``eval.every``."""
    every = run.cfg.eval.every
    if not every or done % every:
        return
    plan, builder = _plan(run)

    def progress(i: int, n: int) -> None:
        beat(done, f"long-context evaluation {i}/{n}")

    beat(done, "long-context evaluation")
    was_training = run.model.training
    run.model.eval()
    try:
        needles = run_needles(run.model, run.state, plan, builder, progress)
        loss = run_loss_by_position(run.model, run.state, plan, progress)
        generated = run_generated(run.model, run.state, plan, builder, progress)
    finally:
        run.model.train(was_training)
    if not reporter.enabled:
        return
    out = Path(run.cfg.run.output_dir) / EVAL_DIR / f"step-{done}"
    meta = {"step": done, "plan": plan.describe(), "layout": str(run.spec.parallel)}
    paths = write_outputs(out, needles, loss, meta, f"step {done}", generated)
    record = {
        "kind": "long_context", "step": done, "needle_accuracy": needles.accuracy,
        "effective_context": needles.effective_context,
        **{f"needle_accuracy_{length_label(n)}": a for n, a in needles.by_length.items()},
        **{f"generated_{r.task}": r.accuracy for r in generated},
    }  # fmt: skip
    if loss is not None and loss.overall is not None:
        record["loss_by_position_overall"] = loss.overall
        means = [r["mean_loss"] for r in loss.rows if r["mean_loss"] is not None]
        record["loss_by_position_first"], record["loss_by_position_last"] = means[0], means[-1]
    reporter.record(record)
    run_dir = Path(run.cfg.run.output_dir)
    history = [r for r in read_metrics(run_dir / METRICS_FILE) if r.get("kind") == "long_context"]
    plot_progress(history, run_dir / EVAL_DIR / "progress.png", needles.chance)
    reporter.image("long_context/needles", Path(paths["needles"]), done)  # the heatmap, for W&B and MLflow
    reporter.image("long_context/progress", run_dir / EVAL_DIR / "progress.png", done)
    by_length = ", ".join(f"{length_label(n)} {a:.2f}" for n, a in needles.by_length.items())
    eff = needles.effective_context
    reporter.say(
        f"step {done} long-context eval: needle retrieval {by_length} (chance {needles.chance:.2g}), effective "
        f"context {length_label(eff) if eff else 'none'}"
        + (f"; loss by position {record['loss_by_position_first']:.3f} -> {record['loss_by_position_last']:.3f}"
           if "loss_by_position_first" in record else "")
        + "".join(f"; generated {r.task} {r.accuracy:.2f}" for r in generated)
        + f" ({needles.seconds + (loss.seconds if loss else 0) + sum(r.seconds for r in generated):.1f} s)"
        + f" -> {paths['needles']}"
    )  # fmt: skip
