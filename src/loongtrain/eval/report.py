"""What an evaluation reports: the needle grid (accuracy by depth and length, the effective
context), the loss by position, as text tables, JSON and PNG figures. Pure (no torch)."""

from __future__ import annotations

import json
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

#: Retrieval accuracy that counts as "effective" (RULER compares with a fixed threshold too).
EFFECTIVE_THRESHOLD = 0.9


@dataclass(frozen=True)
class NeedleOutcome:
    """One needle of one context: where it was and whether every answer token was the argmax."""

    length: int
    depth: float  # asked depth, 0..1
    sample: int
    key: str
    value: str
    position: int  # its first token in the context
    placed_depth: float  # where it really starts, 0..1 of the filler
    correct: bool  # exact match: every answer token is the argmax
    answer_loss: float  # summed loss of its answer tokens (nats)
    answer_tokens: int


def accuracy_grid(
    outcomes: Sequence, value: Callable = operator.attrgetter("correct")
) -> dict[tuple[float, int], float]:
    """Mean ``value`` of the outcomes per (depth, length): the fraction of needles retrieved."""
    cells: dict[tuple[float, int], list[float]] = {}
    for o in outcomes:
        cells.setdefault((o.depth, o.length), []).append(value(o))
    return {cell: sum(hits) / len(hits) for cell, hits in sorted(cells.items())}


def accuracy_by_length(outcomes: Sequence, value: Callable = operator.attrgetter("correct")) -> dict[int, float]:
    """Mean ``value`` of the outcomes per length."""
    by: dict[int, list[float]] = {}
    for o in outcomes:
        by.setdefault(o.length, []).append(value(o))
    return {length: sum(h) / len(h) for length, h in sorted(by.items())}


def grid_lines(grid: dict[tuple[float, int], float], by_length: dict[int, float], lengths, depths) -> list[str]:
    """A depth x length table as text: the header, a row per depth and the ``all`` row."""
    width = max(6, *(len(length_label(n)) + 1 for n in lengths))
    lines = ["depth " + "".join(f"{length_label(n):>{width}}" for n in lengths)]
    for d in depths:
        lines.append(f"{d:5.0%} " + "".join(f"{grid.get((d, n), math.nan):>{width}.2f}" for n in lengths))
    lines.append("all   " + "".join(f"{by_length.get(n, math.nan):>{width}.2f}" for n in lengths))
    return lines


def effective_context(by_length: dict[int, float], threshold: float = EFFECTIVE_THRESHOLD) -> int:
    """The longest evaluated length up to which retrieval stays at or above ``threshold`` at
    every evaluated length (0: already below it at the shortest)."""
    best = 0
    for length in sorted(by_length):
        if by_length[length] < threshold:
            break
        best = length
    return best


