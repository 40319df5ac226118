"""The evaluation's forwards on the sequence-parallel group, sharded exactly as training
shards it, with no autograd state and in the model's compute dtype.

:func:`score_batch` is the one forward: it returns every position's loss and whether its
argmax is the label, gathered back into global order ([S] scalars per sequence: never the
``[S, vocab]`` logits, never hidden states). Sequences shorter than the longest share a
forward (rows of one length, at most the longest's tokens). Data-parallel replicas take every
dp-th forward; every rank runs the same number of forwards (FSDP gathers weights over all ranks),
a replica without a sequence left repeating its last one and dropping the result.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from loongtrain.attention.layout import unshard_sequence
from loongtrain.data.batch import Microbatch
from loongtrain.data.recall import IGNORE_INDEX
from loongtrain.data.tokens import TokenFile
from loongtrain.eval.generated import GeneratedContext, score
from loongtrain.eval.needles import NeedleContext
from loongtrain.eval.plan import EvalPlan, NeedleBuilder
from loongtrain.eval.positions import LossByPosition, Window, bucket_edges, file_windows, heldout_windows
from loongtrain.eval.report import GeneratedOutcome, GeneratedReport, LossReport, NeedleOutcome, NeedleReport
from loongtrain.parallel import ParallelState
from loongtrain.train.step import shard_microbatch

T = TypeVar("T")
R = TypeVar("R")
Progress = Callable[[int, int], None]  # (done, total)


def _no_progress(done: int, total: int) -> None:
    pass


@torch.no_grad()
def score_batch(
    model: torch.nn.Module, state: ParallelState | None, tokens: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of ``tokens``/``labels`` [B, S] (rows of one length) on ``state``'s sp group
    (None: this process alone): per-position loss (float32; 0 where the label is ignored) and
    whether the argmax is the label (bool), both [B, S] in global order on the CPU, the same
    on every rank of the sp group. Collective over the sp group (and FSDP's group)."""
    device = next(model.parameters()).device if state is None else state.device
    batch = Microbatch(tokens.to(device), labels.to(device))
    if state is None:
        loss, correct = model(batch.tokens, batch.positions(), None, labels=batch.labels, reduction="none")
        return loss.float().cpu(), correct.cpu()
    shard = shard_microbatch(batch, state)
    loss, correct = model(shard.tokens, shard.positions, shard.layout, labels=shard.labels, reduction="none")
    both = torch.stack([loss.float(), correct.float()])  # [2, B, S/sp]: one gather for both
    full = unshard_sequence(both, state, dim=2, layout=shard.layout)
    return full[0].cpu(), full[1].cpu().bool()


@torch.no_grad()
def score_packed(
    model: torch.nn.Module, state: ParallelState, sequences: Sequence[tuple[Sequence[int], int]]
) -> list[tuple[float, bool]]:
    """Each of ``sequences`` (token ids and how many of its last tokens to score) as one
    document of one packed forward on ``state``'s sp group: the summed log-probability of its
    last ``n`` tokens given what precedes them, and whether each of them is the argmax (an
    evaluation harness's ``loglikelihood``). Collective over the sp group (and FSDP's)."""
    from loongtrain.generate.engine import padded_length

    tokens, labels, cu = [], [], [0]
    for ids, n in sequences:
        ids = list(ids)
        if n < 1 or n >= len(ids):
            raise ValueError(f"score_packed: score 1 to {len(ids) - 1} of a sequence's {len(ids)} tokens, not {n}")
        tokens += ids[:-1]
        labels += [IGNORE_INDEX] * (len(ids) - 1 - n) + ids[-n:]
        cu.append(len(tokens))
    total = padded_length(cu[-1], state.hp, state.cp)
    if total > cu[-1]:
        cu.append(total)
    pad = total - len(tokens)
    batch = Microbatch(torch.tensor([tokens + [0] * pad], device=state.device),
                       torch.tensor([labels + [IGNORE_INDEX] * pad], device=state.device),
                       torch.tensor(cu, dtype=torch.int64))  # fmt: skip
    shard = shard_microbatch(batch, state)
    loss, correct = model(shard.tokens, shard.positions, shard.layout, labels=shard.labels, reduction="none")
    both = torch.stack([loss.float(), correct.float()])
    full = unshard_sequence(both, state, dim=2, layout=shard.layout)[:, 0].cpu()
    out = []
    for (_, n), end in zip(sequences, cu[1:]):
        span = slice(end - n, end)
        out.append((-float(full[0, span].double().sum()), bool(full[1, span].all())))
    return out


