"""How far does the main job's layout move a float8 run, after 1 step and after N? (issue 54)

Trains the main job (``configs/debug_cpu.toml``: the recall task, fp32 compute) with fp32 and
each float8 recipe (emulated) twice: on the main job's layout (4 processes, hp 2 x cp 2 window
2, sc++, ZeRO over all ranks) and in one process (hp 1 x cp 1: the same global batch, the same
samples in the same order). After 1 step and after ``--steps`` steps it compares the
parameters (``loongtrain export``'s safetensors, fp32), per tensor ``|a - b| / |b|``, the
largest over the tensors:

- layout: the main layout against one process, same recipe (fp32's row is the reordering of
  fp32 sums alone, grown over the steps: the yardstick for the float8 rows);
- float8: one process of the recipe against one process in fp32.

and prints the last step's loss and the held-out accuracy of each run. Run it alone on the
machine (it runs ``loongtrain train`` 16 times; about 15 minutes on 2 cores at 200 steps).

    .venv/bin/python scripts/fp8_layout_drift.py [--steps 200] [--out DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
LOONGTRAIN = [sys.executable, "-m", "loongtrain"]
LAYOUTS = {"main": ["--nproc", "4"], "one": ["--nproc", "1", "--parallel.hp", "1", "--parallel.cp", "1",
                                            "--parallel.ring_window", "1"]}  # fmt: skip
RECIPES = ["fp32", "tensorwise", "rowwise", "rowwise_with_gw_hp"]


def run(recipe: str, layout: str, steps: int, folder: Path) -> dict:
    """Train, export and read back one run: its parameters, losses and held-out accuracy."""
    if not (folder / "hf").is_dir():
        float8 = [] if recipe == "fp32" else ["--float8.enabled", "true", "--float8.recipe_name", recipe,
                                              "--float8.emulate", "true"]  # fmt: skip
        cmd = [
            *LOONGTRAIN, "train", "--config", str(ROOT / "configs" / "debug_cpu.toml"), *LAYOUTS[layout], *float8,
            "--run.steps", str(steps), "--run.output_dir", str(folder), "--run.eval_every", str(steps),
            "--run.progress", "off", "--eval.every", "0", "--checkpoint.every", "0", "--checkpoint.resume", "false",
            "--checkpoint.save_final", "true",
        ]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        subprocess.run([*LOONGTRAIN, "export", str(folder), "-o", str(folder / "hf")], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
    params: dict[str, torch.Tensor] = {}
    for f in sorted((folder / "hf").glob("*.safetensors")):
        params.update(load_file(f))
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in lines if r["kind"] == "train"]
    evals = [r["accuracy"] for r in lines if r["kind"] == "eval"]
    return {"params": params, "losses": losses, "eval_accuracy": evals[-1] if evals else None}


def rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest ``|a - b| / |b|`` over the tensors (float64)."""
    return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm()).item() for k in b)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--recipes", nargs="+", default=RECIPES)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "fp8_layout_drift")
    p.add_argument("--json", default=None, help="also write the table and every run's losses here")
    args = p.parse_args()
    recipes = ["fp32", *[r for r in args.recipes if r != "fp32"]]
    rows, curves = [], {}
    for steps in (1, args.steps):
        runs = {(r, lay): run(r, lay, steps, args.out / f"{r}-{lay}-{steps}") for r in recipes for lay in LAYOUTS}
        for r in recipes:
            main_run, one = runs[(r, "main")], runs[(r, "one")]
            rows.append({
                "recipe": r, "steps": steps, "layout_vs_one_process": rel(main_run["params"], one["params"]),
                "float8_vs_fp32": rel(one["params"], runs[("fp32", "one")]["params"]),
                "loss": {lay: runs[(r, lay)]["losses"][-1] for lay in LAYOUTS},
                "eval_accuracy": {lay: runs[(r, lay)]["eval_accuracy"] for lay in LAYOUTS},
            })  # fmt: skip
            if steps == args.steps:
                curves[r] = {lay: runs[(r, lay)]["losses"] for lay in LAYOUTS}
    print("parameters after N steps, largest |a - b| / |b| over the tensors; main: hp 2 x cp 2 window 2 on 4 processes")
    head = f"{'recipe':20s} {'steps':>5s} {'main vs 1 proc':>14s} {'1 proc vs fp32':>14s}"
    print(f"{head}  loss main / 1 proc  held-out acc main / 1 proc")
    for row in rows:
        loss, acc = row["loss"], row["eval_accuracy"]
        accs = " / ".join("-" if acc[lay] is None else f"{acc[lay]:.3f}" for lay in LAYOUTS)
        print(
            f"{row['recipe']:20s} {row['steps']:5d} {row['layout_vs_one_process']:14.2e} {row['float8_vs_fp32']:14.2e}"
            f"  {loss['main']:.4f} / {loss['one']:.4f}  {accs}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "curves": curves}, indent=1))


if __name__ == "__main__":
    main()
