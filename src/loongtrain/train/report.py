"""Rank 0's view of a run: the start-up description, one record per step in
``metrics.jsonl`` (and TensorBoard), the printed lines and progress bar, and the summary.
Every other rank gets a reporter that does nothing, so the loop never asks its rank."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

from loongtrain.train.metrics import MetricsWriter, plot_curves, read_metrics
from loongtrain.train.run_folder import METRICS_FILE, trim_metrics
from loongtrain.train.tracking import Trackers


@dataclass(frozen=True)
class StepMetrics:
    """What one optimizer step measured (the same on every rank)."""

    step: int  # 1-based number of the step just taken
    loss: float
    accuracy: float
    grad_norm: float
    lr: float
    step_s: float
    tokens_per_s_per_device: float
    tflops_per_device: float
    mfu: float | None
    peak_memory_gib: float
    layouts: str = ""  # hp x cp of rank 0's microbatches (parallel.layout = per_batch)
    # MiB each device sent in the step (mean over devices): the attention's (forward, recompute
    # and backward) and ZeRO's (parameter all-gathers; gradient reduce-scatters and HSDP all-reduces)
    ring_kv_mib: float = 0.0
    ring_dkv_mib: float = 0.0
    all_to_all_mib: float = 0.0
    zero_all_gather_mib: float = 0.0
    zero_reduce_mib: float = 0.0
    guard: str = ""  # the guard's mark: "skipped: non-finite loss", "skipped: spike", "spike" (trained on)
    sources: tuple = ()  # a mixture: each source's SourceNumbers (name, loss, targets, tokens)
    # peak_memory_gib is the process's peak resident memory (on CPU: no allocator statistics),
    # not tensor memory as on a GPU and as memory.activation_checkpoint=auto predicts it
    memory_is_rss: bool = False

    def record(self) -> dict:
        shown = {k: v for k, v in self.__dict__.items() if k not in ("sources", "memory_is_rss")}
        record = {"kind": "train", **shown}
        for numbers in self.sources:
            record.update(source_fields(numbers.name, numbers.loss, numbers.targets, numbers.tokens))
        return record

    def line(self) -> str:
        return (
            (f"[{self.guard.upper()}] " if self.guard else "")
            + f"loss {self.loss:.4f}"
            + _by_source({n.name: n.loss for n in self.sources})
            + f" acc {self.accuracy:.3f} | gnorm {self.grad_norm:.2f} lr {self.lr:.2e} | "
            f"{self.tokens_per_s_per_device:,.0f} tok/s/dev {self.tflops_per_device:.3f} TFLOP/s"
            + (f" MFU {self.mfu:.1%}" if self.mfu is not None else "")
            + (f" | peak RSS {self.peak_memory_gib:.2f} GiB" if self.memory_is_rss
               else f" | mem {self.peak_memory_gib:.2f} GiB")
            + (
                f" | sent ring {self.ring_kv_mib + self.ring_dkv_mib:.1f} a2a {self.all_to_all_mib:.1f}"
                f" zero {self.zero_all_gather_mib + self.zero_reduce_mib:.1f} MiB"
                if self.ring_kv_mib
                + self.ring_dkv_mib
                + self.all_to_all_mib
                + self.zero_all_gather_mib
                + self.zero_reduce_mib
                else ""
            )
        )


def source_fields(name: str, loss: float, targets: int | None = None, tokens: int | None = None) -> dict:
    """A source's numbers as flat ``metrics.jsonl`` keys: ``loss/NAME``, ``targets/NAME``, ``tokens/NAME``;
    a source with no targets in the step or evaluation (its loss NaN) has no ``loss/NAME``."""
    out = {f"loss/{name}": loss} if math.isfinite(loss) and targets != 0 else {}
    if targets is not None:
        out[f"targets/{name}"] = targets
    if tokens is not None:
        out[f"tokens/{name}"] = tokens
    return out


class _Progress:
    """A one-line progress bar on an interactive terminal."""

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


class Reporter:
    """Writes and prints what rank 0 sees; a no-op when ``enabled`` is False.

    ``first_step`` is the step the run (re)starts from: TensorBoard drops its events
    from later steps, as ``metrics.jsonl`` was already cut back to it. ``trackers``: W&B and
    MLflow (:mod:`loongtrain.train.tracking`), sent every record, image and table too.
    """

    def __init__(
        self, run_dir: Path, *, enabled: bool, total_steps: int, log_every: int, first_step: int,
        tensorboard: bool, progress: str, trackers: Trackers | None = None,
    ) -> None:  # fmt: skip
        self.run_dir, self.enabled = run_dir, enabled
        self.total_steps, self.log_every, self.first_step = total_steps, log_every, first_step
        interactive = progress == "on" or (progress == "auto" and sys.stdout.isatty())
        self._progress = _Progress(total_steps, enabled and interactive)
        self._tensorboard = tensorboard
        self._writer = MetricsWriter(run_dir, tensorboard, purge_step=first_step + 1) if enabled else None
        self._trackers = trackers if enabled else None

    @property
    def tensorboard_status(self) -> str:
        """Where the TensorBoard logs go, or why there are none (for the start-up line)."""
        return self._writer.tensorboard_status if self._writer is not None else "off"

    @property
    def metrics_status(self) -> str:
        """The start-up line: where the metrics go."""
        tracked = self._trackers.status if self._trackers is not None else ""
        return f"metrics: {self.run_dir}/metrics.jsonl; {self.tensorboard_status}" + (f"; {tracked}" if tracked else "")

    def _write(self, record: dict) -> None:
        self._writer.write(record)
        if self._trackers is not None:
            self._trackers.log(record)

    def image(self, key: str, path: Path, step: int) -> None:
        """A figure (PNG) for the trackers (W&B, MLflow); the file itself stays in the run folder."""
        if self._trackers is not None and path.exists():
            self._trackers.image(key, path, step)

    def say(self, text: str) -> None:
        if self.enabled:
            self._progress.clear()
            print(text, flush=True)

    def step(self, m: StepMetrics) -> None:
        if not self.enabled:
            return
        self._write(m.record())
        due = m.step % self.log_every == 0 or m.step == self.total_steps or m.step == self.first_step + 1
        if due or m.guard:
            self._progress.clear()
            print(f"step {m.step:5d}/{self.total_steps} {m.line()}", flush=True)
        self._progress.update(m.step, f"loss {m.loss:.4f} acc {m.accuracy:.3f}")

    def rollback(self, to_step: int, record: dict, line: str) -> None:
        """A rollback to the checkpoint of ``to_step``: the steps after it leave ``metrics.jsonl``
        (and TensorBoard), then ``record`` is written and ``line`` printed."""
        if not self.enabled:
            return
        self._writer.close()
        trim_metrics(self.run_dir / METRICS_FILE, to_step)
        self._writer = MetricsWriter(self.run_dir, self._tensorboard, purge_step=to_step + 1)
        self._write(record)
        self._progress.clear()
        print(line, flush=True)

    def record(self, record: dict) -> None:
        """One more record (``kind``, ``step``, numbers) in ``metrics.jsonl`` and TensorBoard."""
        if self.enabled:
            self._write(record)

    def evaluation(
        self, step: int, loss: float, accuracy: float, sources: dict[str, float] | None = None, echo: bool = True
    ) -> None:
        """Record an evaluation (and print it, unless ``echo`` is False: the summary prints the
        final one); ``sources``: a mixture's held-out loss per source."""
        if self.enabled:
            record = {"kind": "eval", "step": step, "loss": loss, "accuracy": accuracy}
            for name, value in (sources or {}).items():
                record.update(source_fields(name, value))
            self._write(record)
            if echo:
                self._progress.clear()
                line = f"held-out loss {loss:.4f}{_by_source(sources)} acc {accuracy:.3f}"
                print(f"step {step:5d}/{self.total_steps} {line}", flush=True)

    def finish(self, *, steps_run: int, wall_s: float, tokens_per_s: float, eval_batches: int, eval_loss: float,
               eval_accuracy: float, chance: float | None, eval_sources: dict[str, float] | None = None,
               ) -> None:  # fmt: skip
        if not self.enabled:
            return
        self._progress.clear()
        self.evaluation(self.total_steps, eval_loss, eval_accuracy, eval_sources, echo=False)
        plot_curves(read_metrics(self.run_dir / "metrics.jsonl"), self.run_dir / "curves.png", chance)
        self.image("curves", self.run_dir / "curves.png", self.total_steps)
        self.close()
        done = (
            f"{steps_run} step(s) in {wall_s:.1f} s ({tokens_per_s:,.0f} tokens/s per device after the first step)"
            if steps_run
            else "no steps to run"
        )
        chance_text = f" (chance {chance:.3f})" if chance is not None else ""
        print(
            f"done: {done}\n"
            f"final evaluation on {eval_batches} held-out batch(es): loss {eval_loss:.4f}{_by_source(eval_sources)}, "
            f"accuracy {eval_accuracy:.3f}{chance_text}\n"
            f"run folder: {self.run_dir} (config.toml, metrics.jsonl, curves.png, checkpoints/)",
            flush=True,
        )

    def close(self, failed: bool = False) -> None:
        """Release the writers and close the tracked runs (``failed``: the run ended with an error)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._trackers is not None:
            self._trackers.close(failed)
            self._trackers = None


def _by_source(sources: dict[str, float] | None) -> str:
    """`` (a 1.234 b 2.345)``: the sources that had targets (a NaN loss: none, left out)."""
    shown = {name: loss for name, loss in (sources or {}).items() if math.isfinite(loss)}
    return " (" + " ".join(f"{name} {loss:.3f}" for name, loss in shown.items()) + ")" if shown else ""
