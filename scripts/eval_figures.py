"""The pictures of docs/eval.md, redrawn from the `loongtrain eval` outputs that docs/eval.md
lists (eval.json files and a run's metrics.jsonl): small PNGs in docs/img/.

    .venv/bin/python scripts/eval_figures.py
"""

from __future__ import annotations

import json
from pathlib import Path

from loongtrain.eval.report import LossReport, NeedleOutcome, NeedleReport, plot_loss, plot_needles, plot_progress
from loongtrain.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
RUNS, IMG = REPO / "runs", REPO / "docs" / "img"


def needles(*paths: Path) -> NeedleReport:
    """One grid from the needle outcomes of several eval.json files (their lengths side by side)."""
    grids = [json.loads(p.read_text())["needles"] for p in paths]
    outcomes = [NeedleOutcome(**o) for g in grids for o in g["outcomes"]]
    lengths = sorted({n for g in grids for n in g["lengths"]})
    depths = sorted({d for g in grids for d in g["depths"]})
    first = grids[0]
    return NeedleReport(outcomes, lengths, depths, first["needles_per_context"], first["chance"], first["task"])


def loss(path: Path) -> LossReport:
    return LossReport(**json.loads(path.read_text())["loss_by_position"])


def main() -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    main_job = RUNS / "debug_cpu" / "eval"
    plot_needles(needles(main_job / "step-600" / "eval.json"), IMG / "eval_main_needles.png", "main job, step 600")
    smol = RUNS / "eval"
    plot_needles(
        needles(smol / "smollm2-8k" / "eval.json", smol / "smollm2-16k-yarn2" / "eval.json"),
        IMG / "eval_smollm2_needles.png", "SmolLM2-135M-Instruct (16K: YaRN x2)",
    )  # fmt: skip
    curves = [
        ("8K window, plain RoPE", loss(smol / "smollm2-8k" / "eval.json")),
        ("16K window, plain RoPE", loss(smol / "smollm2-16k-plain" / "eval.json")),
        ("16K window, YaRN x2", loss(smol / "smollm2-16k-yarn2" / "eval.json")),
    ]
    plot_loss(curves, IMG / "eval_smollm2_loss.png", "SmolLM2-135M-Instruct: loss by position (Python sources)")
    records = [r for r in read_metrics(RUNS / "extend_recall_cpu" / "metrics.jsonl") if r.get("kind") == "long_context"]
    plot_progress(records, IMG / "eval_extend_progress.png", 0.125)
    print(f"wrote {', '.join(sorted(p.name for p in IMG.glob('eval_*.png')))} in {IMG}")


if __name__ == "__main__":
    main()
