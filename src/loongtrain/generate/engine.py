"""Generation on the training layout: a prefill of the packed prompts with the 2D / double-ring
attention, each rank keeping its shard of the K/V cache, then one token per prompt per step
(:mod:`loongtrain.generate.cache`).

:func:`generate` is collective over every rank (the model's ZeRO shards are gathered once for
the whole generation, so the steps themselves move only the attention's partial results). The
prompts are this rank's data-parallel replica's, the same on every rank of its sp group; with
several replicas the steps go on until every replica is done.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loongtrain.attention.head_context import head_context_attention_kv
from loongtrain.data.batch import Microbatch
from loongtrain.data.recall import IGNORE_INDEX
from loongtrain.generate.cache import (
    DecodeStep,
    LayerCache,
    context_positions,
    first_owners,
    gather_heads,
    merge_partials,
    my_heads,
    owner,
    prompt_entries,
)
from loongtrain.generate.sampling import Sampling, next_tokens
from loongtrain.model.llama import Attention
from loongtrain.parallel import ParallelState
from loongtrain.train.step import shard_microbatch

Tensor = torch.Tensor


@dataclass
class Generation:
    """What :func:`generate` produced for this replica's prompts (the same on every rank of its
    sp group)."""

    tokens: list[list[int]]  # the new tokens of each prompt (a stop token included, as it ended the prompt)
    stopped: list[bool]  # whether each prompt ended at a stop token or stop_when (else at max_new_tokens)
    prefill_tokens: int  # prompt tokens of this replica
    prefill_s: float
    decode_steps: int  # steps after the prefill (each one token per prompt still running)
    decode_s: float
    cache_bytes: int  # this rank's K/V cache after the prefill (every layer, every prompt)
    logits: list[Tensor] = field(default_factory=list)  # keep_logits: [P, V] float32 per new token


def attention_modules(model: torch.nn.Module) -> list[Attention]:
    """The model's attention modules, in layer order (inside any checkpoint wrapper)."""
    return [m for m in model.modules() if isinstance(m, Attention)]


@contextlib.contextmanager
def attention_fns(model: torch.nn.Module, make) -> Iterator[None]:
    """Every attention module of ``model`` calls ``make(i)`` (layer ``i``) inside the block (the
    whole-layer path: a layer trained over head groups runs every head at once here)."""
    modules = attention_modules(model)
    saved = [(m.attention_fn, m.over_head_groups) for m in modules]
    try:
        for i, m in enumerate(modules):
            m.attention_fn, m.over_head_groups = make(i), None
        yield
    finally:
        for m, (fn, grouped) in zip(modules, saved):
            m.attention_fn, m.over_head_groups = fn, grouped


@contextlib.contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """Collective: the model's ZeRO-sharded parameters gathered once and kept so inside the
    block (a decoding step then gathers nothing), sharded again after. A model without
    FSDP is used as it is."""
    from torch.distributed.fsdp import FSDPModule

    units = [(m, reshard) for m, reshard in getattr(model, "zero_units", []) if isinstance(m, FSDPModule)]
    try:
        for m, _ in units:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        yield
    finally:
        for m, reshard in units:
            m.set_reshard_after_forward(reshard, recurse=False)  # as apply_zero set it
            m.reshard()


def padded_length(tokens: int, hp: int, cp: int) -> int:
    """The shortest packed length of at least ``tokens`` that an hp x cp layout can shard
    (:func:`~loongtrain.parallel.layout.check_sequence_length`; one device: any)."""
    if hp * cp == 1:
        return tokens
    return math.ceil(tokens / (2 * hp * cp)) * (2 * hp * cp)


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    """Raise ValueError (on every rank alike, before any communication) for an empty batch,
    an empty prompt or a token id outside the vocabulary."""
    if not prompts:
        raise ValueError("no prompts to generate from")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; give every prompt at least one token")
        bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id(s) {bad[:3]} outside the model's vocabulary of {vocab_size}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prefill_layer(q, k, v, layout=None, sliding_window=None, *, state, cache: LayerCache, entries, lengths, appends):
    out, kv = head_context_attention_kv(q, k, v, state, layout=layout, sliding_window=sliding_window)
    cache.fill(kv[:, 0], entries, lengths, appends)
    return out


def _decode_layer(q, k, v, layout=None, sliding_window=None, *, state: ParallelState, cache: LayerCache, step):
    q_h, kv_h = my_heads(q[:, 0], torch.stack((k[:, 0], v[:, 0])), state)
    out, lse = cache.attend(q_h, kv_h, step[0], state.coords.context)
    out = merge_partials(out, lse, state.context_group)
    return gather_heads(out, state.head_group).to(q.dtype).unsqueeze(1)


