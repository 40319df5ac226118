"""``loongtrain generate TARGET``: generate from prompts with a run's checkpoint or a Hugging
Face folder, on the ranks and layouts of training (the prefill with the 2D / double-ring
attention, the K/V cache sharded over the ranks).

TARGET and the config keys are as for ``loongtrain eval`` (a run folder or a Hugging Face
folder; ``--parallel.cp 4``, ...). Prompts: ``--prompt TEXT`` (repeatable), ``--prompts FILE``
(a JSONL file of ``{"prompt": ...}`` or ``{"messages": [...]}`` records, or a text file that
is one prompt), or ``--prompt-ids`` for a model without a tokenizer; ``--chat`` sends text
prompts as a user turn through the tokenizer's chat template. Everything is checked in this
process first (the tokenizer, each prompt against the model's context, the K/V cache
against the devices' memory); rank 0 prints each completion and one line of speeds, and
``--out`` writes them as JSONL.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from loongtrain.config import ConfigError, TrainConfig
from loongtrain.eval.jobs import USER_ERRORS, Target, resolve_target, run_job, world_sizes
from loongtrain.eval.model import Weights
from loongtrain.eval.plan import find_tokenizer, load_tokenizer
from loongtrain.generate.sampling import Sampling, cut_at_stop, stop_at_strings
from loongtrain.model.config import ModelConfig
from loongtrain.train.cli import split_overrides
from loongtrain.train.spec import RunSpec

PREFIX = "loongtrain generate: "
GENERATION_CONFIG = "generation_config.json"


def say(message: str) -> None:
    print(PREFIX + message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class GenerateJob:
    """Everything the workers need (picklable): the model, the prompts as token ids, how to sample."""

    cfg: TrainConfig
    spec: RunSpec
    weights: Weights
    prompts: tuple[tuple[int, ...], ...]
    sampling: Sampling
    tokenizer: str | None  # decodes the completions (None: print the ids)
    out: str | None
    stop_strings: tuple[str, ...] = ()  # a completion ends where one of these appears in its text

    def run(self, device) -> dict:
        return generate_job(device, self)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="a run folder (its checkpoints) or a Hugging Face model folder")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    parser.add_argument("--prompts", default=None, help="a JSONL file of prompt / messages records, or a text file")
    parser.add_argument("--prompt-ids", action="append", default=[], help="a prompt as token ids: '1 2 3' (repeatable)")
    parser.add_argument("--chat", action="store_true", help="text prompts as a user turn of the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sample at this temperature")
    parser.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of this probability")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed (the same draws on every rank)")
    parser.add_argument(
        "--stop", action="append", default=[], help="text (or a token id) that ends a completion (repeatable)"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the tokenizer's end token")
    parser.add_argument("--tokenizer", default=None, help="the tokenizer (default: the model's; sets eval.tokenizer)")
    parser.add_argument("--step", type=int, default=None, help="a run's checkpoint step-N (default: newest intact)")
    parser.add_argument("--config", default=None, help="TOML config for a Hugging Face folder (a run has its own)")
    parser.add_argument("--nproc", type=int, default=1, help="processes (ignored under torchrun)")
    parser.add_argument("--out", default=None, help="write the completions to this JSONL file")
    parser.add_argument("--debug", action="store_true", help="full tracebacks")
    parser.epilog = "Config keys as in training: --section.key value (e.g. --parallel.cp 4 --parallel.ring_window 2)."


def read_prompt_records(path: str) -> list[str | list[dict]]:
    """The prompts of a file: a JSONL file's ``prompt`` (text) or ``messages`` (a chat) records,
    or a whole text file as one prompt."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--prompts {path}: no such file")
    if file.suffix != ".jsonl":
        return [file.read_text(encoding="utf-8")]
    records = []
    for n, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"--prompts {path}: line {n} is not JSON ({e})") from None
        if isinstance(record, dict) and isinstance(record.get("messages"), list):
            records.append(record["messages"])
        elif isinstance(record, dict) and isinstance(record.get("prompt"), str):
            records.append(record["prompt"])
        else:
            raise ConfigError(f'--prompts {path}: line {n} has neither a "prompt" string nor a "messages" list')
    return records


def encode_prompts(tokenizer, texts: list[str | list[dict]], chat: bool) -> list[list[int]]:
    """Token ids of each prompt: a chat (messages, or text with ``chat``) through the chat
    template with the assistant's generation prompt, plain text with the tokenizer's special
    tokens (as ``tokenizer(text)`` gives them)."""
    out = []
    for text in texts:
        if isinstance(text, list) or chat:
            if getattr(tokenizer, "chat_template", None) is None:
                raise ConfigError(f"tokenizer {tokenizer.name} has no chat template; drop --chat or use a chat model")
            messages = text if isinstance(text, list) else [{"role": "user", "content": text}]
            out.append(tokenizer.encode(tokenizer.render_chat(messages, add_generation_prompt=True)).tolist())
        elif hasattr(tokenizer, "encode_special"):
            out.append(list(tokenizer.encode_special(text)))
        else:
            out.append(tokenizer.encode(text).tolist())
    return out