def length_label(n: int) -> str:
    """``1024`` -> ``1K``, ``1536`` -> ``1.5K``, ``256`` -> ``256``."""
    if n >= 1024**2 and n % (1024**2 // 2) == 0:
        return f"{n / 1024**2:g}M"
    if n >= 1024 and n % 512 == 0:
        return f"{n / 1024:g}K"
    return str(n)


@dataclass(frozen=True)
class NeedleReport:
    """The needle grid of one model: every outcome and the summary figures."""

    outcomes: list[NeedleOutcome]
    lengths: list[int]
    depths: list[float]
    needles: int  # per context
    chance: float
    task: str
    seconds: float = 0.0

    @property
    def grid(self) -> dict[tuple[float, int], float]:
        return accuracy_grid(self.outcomes)

    @property
    def by_length(self) -> dict[int, float]:
        return accuracy_by_length(self.outcomes)

    @property
    def accuracy(self) -> float:
        return sum(o.correct for o in self.outcomes) / max(1, len(self.outcomes))

    @property
    def effective_context(self) -> int:
        return effective_context(self.by_length)

    @property
    def answer_loss(self) -> float:
        """Mean loss per answer token (nats): a graded view of the same answers."""
        return sum(o.answer_loss for o in self.outcomes) / max(1, sum(o.answer_tokens for o in self.outcomes))

    def table(self) -> str:
        """The depth x length grid as text, with the effective context."""
        lines = [
            f"needle retrieval ({self.task}, {self.needles} needle(s) per context, exact match of every answer "
            f"token; chance {self.chance:.3g}): depth x length",
            *grid_lines(self.grid, self.by_length, self.lengths, self.depths),
        ]
        eff = self.effective_context
        lines.append(
            f"effective context: {length_label(eff) if eff else 'none'} (retrieval >= {EFFECTIVE_THRESHOLD:.0%} at "
            f"every length up to it); overall {self.accuracy:.3f} over {len(self.outcomes)} needles, "
            f"answer loss {self.answer_loss:.3f} nats per token"
        )
        return "\n".join(lines)

    def summary(self) -> dict:
        return {
            "task": self.task,
            "needles_per_context": self.needles,
            "lengths": self.lengths,
            "depths": self.depths,
            "chance": self.chance,
            "accuracy": self.accuracy,
            "answer_loss": self.answer_loss,
            "effective_context": self.effective_context,
            "threshold": EFFECTIVE_THRESHOLD,
            "accuracy_by_length": {str(k): v for k, v in self.by_length.items()},
            "grid": [{"depth": d, "length": n, "accuracy": a} for (d, n), a in self.grid.items()],
            "seconds": self.seconds,
        }

    def to_json(self) -> dict:
        return {**self.summary(), "outcomes": [asdict(o) for o in self.outcomes]}


@dataclass(frozen=True)
class LossReport:
    """The loss by position over held-out windows."""

    rows: list[dict]  # per bucket: lo, hi, mean_loss, tokens
    length: int
    windows: int
    source: str
    overall: float | None
    crosses_documents: bool
    seconds: float = 0.0

    def table(self) -> str:
        lines = [
            f"loss by position ({self.windows} window(s) of {length_label(self.length)} tokens from {self.source}"
            f"{'; windows cross documents' if self.crosses_documents else ''}): mean next-token loss",
            f"{'positions':>17s} {'loss':>7s} {'tokens':>8s}",
        ]
        for r in self.rows:
            loss = "    -  " if r["mean_loss"] is None else f"{r['mean_loss']:7.3f}"
            lines.append(f"{r['lo']:>8d}-{r['hi'] - 1:<8d} {loss} {r['tokens']:>8d}")
        if self.overall is not None:
            lines.append(f"overall {self.overall:.4f} nats per token")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class GeneratedOutcome:
    """One prompt of a generated task: what the model wrote and its score."""

    task: str
    length: int
    depth: float
    sample: int
    answers: tuple[str, ...]
    generated: str
    score: float  # fraction of the answers found in what it wrote (RULER's string_match_all)
    position: int  # where the first needle (or assignment) starts


@dataclass(frozen=True)
class GeneratedReport:
    """One generated task's outcomes over the grid."""

    task: str
    outcomes: list[GeneratedOutcome]
    lengths: list[int]
    depths: list[float]
    new_tokens: int
    seconds: float = 0.0

    @property
    def grid(self) -> dict[tuple[float, int], float]:
        return accuracy_grid(self.outcomes, operator.attrgetter("score"))

    @property
    def by_length(self) -> dict[int, float]:
        return accuracy_by_length(self.outcomes, operator.attrgetter("score"))

    @property
    def accuracy(self) -> float:
        return sum(o.score for o in self.outcomes) / max(1, len(self.outcomes))

    @property
    def effective_context(self) -> int:
        return effective_context(self.by_length)

    def table(self) -> str:
        lines = [
            f"{self.task} (generated, greedy, up to {self.new_tokens} tokens; score: answers found in the output): "
            "depth x length",
            *grid_lines(self.grid, self.by_length, self.lengths, self.depths),
        ]
        eff = self.effective_context
        lines.append(
            f"effective context: {length_label(eff) if eff else 'none'}; overall {self.accuracy:.3f} over "
            f"{len(self.outcomes)} prompts"
        )
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "task": self.task, "accuracy": self.accuracy, "effective_context": self.effective_context,
            "new_tokens": self.new_tokens, "lengths": self.lengths, "depths": self.depths,
            "accuracy_by_length": {str(k): v for k, v in self.by_length.items()},
            "grid": [{"depth": d, "length": n, "score": a} for (d, n), a in self.grid.items()],
            "seconds": self.seconds, "outcomes": [asdict(o) for o in self.outcomes],
        }  # fmt: skip


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_needles(report: NeedleReport, path: Path, title: str = "") -> None:
    """The depth x length heatmap (green: retrieved) into a small PNG."""
    eff = report.effective_context
    subtitle = f"exact match; effective context {length_label(eff) if eff else 'none'}; chance {report.chance:.2g}"
    plot_grid(report.grid, report.lengths, report.depths, path, f"{title or 'needle retrieval'}\n{subtitle}")


