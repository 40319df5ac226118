"""``loongtrain bench generate FOLDER``: generation on the training layout against the training
forward of the same length and against transformers' ``generate``.

For each prompt length (prompts cut from the Python standard library's sources, tokenized with
the folder's tokenizer) every rank builds the model as ``loongtrain eval`` does, times the
training forward of the prompt (the evaluation's forward: the 2D attention, no autograd), then
greedy generation from it (its prefill and its decode steps), and records the K/V cache each
rank holds. This process then runs transformers' ``generate`` on the same weights (float32,
one process) and compares every new token and every step's logits.

Printed per length: the forward's and the prefill's tokens/s, decode tokens/s, cache bytes per
prompt token (the fullest rank), whether the tokens are transformers' and the largest logits
difference (relative, per step). Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist

from loongtrain.config import ConfigError
from loongtrain.eval.jobs import Target, resolve_target
from loongtrain.generate.cli import check_context
from loongtrain.launch import launch
from loongtrain.tools.harness import sync
from loongtrain.train.cli import split_overrides


def stdlib_tokens(tokenizer, count: int) -> list[int]:
    """``count`` tokens of the Python standard library's sources (in a fixed order)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for path in sorted(root.glob("*.py")):
        ids += tokenizer.encode(path.read_text(errors="replace")).tolist()
        if len(ids) >= count:
            return ids[:count]
    raise ValueError(f"the standard library gave {len(ids)} tokens, fewer than {count}")


def _bench_rank(device: torch.device, target: Target, prompts: list[list[int]], new: int, out: str) -> None:
    from loongtrain.eval.model import build_eval_model, load_eval_weights
    from loongtrain.eval.runner import score_batch
    from loongtrain.generate import Sampling, generate
    from loongtrain.parallel import init_parallel

    state = init_parallel(target.spec.parallel, device=device, zero_scopes=(target.cfg.parallel.zero,))
    model = build_eval_model(device, target.cfg, target.spec, state)
    load_eval_weights(model, device, target.weights, say=lambda m: None)
    rows = []
    for prompt in prompts:
        n = len(prompt)
        ids = torch.tensor([prompt])
        score_batch(model, state, ids, ids)  # warm-up
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        score_batch(model, state, ids, ids)
        sync(device)
        forward_s = time.perf_counter() - t0
        done = generate(model, state, [prompt], Sampling(max_new_tokens=new), keep_logits=True)
        cache = torch.tensor([done.cache_bytes], dtype=torch.float64)
        dist.all_reduce(cache, op=dist.ReduceOp.MAX)
        rows.append({
            "prompt_tokens": n, "forward_s": forward_s, "prefill_s": done.prefill_s, "decode_s": done.decode_s,
            "decode_steps": done.decode_steps, "cache_bytes": int(cache.item()), "tokens": done.tokens[0],
            "logits": torch.stack(done.logits)[:, 0].tolist(),
        })  # fmt: skip
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))


def _hf_reference(folder: str, prompt: list[int], new: int) -> tuple[list[int], torch.Tensor, float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([prompt])
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                         eos_token_id=None)  # fmt: skip
    seconds = time.perf_counter() - t0
    return out.sequences[0, len(prompt) :].tolist(), torch.stack([s[0] for s in out.logits]), seconds


def main(args: argparse.Namespace, extra: list[str]) -> None:
    from loongtrain.eval.plan import find_tokenizer, load_tokenizer

    try:
        target = resolve_target(args.folder, split_overrides(extra), args.nproc, args.nproc)
        source = find_tokenizer(target.cfg, target.run_dir)
        if not target.hf or source is None:
            raise ConfigError(f"{args.folder}: bench generate needs a Hugging Face folder with its tokenizer")
        lengths = [int(n) for n in args.lengths.split(",")]
        check_context(target.spec.model, [[0] * n for n in lengths], args.new, flag="--new")
        tokens = stdlib_tokens(load_tokenizer(source), max(lengths))
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"bench generate: {e}") from None
    prompts = [tokens[:n] for n in lengths]
    out = Path(args.json or f"/tmp/loongtrain-bench-generate-{time.time_ns()}.json")
    launch(_bench_rank, args.nproc, target, prompts, args.new, str(out))
    rows = json.loads(out.read_text())
    p = target.spec.parallel
    print(f"{args.nproc} rank(s), hp={p.hp} cp={p.cp} ring_window={p.ring_window} {p.balance}; {args.new} new tokens, "
          "greedy; against transformers (float32, one process)")  # fmt: skip
    print(f"{'prompt':>7s} {'fwd tok/s':>9s} {'prefill tok/s':>13s} {'prefill/fwd':>11s} {'decode tok/s':>12s} "
          f"{'cache B/tok':>11s} {'hf tok/s':>8s} {'same tokens':>11s} {'max logits err':>14s}")  # fmt: skip
    for row, prompt in zip(rows, prompts):
        hf_tokens, hf_logits, hf_s = _hf_reference(args.folder, prompt, args.new)
        ours = torch.tensor(row["logits"])
        err = max(((ours[t] - hf_logits[t]).norm() / hf_logits[t].norm()).item() for t in range(args.new))
        n = row["prompt_tokens"]
        row.update(same_tokens=row["tokens"] == hf_tokens, max_logits_rel_err=err, hf_generate_s=hf_s)
        print(f"{n:7d} {n / row['forward_s']:9.0f} {n / row['prefill_s']:13.0f} "
              f"{row['forward_s'] / row['prefill_s']:11.2f} {row['decode_steps'] / max(row['decode_s'], 1e-9):12.1f} "
              f"{row['cache_bytes'] / n:11.0f} {(n + args.new) / hf_s:8.0f} {str(row['same_tokens']):>11s} "
              f"{err:14.1e}", flush=True)  # fmt: skip
        row.pop("logits")
    out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {out}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="a Hugging Face model folder with its tokenizer")
    parser.add_argument(
        "--lengths",
        default="512,1024,2048,4096,8176",
        help="prompt lengths, comma-separated (each with --new within the model's context)",
    )
    parser.add_argument("--new", type=int, default=16, help="new tokens per prompt (greedy)")
    parser.add_argument("--nproc", type=int, default=4, help="processes")
    parser.add_argument("--json", default=None, help="write the rows to this file")
    parser.epilog = "Config keys as in training: --parallel.cp 4 --parallel.ring_window 2 ..."