def batches(items: Sequence[T], length_of: Callable[[T], int], tokens: int, mixed: bool = False) -> list[list[T]]:
    """Consecutive items grouped into forwards of at most ``tokens`` tokens (at least one item
    each), items of the same length only unless ``mixed`` (packed documents): a function of the
    items alone, so every layout groups alike."""
    out: list[list[T]] = []
    used = 0
    for item in items:
        n = length_of(item)
        if out and used + n <= tokens and (mixed or length_of(out[-1][0]) == n):
            out[-1].append(item)
            used += n
        else:
            out.append([item])
            used = n
    return out


def for_my_replica(
    items: Sequence[T], state: ParallelState | None, work: Callable[[int, T], R], progress: Progress = _no_progress
) -> list[tuple[int, R]]:
    """``work(i, item)`` for every item of this rank's data-parallel replica (every dp-th), in
    ``ceil(n / dp)`` rounds on every rank; returns ``(index, result)`` pairs of this replica."""
    dp = 1 if state is None else state.dp
    mine = 0 if state is None else state.coords.dp
    rounds = math.ceil(len(items) / dp)
    out = []
    for r in range(rounds):
        i = r * dp + mine
        real = i < len(items)
        j = i if real else (out[-1][0] if out else 0)  # the same amount of work on every rank
        result = work(j, items[j])
        if real:
            out.append((i, result))
        progress(min(len(items), (r + 1) * dp), len(items))
    return out


def gather_results(pairs: list[tuple[int, R]], state: ParallelState | None) -> list[R]:
    """Collective: every replica's ``(index, result)`` pairs -> all results in index order."""
    if state is None or not dist.is_initialized() or dist.get_world_size() == 1:
        merged = pairs
    else:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, pairs)
        merged = [p for part in gathered for p in part]
    by_index = {}
    for i, result in merged:
        by_index.setdefault(i, result)  # the ranks of an sp group hold the same result
    return [by_index[i] for i in sorted(by_index)]


def needle_outcomes(ctx: NeedleContext, loss: torch.Tensor, correct: torch.Tensor) -> list[NeedleOutcome]:
    """Every needle of ``ctx`` scored from its forward's per-position results."""
    out = []
    for needle in ctx.needles:
        at = list(needle.scored)
        out.append(
            NeedleOutcome(
                length=ctx.length, depth=ctx.depth, sample=ctx.sample, key=needle.key, value=needle.value,
                position=needle.start, placed_depth=round(ctx.placed_depth, 4), correct=bool(correct[at].all()),
                answer_loss=float(loss[at].double().sum()), answer_tokens=len(at),
            )
        )  # fmt: skip
    return out


def run_needles(
    model: torch.nn.Module, state: ParallelState | None, plan: EvalPlan, builder: NeedleBuilder | None = None,
    progress: Progress = _no_progress,
) -> NeedleReport:  # fmt: skip
    """The needle grid of ``plan``: contexts shorter than ``plan.max_len`` share a forward, up
    to ``plan.max_len`` tokens each (one row per context). Collective."""
    builder = builder or NeedleBuilder(plan)
    t0 = time.perf_counter()

    def work(i: int, cells: list[tuple[int, float, int]]) -> list[NeedleOutcome]:
        contexts = [builder.context(*cell) for cell in cells]
        tokens = torch.stack([c.tokens for c in contexts])
        labels = torch.stack([c.labels for c in contexts])
        loss, correct = score_batch(model, state, tokens, labels)
        return [o for row, ctx in enumerate(contexts) for o in needle_outcomes(ctx, loss[row], correct[row])]

    groups = batches(plan.cells, lambda cell: cell[0], plan.max_len)
    results = gather_results(for_my_replica(groups, state, work, progress), state)
    return NeedleReport(
        outcomes=[o for part in results for o in part], lengths=list(plan.lengths), depths=list(plan.depths),
        needles=plan.needles, chance=plan.chance, task=plan.task, seconds=time.perf_counter() - t0,
    )  # fmt: skip


