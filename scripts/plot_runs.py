"""Several runs' training loss and held-out accuracy on one figure.

Each argument is ``LABEL=RUN_FOLDER`` (its ``metrics.jsonl``); runs that share a label (e.g. seeds
of one recipe) share a colour. The loss is a moving average over ``--smooth`` steps; the
held-out accuracy is drawn at each evaluation.

    .venv/bin/python scripts/plot_runs.py -o fp8.png fp32=runs/a tensorwise=runs/b tensorwise=runs/c
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read(folder: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(step, loss) of every training step and (step, accuracy) of every evaluation."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "train" and r.get("loss") is not None]
    evals = [(r["step"], r["accuracy"]) for r in rows if r.get("kind") == "eval" and r.get("accuracy") is not None]
    return train, evals


def smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="LABEL=RUN_FOLDER")
    p.add_argument("-o", "--output", required=True, help="the PNG to write")
    p.add_argument("--smooth", type=int, default=20, help="moving average of the loss over this many steps")
    p.add_argument("--title", default="")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    colours: dict[str, str] = {}
    for item in args.runs:
        label, _, folder = item.partition("=")
        if not folder:
            raise SystemExit(f"plot_runs: {item!r} is not LABEL=RUN_FOLDER")
        train, evals = read(Path(folder))
        first = label not in colours
        colours.setdefault(label, f"C{len(colours)}")
        kw = dict(color=colours[label], label=label if first else None, alpha=0.8, linewidth=1)
        ax_loss.plot([s for s, _ in train], smooth([v for _, v in train], args.smooth), **kw)
        ax_acc.plot([s for s, _ in evals], [a for _, a in evals], marker="o", **kw)
    ax_loss.set(xlabel="step", ylabel=f"training loss (mean of {args.smooth} steps)", yscale="log")
    ax_acc.set(xlabel="step", ylabel="held-out accuracy")
    ax_loss.legend()
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
