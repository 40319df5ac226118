"""Does a float8 recipe learn the main job's task without loongtrain? (issue 54)

Trains transformers' ``LlamaForCausalLM`` in the debug model's shape (its own initialisation,
SDPA attention, one process, fp32) on the main job's associative-recall task with the main
job's optimizer settings (AdamW lr 5e-3, betas 0.9/0.95, warm-up 20 steps then cosine to 0.1x,
clip 1.0, 16 x 256 tokens per step), its linears converted to float8 by torchao itself
(``convert_to_float8_training``, the recipe emulated, the output layer kept), and prints the
held-out accuracy at the main job's evaluation steps for fp32 and each recipe.

Nothing of loongtrain's model, parallelism or trainer runs here: only the recall task's
samples (the data, not the code under test) and, with ``--init loongtrain``, the initial
weights ``loongtrain train --run.seed SEED`` starts from (its ``init_value``, moved to
transformers' names). If a recipe lands as far behind fp32 here as in ``loongtrain train``,
the gap is the recipe's on this model, not loongtrain's integration.

    .venv/bin/python scripts/fp8_recipe_check.py [--steps 600] [--recipes fp32 tensorwise ...]
        [--seeds 0 1 2] [--init transformers|loongtrain] [--data-seed 1234]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import torch
import torch.nn.functional as F

from loongtrain.data.recall import RecallTask
from loongtrain.hf.families import hf_config_dict
from loongtrain.model.config import PRESETS

GLOBAL_BATCH, SEQ_LEN, EVAL_BATCHES = 16, 256, 4
LR, MIN_LR_RATIO, WARMUP, CLIP = 5e-3, 0.1, 20, 1.0


def lr_at(step: int, total: int) -> float:
    """Linear warm-up, then cosine decay to MIN_LR_RATIO (written here, not imported)."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / max(1, total - WARMUP))
    return LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def loongtrain_initial_weights(seed: int) -> dict[str, torch.Tensor]:
    """The debug model's initial weights as ``loongtrain train --run.seed seed`` draws them, by HF name."""
    from loongtrain.hf.weights import parameter_map, to_hf_tensor
    from loongtrain.model import build_model
    from loongtrain.model.llama import init_value

    mcfg, mapping = PRESETS["debug"], parameter_map(PRESETS["debug"])
    return {
        mapping[name].hf_name: to_hf_tensor(mcfg, mapping[name], init_value(mcfg, name, p.shape, seed, "cpu"))
        for name, p in build_model(mcfg).named_parameters()
    }


def build(recipe: str, seed: int, init: str) -> torch.nn.Module:
    import transformers
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    raw = hf_config_dict(PRESETS["debug"], None, "float32", 4096)
    config = transformers.AutoConfig.for_model(**raw)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    if init == "loongtrain":
        missing, unexpected = model.load_state_dict(loongtrain_initial_weights(seed), strict=False)
        if unexpected or any(not k.endswith("rotary_emb.inv_freq") for k in missing):
            raise SystemExit(f"fp8_recipe_check: weights do not match: missing {missing}, unexpected {unexpected}")
    if recipe != "fp32":
        f8 = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
        keep = lambda m, fqn: fqn != "lm_head" and m.in_features % 16 == 0 and m.out_features % 16 == 0  # noqa: E731
        convert_to_float8_training(model, config=f8, module_filter_fn=keep)
    return model


def batch(task: RecallTask, first: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [task.sample(first + r, split) for r in range(GLOBAL_BATCH)]
    return torch.stack([t for t, _ in rows]), torch.stack([lab for _, lab in rows])


def loss_and_accuracy(model, tokens, labels) -> tuple[torch.Tensor, float]:
    logits = model(input_ids=tokens).logits.float()  # labels are already aligned with positions
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    mask = labels != -100
    accuracy = (logits.argmax(-1)[mask] == labels[mask]).float().mean().item()
    return loss, accuracy


def train(recipe: str, steps: int, eval_every: int, seed: int, init: str, data_seed: int) -> dict:
    task = RecallTask(seq_len=SEQ_LEN, keys=8, values=8, facts=4, queries=32, seed=data_seed)
    model = build(recipe, seed, init)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    curve, evals, t0 = [], {}, time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps)
        tokens, labels = batch(task, step * GLOBAL_BATCH, "train")
        loss, _ = loss_and_accuracy(model, tokens, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        curve.append(loss.item())
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            with torch.no_grad():
                acc = sum(
                    loss_and_accuracy(model, *batch(task, i * GLOBAL_BATCH, "eval"))[1] for i in range(EVAL_BATCHES)
                )
            evals[step + 1] = acc / EVAL_BATCHES
            acc = evals[step + 1]
            print(
                f"{recipe:20s} seed {seed} step {step + 1:4d} loss {loss.item():.4f} held-out acc {acc:.3f}", flush=True
            )
    return {"recipe": recipe, "seed": seed, "eval_accuracy": evals, "loss": curve, "wall_s": time.perf_counter() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--recipes", nargs="+", default=["fp32", "tensorwise", "rowwise", "rowwise_with_gw_hp"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds of the initial weights")
    p.add_argument(
        "--init", choices=["transformers", "loongtrain"], default="transformers",
        help="initial weights: transformers' own initialisation, or those loongtrain train starts from",
    )  # fmt: skip
    p.add_argument("--data-seed", type=int, default=1234, help="the recall task's seed (data.seed; the main job's)")
    p.add_argument("--json", default=None, help="write every run's curve and accuracies here")
    args = p.parse_args()
    torch.set_num_threads(2)
    runs = [
        train(r, args.steps, args.eval_every, s, args.init, args.data_seed) for s in args.seeds for r in args.recipes
    ]
    print(
        f"\nheld-out accuracy (chance 0.125), {args.steps} steps, transformers + torchao, one process, "
        f"{args.init}'s initial weights, data seed {args.data_seed}:"
    )
    for run in runs:
        accs = " / ".join(f"{a:.3f}" for a in run["eval_accuracy"].values())
        print(f"  {run['recipe']:20s} seed {run['seed']}: {accs}  ({run['wall_s']:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f)


if __name__ == "__main__":
    main()