def _last_token_logits(model, state: ParallelState, h: Tensor, layout, cu: Sequence[int], prompts: int) -> Tensor:
    """[P, V] float32 logits of each prompt's last token, on every rank of the sp group (the
    rank holding it computes them; one all-reduce)."""
    mine = torch.cat([torch.arange(s, s + n) for s, n in layout.ranges(state.coords.head, state.coords.context)])
    where = {int(g): i for i, g in enumerate(mine.tolist())}
    rows = [(p, where[cu[p + 1] - 1]) for p in range(prompts) if cu[p + 1] - 1 in where]
    logits = torch.zeros(prompts, model.config.vocab_size, dtype=torch.float32, device=h.device)
    if rows:
        at = torch.tensor([i for _, i in rows], device=h.device)
        logits[[p for p, _ in rows]] = F.linear(h[0, at], model.output_weight).float()
    if state.sp_group is not None:
        dist.all_reduce(logits, group=state.sp_group)
    return logits


def _agree(tokens: Tensor, state: ParallelState) -> Tensor:
    """The tokens of the sp group's first rank, on every rank of the group."""
    if state.sp_group is not None:
        dist.broadcast(tokens, src=state.layout.sp_group(state.rank)[0], group=state.sp_group)
    return tokens


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    state: ParallelState,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling,
    keep_logits: bool = False,
    stop_when: Callable[[int, list[int]], bool] | None = None,
) -> Generation:
    """Generate from ``prompts`` (token id lists of any lengths; this replica's) on ``state``.
    Collective over every rank. ``keep_logits`` keeps every step's logits (tests, scoring);
    ``stop_when(p, new_tokens)`` (the same on every rank, e.g. a stop string in the decoded
    text) ends prompt ``p`` after a token as a stop token would."""
    check_prompts(prompts, model.config.vocab_size)
    device, P = state.device, len(prompts)
    lengths = [len(p) for p in prompts]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    total = padded_length(cu[-1], state.hp, state.cp)
    bounds = cu + ([total] if total > cu[-1] else [])  # the padding is a document of its own
    tokens = torch.tensor([t for p in prompts for t in p] + [0] * (total - cu[-1]), dtype=torch.int64)
    batch = Microbatch(tokens[None].to(device), torch.full((1, total), IGNORE_INDEX, device=device),
                       torch.tensor(bounds, dtype=torch.int64))  # fmt: skip
    caches = [LayerCache(m.sliding_window) for m in attention_modules(model)]  # a sliding layer keeps its window
    appends = math.ceil(max(sampling.max_new_tokens - 1, 0) / state.cp)
    generator = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)
    out_tokens: list[list[int]] = [[] for _ in range(P)]
    running, stopped = [True] * P, [False] * P
    kept: list[Tensor] = []

    with gathered(model):
        _sync(device)
        t0 = time.perf_counter()
        shard = shard_microbatch(batch, state)
        layout = shard.layout
        entries = prompt_entries(context_positions(layout, state.coords.context), bounds, P)
        prefill = functools.partial(_prefill_layer, state=state, entries=entries, lengths=lengths, appends=appends)
        with attention_fns(model, lambda i: functools.partial(prefill, cache=caches[i])):
            h = model.hidden_states(shard.tokens, shard.positions, layout)
        logits = _last_token_logits(model, state, h, layout, bounds, P)
        del h
        firsts = first_owners(layout, bounds, P)
        _sync(device)
        prefill_s = time.perf_counter() - t0
        cache_bytes = sum(c.nbytes for c in caches)

        t1, steps = time.perf_counter(), 0
        step_box: list[DecodeStep] = []
        decode = functools.partial(_decode_layer, state=state, step=step_box)
        with attention_fns(model, lambda i: functools.partial(decode, cache=caches[i])):
            for t in range(sampling.max_new_tokens):
                if keep_logits:
                    kept.append(logits.cpu())
                chosen = _agree(next_tokens(logits.cpu(), sampling, generator).to(device), state).cpu().tolist()
                for p in range(P):
                    if running[p]:
                        out_tokens[p].append(chosen[p])
                        ended = chosen[p] in sampling.stop_ids
                        ended = ended or (stop_when is not None and stop_when(p, out_tokens[p]))
                        stopped[p] = ended
                        running[p] = not ended and len(out_tokens[p]) < sampling.max_new_tokens
                if not _any_running(any(running), state) or t == sampling.max_new_tokens - 1:
                    break
                positions = tuple(n + t for n in lengths)
                step_box[:] = [DecodeStep(positions, tuple(owner(f, t, state.cp) for f in firsts))]
                h = model.hidden_states(
                    torch.tensor(chosen, device=device)[:, None], torch.tensor(positions, device=device)[:, None]
                )
                logits = F.linear(h[:, 0], model.output_weight).float()
                steps += 1
        _sync(device)
        decode_s = time.perf_counter() - t1
    return Generation(
        tokens=out_tokens, stopped=stopped, prefill_tokens=cu[-1], prefill_s=prefill_s, decode_steps=steps,
        decode_s=decode_s, cache_bytes=cache_bytes, logits=kept,
    )  # fmt: skip


def _any_running(mine: bool, state: ParallelState) -> bool:
    """Whether a prompt of any replica is still running (replicas step together: the model's
    forward is collective over all ranks)."""
    if state.dp == 1:
        return mine
    flag = torch.tensor([int(mine)], device=state.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