def run_generated(
    model: torch.nn.Module, state: ParallelState, plan: EvalPlan, builder: NeedleBuilder | None = None,
    progress: Progress = _no_progress,
) -> list[GeneratedReport]:  # fmt: skip
    """Each of ``plan.generated``'s tasks over the grid, answered by greedy generation on
    ``state``: several prompts (up to ``plan.max_len`` tokens together) per prefill, every
    dp-th group on each replica. Collective."""
    from loongtrain.generate import Sampling, generate

    builder = builder or NeedleBuilder(plan)
    tokenizer = builder.tokenizer
    stop = () if tokenizer is None or tokenizer.eos is None else (int(tokenizer.eos),)
    reports = []
    for task in plan.generated:
        t0 = time.perf_counter()
        new = plan.generated_tokens[task]
        contexts = [builder.generated_context(task, *cell) for cell in plan.cells]

        def work(i: int, group: list[GeneratedContext], new=new) -> list[GeneratedOutcome]:
            done = generate(model, state, [c.tokens for c in group], Sampling(max_new_tokens=new, stop_ids=stop))
            out = []
            for ctx, tokens, stopped in zip(group, done.tokens, done.stopped):
                body = tokens[:-1] if stopped else tokens
                if tokenizer is not None:
                    text = tokenizer.decode(body)
                    got = score(ctx.answers, text)
                else:  # the recall task's ids: the one generated token is the answer
                    text = " ".join(map(str, body))
                    got = float(body[:1] == [int(ctx.answers[0])])
                out.append(GeneratedOutcome(
                    ctx.task, ctx.length, ctx.depth, ctx.sample, ctx.answers, text, got, ctx.first_insert,
                ))  # fmt: skip
            return out

        groups = batches(contexts, lambda c: len(c.tokens), plan.max_len, mixed=True)
        results = gather_results(for_my_replica(groups, state, work, progress), state)
        reports.append(GeneratedReport(
            task, [o for part in results for o in part], list(plan.lengths), list(plan.depths), new,
            time.perf_counter() - t0,
        ))  # fmt: skip
    return reports


def loss_windows(plan: EvalPlan) -> list[Window]:
    """The plan's held-out windows (the same on every rank)."""
    file = TokenFile(plan.loss_file)
    if plan.loss_heldout:
        from loongtrain.data.loader import TokenFileSource

        return heldout_windows(TokenFileSource(file, plan.loss_len, plan.data_seed, pack=False), plan.loss_windows)
    return file_windows(file, plan.loss_len, plan.loss_windows, plan.seed)


def run_loss_by_position(
    model: torch.nn.Module, state: ParallelState | None, plan: EvalPlan, progress: Progress = _no_progress
) -> LossReport | None:
    """The loss by position of ``plan`` (None when it has none). Collective."""
    if not plan.loss_windows:
        return None
    t0 = time.perf_counter()
    windows = loss_windows(plan)
    edges = bucket_edges(plan.loss_len, plan.buckets)

    def work(i: int, group: list[Window]) -> LossByPosition:
        tokens, labels = torch.stack([w.tokens for w in group]), torch.stack([w.labels for w in group])
        loss, _ = score_batch(model, state, tokens, labels)
        one = LossByPosition(edges)
        for row, window in enumerate(group):
            one.add(loss[row], window.labels != IGNORE_INDEX)
        return one

    groups = batches(windows, lambda w: w.tokens.shape[0], max(plan.max_len, plan.loss_len))
    total = LossByPosition(edges)
    for part in gather_results(for_my_replica(groups, state, work, progress), state):
        total.sums = [a + b for a, b in zip(total.sums, part.sums)]
        total.counts = [a + b for a, b in zip(total.counts, part.counts)]
        total.windows += part.windows
    source = f"{plan.loss_file} ({'held-out windows' if plan.loss_heldout else 'token file'})"
    return LossReport(
        rows=total.rows(), length=plan.loss_len, windows=total.windows, source=source, overall=total.overall(),
        crosses_documents=any(w.crosses_documents for w in windows), seconds=time.perf_counter() - t0,
    )  # fmt: skip