def plot_grid(
    grid: dict[tuple[float, int], float], lengths: list[int], depths: list[float], path: Path, title: str
) -> None:
    """A depth x length heatmap of values in [0, 1] (green: 1) into a small PNG."""
    plt = _pyplot()
    data = [[grid.get((d, n), math.nan) for n in lengths] for d in depths]
    fig, ax = plt.subplots(figsize=(1.2 + 0.75 * len(lengths), 1.3 + 0.42 * len(depths)))
    image = ax.imshow(data, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    for i, row in enumerate(data):
        for j, value in enumerate(row):
            if not math.isnan(value):
                ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(lengths)), [length_label(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title, fontsize=8)
    fig.colorbar(image, ax=ax, fraction=0.05, pad=0.03)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_loss(reports: list[tuple[str, LossReport]], path: Path, title: str = "") -> None:
    """Mean loss per position bucket (log position axis), one line per labelled report."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    for label, report in reports:
        xs = [math.sqrt(max(1, r["lo"]) * max(1, r["hi"] - 1)) for r in report.rows if r["mean_loss"] is not None]
        ys = [r["mean_loss"] for r in report.rows if r["mean_loss"] is not None]
        ax.plot(xs, ys, "o-", ms=3, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("position in the window (token)")
    ax.set_ylabel("mean next-token loss (nats)")
    ax.set_title(title or "loss by position", fontsize=9)
    if len(reports) > 1 or reports[0][0]:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_progress(records: list[dict], path: Path, chance: float | None = None) -> None:
    """Needle retrieval by length against the training step (the ``long_context`` records of
    ``metrics.jsonl``): what a context-extension run shows rising."""
    plt = _pyplot()
    records = sorted(records, key=lambda r: r["step"])
    keys = sorted(
        {k for r in records for k in r if k.startswith("needle_accuracy_")},
        key=lambda k: float(k.rsplit("_", 1)[1].replace("K", "e3").replace("M", "e6")),
    )
    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    for key in keys:
        points = [(r["step"], r[key]) for r in records if key in r]
        ax.plot(*zip(*points), "o-", ms=3, label=f"{key.rsplit('_', 1)[1]} tokens")
    if chance:
        ax.axhline(chance, color="grey", ls="--", lw=1, label=f"chance {chance:.2g}")
    ax.set(xlabel="training step", ylabel="needles retrieved (exact match)", ylim=(0, 1.02))
    ax.set_title("needle retrieval during training", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_outputs(
    out: Path, needles: NeedleReport | None, loss: LossReport | None, meta: dict, title: str,
    generated: list[GeneratedReport] = (),
) -> dict:  # fmt: skip
    """``eval.json``, ``needles.png``/``needles.txt``, ``loss_by_position.png``/``.txt`` and
    ``<task>.png``/``.txt`` for each generated task into ``out``; returns the paths written by name."""
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, str] = {}
    data: dict = {"meta": meta}
    for report in generated:
        data.setdefault("generated", {})[report.task] = report.to_json()
        (out / f"{report.task}.txt").write_text(report.table() + "\n")
        eff = report.effective_context
        subtitle = f"generated; effective context {length_label(eff) if eff else 'none'}"
        plot_grid(report.grid, report.lengths, report.depths, out / f"{report.task}.png",
                  f"{title}: {report.task}\n{subtitle}")  # fmt: skip
        written[report.task] = str(out / f"{report.task}.png")
    if needles is not None:
        data["needles"] = needles.to_json()
        (out / "needles.txt").write_text(needles.table() + "\n")
        plot_needles(needles, out / "needles.png", title)
        written["needles"] = str(out / "needles.png")
    if loss is not None:
        data["loss_by_position"] = loss.to_json()
        (out / "loss_by_position.txt").write_text(loss.table() + "\n")
        plot_loss([("", loss)], out / "loss_by_position.png", title)
        written["loss"] = str(out / "loss_by_position.png")
    (out / "eval.json").write_text(json.dumps(data, indent=1) + "\n")
    written["json"] = str(out / "eval.json")
    return written