def stop_ids(tokenizer, target: Path, stops: list[str], ignore_eos: bool) -> tuple[int, ...]:
    """The tokens that end a prompt: the tokenizer's end token and a Hugging Face folder's
    ``generation_config.json`` ones (unless ``ignore_eos``), and each ``--stop`` given as an id."""
    found: list[int] = []
    if not ignore_eos and tokenizer is not None:
        if tokenizer.eos is not None:
            found.append(int(tokenizer.eos))
        config = target / GENERATION_CONFIG
        if config.is_file():
            eos = json.loads(config.read_text()).get("eos_token_id")
            found += [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    for stop in stops:
        if stop.isdigit():
            found.append(int(stop))
        elif tokenizer is None:
            raise ConfigError(f"--stop {stop!r}: without a tokenizer give stop tokens as ids")
    return tuple(dict.fromkeys(found))


def check_context(model: ModelConfig, prompts: list[list[int]], max_new: int, flag: str = "--max-new-tokens") -> None:
    """Raise ConfigError if a prompt and its new tokens reach beyond the model's context (``flag`` names the limit)."""
    if not model.max_positions:
        return
    for i, prompt in enumerate(prompts):
        need = len(prompt) + max_new
        if need > model.max_positions:
            scaled = model.rope_scaling is not None
            fix = (
                f"shorten it or lower {flag}"
                if scaled
                else f"shorten it, lower {flag}, or extend the context (model.rope_scaling, docs/training.md)"
            )
            raise ConfigError(
                f"prompt {i} has {len(prompt):,} tokens and {flag} {max_new} asks for {need:,} positions, "
                f"beyond the model's context of {model.max_positions:,}"
                f"{' (RoPE scaled)' if scaled else ' (no RoPE scaling)'}; {fix}"
            )


def cache_bytes_per_rank(model: ModelConfig, spec: RunSpec, tokens: int, elem_bytes: int) -> int:
    """The K/V cache one rank holds for ``tokens`` tokens of prompts and new tokens: every
    layer's key and value heads of its head group for its context rank's share (a window
    keeps at most its length)."""
    hp, cp = spec.parallel.hp, spec.parallel.cp
    kv_heads = max(model.n_kv_heads, hp) // hp
    return model.n_layers * 2 * kv_heads * model.head_dim * elem_bytes * math.ceil(tokens / cp)


def layer_cache_bytes_per_rank(model: ModelConfig, spec: RunSpec, tokens: int, prompts: int, elem_bytes: int) -> int:
    """:func:`cache_bytes_per_rank` with each layer's own window (a sliding layer keeps at most its
    window per prompt; layer kinds)."""
    one_layer = cache_bytes_per_rank(model, spec, tokens, elem_bytes) // model.n_layers
    return sum(
        min(one_layer, cache_bytes_per_rank(model, spec, prompts * w, elem_bytes) // model.n_layers) if w else one_layer
        for w in model.windows
    )


def device_memory_bytes(device: str, local_ranks: int) -> tuple[int, str]:
    """Memory one rank may use, and what it is: a GPU's total, or this host's available memory
    shared by its local ranks."""
    import torch

    if device in ("cuda", "auto") and torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks:
        return torch.cuda.get_device_properties(0).total_memory, "GPU memory"
    available = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return available // local_ranks, f"host memory available to each of {local_ranks} local rank(s)"


def check_cache_fits(target: Target, prompts: list[list[int]], max_new: int, local: int) -> None:
    """Raise ConfigError if the model and the K/V cache of these prompts do not fit a rank's memory."""
    import torch

    spec = target.spec
    elem = torch.finfo(spec.param_dtype).bits // 8
    tokens = sum(len(p) for p in prompts) + len(prompts) * max_new
    cache = layer_cache_bytes_per_rank(spec.model, spec, tokens, len(prompts), elem)
    weights = spec.model.num_params() * elem  # gathered for the generation
    budget, what = device_memory_bytes(target.cfg.run.device, local)
    if weights + cache > budget:
        gib = 2**30
        raise ConfigError(
            f"the K/V cache of {len(prompts)} prompt(s) and {max_new} new tokens each needs {cache / gib:.2f} GiB per "
            f"rank beside the model's {weights / gib:.2f} GiB, more than the {budget / gib:.2f} GiB of {what}; lower "
            f"--max-new-tokens, give fewer or shorter prompts, or use more ranks (--nproc, a larger parallel.cp)"
        )


def prepare(args: argparse.Namespace, extra: list[str], world: int, local: int) -> GenerateJob:
    """Resolve and check everything (no process group); raises a user error in one line."""
    overrides = split_overrides(extra) + ([f"eval.tokenizer={args.tokenizer}"] if args.tokenizer else [])
    target = resolve_target(args.target, overrides, world, local, config=args.config, step=args.step)
    texts: list[str | list[dict]] = list(args.prompt) + (read_prompt_records(args.prompts) if args.prompts else [])
    ids = [[int(t) for t in p.replace(",", " ").split()] for p in args.prompt_ids]
    if not texts and not ids:
        raise ConfigError("no prompt: give --prompt TEXT, --prompts FILE or --prompt-ids '1 2 3'")
    source = find_tokenizer(target.cfg, target.run_dir)
    tokenizer = load_tokenizer(source) if source is not None else None
    if texts and tokenizer is None:
        raise ConfigError(
            f"{target.path} has no tokenizer (no tokenizer.json / tokenizer_config.json there, and none named by "
            f"model.init_from or eval.tokenizer): pass --tokenizer FOLDER, or the prompts as --prompt-ids"
        )
    prompts = (encode_prompts(tokenizer, texts, args.chat) if texts else []) + ids
    sampling = Sampling(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        stop_ids=stop_ids(tokenizer, target.path, args.stop, args.ignore_eos),
    )  # fmt: skip
    from loongtrain.generate.engine import check_prompts

    check_prompts(prompts, target.spec.model.vocab_size)
    check_context(target.spec.model, prompts, args.max_new_tokens)
    check_cache_fits(target, prompts, args.max_new_tokens, local)
    strings = tuple(s for s in args.stop if not s.isdigit())
    return GenerateJob(
        target.cfg, target.spec, target.weights, tuple(map(tuple, prompts)), sampling, source, args.out, strings
    )


def generate_job(device, job: GenerateJob) -> dict:
    """Collective: build, load, generate (each replica its share of the prompts); rank 0 prints
    the completions and the speeds and writes ``out``."""
    import torch.distributed as dist

    from loongtrain.eval.model import build_eval_model, load_eval_weights
    from loongtrain.generate.engine import generate
    from loongtrain.parallel import init_parallel

    state = init_parallel(job.spec.parallel, device=device, zero_scopes=(job.cfg.parallel.zero,))
    model = build_eval_model(device, job.cfg, job.spec, state)
    rank = dist.get_rank()
    loaded = load_eval_weights(model, device, job.weights, say=say if rank == 0 else lambda m: None)
    mine = list(range(state.coords.dp, len(job.prompts), state.dp)) or [0]  # a replica without a prompt repeats one
    stop_when = stop_at_strings(load_tokenizer(job.tokenizer), job.stop_strings) if job.stop_strings else None
    done = generate(model, state, [list(job.prompts[i]) for i in mine], job.sampling, stop_when=stop_when)
    results = [(i, tokens, stopped) for i, tokens, stopped in zip(mine, done.tokens, done.stopped)]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (results, done))
    if rank != 0:
        return {}
    by_prompt = {i: (tokens, stopped) for part, _ in gathered for i, tokens, stopped in part}
    _report(job, loaded, state, [by_prompt[i] for i in range(len(job.prompts))], [d for _, d in gathered])
    return {}


def _report(job: GenerateJob, loaded: str, state, outputs: list, runs: list) -> None:
    tokenizer = load_tokenizer(job.tokenizer) if job.tokenizer else None
    records = []
    for i, (tokens, stopped) in enumerate(outputs):
        body = tokens[:-1] if stopped and tokens[-1] in job.sampling.stop_ids else tokens
        text = tokenizer.decode(body) if tokenizer is not None else " ".join(map(str, body))
        text = cut_at_stop(text, job.stop_strings)[0]
        records.append({"prompt": i, "prompt_tokens": len(job.prompts[i]), "completion": text, "tokens": tokens,
                        "stopped": stopped})  # fmt: skip
        print(f"[{i}] {text}", flush=True)
    per_replica = runs[:: state.layout.sp] if state.dp > 1 else runs[:1]
    prefill_tokens = sum(len(p) for p in job.prompts)
    prefill_s = max(r.prefill_s for r in per_replica)
    new = sum(len(t) for t, _ in outputs)
    decode_s = max(r.decode_s for r in per_replica)
    cache = max(r.cache_bytes for r in runs)
    p = job.spec.parallel
    print(
        f"{PREFIX}{len(job.prompts)} prompt(s) on {state.layout.world_size} rank(s) (dp={state.dp} hp={p.hp} "
        f"cp={p.cp} ring_window={p.ring_window}), weights: {loaded}; prefill {prefill_tokens:,} tokens in "
        f"{prefill_s:.2f} s ({prefill_tokens / max(prefill_s, 1e-9):,.0f} tokens/s), decode {new:,} tokens in "
        f"{decode_s:.2f} s ({new / max(decode_s, 1e-9):,.1f} tokens/s); K/V cache {cache / 2**20:.2f} MiB on the "
        f"fullest rank ({cache / max(prefill_tokens, 1):,.0f} bytes per prompt token)",
        flush=True,
    )
    if job.out:
        Path(job.out).parent.mkdir(parents=True, exist_ok=True)
        Path(job.out).write_text("".join(json.dumps(r) + "\n" for r in records))


def main(args: argparse.Namespace, extra: list[str]) -> None:
    if args.debug:
        os.environ["LOONGTRAIN_DEBUG"] = "1"
    try:
        world, local = world_sizes(args.nproc)
        job = prepare(args, extra, world, local)
    except (*USER_ERRORS, ValueError) as e:
        say(str(e))
        raise SystemExit(2) from None
    raise SystemExit(run_job(job, world, PREFIX, "interrupted: every process was ended; nothing was written"))
