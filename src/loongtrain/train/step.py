"""One optimisation step's forward/backward on sequence shards, with the loss normalised
by the global number of target tokens (so summed gradients equal the unsharded ones).

Each microbatch gets one :class:`~loongtrain.attention.layout.SequenceLayout`
(its packed documents, ``Microbatch.cu_seqlens``, cut with the state's balance): its tokens,
labels and in-document positions are sharded with it, and the model's attention gets the
same layout, which it turns into document masks."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from loongtrain.attention.comm import all_gather_flat
from loongtrain.attention.layout import SequenceLayout, sequence_layout, shard_sequence
from loongtrain.data.batch import Microbatch
from loongtrain.data.recall import IGNORE_INDEX
from loongtrain.parallel import ParallelState


@dataclass(frozen=True)
class ShardedBatch:
    """This rank's shard of a :class:`Microbatch`: what the model and the loss take."""

    tokens: torch.Tensor  # [B, S/sp]
    labels: torch.Tensor  # [B, S/sp]
    positions: torch.Tensor  # [1, S/sp] RoPE positions (restarting per document)
    layout: SequenceLayout  # how the whole sequence lies on the sp group (documents, sharding)
    sources: torch.Tensor | None = None  # [B, S/sp] the source of each token (a mixture), or None


def shard_microbatch(batch: Microbatch, state: ParallelState) -> ShardedBatch:
    """This rank's shard of ``batch`` (tokens, labels, positions) and the layout they were cut with
    (the batch's documents, the state's balance; validated here, before any communication)."""
    layout = sequence_layout(batch.tokens.shape[1], state, batch.attention_documents)

    def shard(x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(x, state, layout=layout)

    sources = None if batch.sources is None else shard(batch.sources)
    return ShardedBatch(shard(batch.tokens), shard(batch.labels), shard(batch.positions()), layout, sources)


def _shard(index: int, batch: Microbatch, state: ParallelState, choose: Callable | None = None) -> ShardedBatch:
    """:func:`shard_microbatch` on ``state`` (or the state ``choose`` picks for the batch), a refusal
    naming the microbatch, its documents and the layout."""
    where = "under parallel.layout=per_batch" if choose is not None else f"on hp={state.hp} x cp={state.cp}"
    try:
        if choose is not None:
            state = choose(batch)
            where = f"on hp={state.hp} x cp={state.cp} (chosen for it by parallel.layout=per_batch)"
        return shard_microbatch(batch, state)
    except ValueError as e:
        documents = batch.attention_documents
        lengths = "one sequence" if documents is None else f"documents of {documents.diff().tolist()} tokens"
        raise ValueError(
            f"microbatch {index} (tokens {tuple(batch.tokens.shape)}, {lengths}) cannot run {where}: {e}"
        ) from None


def batch_signature(batches: list[Microbatch]) -> int:
    """A 32-bit digest of what must agree across an sp group: shapes and document boundaries."""
    parts = [
        (tuple(mb.tokens.shape), None if mb.cu_seqlens is None else tuple(mb.cu_seqlens.tolist()), mb.mask_documents)
        for mb in batches
    ]
    return zlib.crc32(repr(parts).encode())


def agree_and_count(batches: list[Microbatch], shards: list[ShardedBatch], state: ParallelState) -> int:
    """Global target count, checking that every sp group's ranks hold the same batch layout.

    One all-gather of three numbers per rank per step, read on the host once (this replaces
    the attention's per-call input check in training): ranks of an sp group that were handed
    different shapes or boundaries raise the same error on every rank, before any attention
    transfer could mismatch.
    """
    device = shards[0].tokens.device
    local = torch.zeros(3, dtype=torch.float64, device=device)
    for sb in shards:
        local[0] += (sb.labels != IGNORE_INDEX).sum()
    local[1], local[2] = batch_signature(batches), len(batches)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        rows = [local.tolist()]
    else:
        gathered = local.new_empty((dist.get_world_size() * 3,))
        all_gather_flat(gathered, local, group=None)
        rows = gathered.view(-1, 3).tolist()
    layout = state.layout
    for group in layout.all_sp_groups():
        seen = {(rows[r][1], rows[r][2]) for r in group}
        if len(seen) > 1:
            detail = ", ".join(f"rank {r}: {int(rows[r][2])} microbatch(es), digest {int(rows[r][1])}" for r in group)
            raise ValueError(
                f"the ranks of sequence-parallel group {list(group)} were given different batches ({detail}); "
                "every rank of an sp group must get the same full sequences (shapes and cu_seqlens)"
            )
    return int(sum(row[0] for row in rows))


class SourceNumbers(NamedTuple):
    """One source's numbers in a step (a mixture): its loss per target token (nan: no target),
    its target tokens and its tokens, in the global batch."""

    name: str
    loss: float
    targets: int
    tokens: int


@dataclass(frozen=True)
class StepResult:
    """Global results of one step (the same on every rank)."""

    loss: float  # mean loss per target token over all replicas and microbatches
    accuracy: float  # fraction of targets whose argmax prediction is right
    targets: int  # target tokens in the global batch
    layouts: tuple[str, ...] = ()  # this replica's hp x cp (and balance, where not the state's) per microbatch
    microbatch_losses: tuple[float, ...] = ()  # each microbatch's share of the loss (over every replica)
    sources: tuple[SourceNumbers, ...] = ()  # a mixture (``source_names``): each source's numbers




def as_microbatch(batch: Microbatch | tuple[torch.Tensor, torch.Tensor]) -> Microbatch:
    """A :class:`Microbatch`, also from a plain ``(tokens, labels)`` pair."""
    return batch if isinstance(batch, Microbatch) else Microbatch(*batch)


def forward_backward(
    model: torch.nn.Module,
    state: ParallelState,
    microbatches: list[Microbatch | tuple[torch.Tensor, torch.Tensor]],
    *,
    backward: bool = True,
    choose: Callable[[Microbatch], ParallelState] | None = None,
    source_names: tuple[str, ...] = (),
) -> StepResult:
    """Forward (and backward) over this replica's ``microbatches`` of full sequences.

    Each microbatch is a :class:`Microbatch` (or a ``(tokens, labels)`` pair) [B, S] of this
    data-parallel replica (the same on every rank of its sp group). With ``backward`` the
    gradients of the global mean loss accumulate in the parameters; without it
    (evaluation) no graph is built. ``choose`` gives each microbatch the state (an hp x cp
    split of the same ranks, :func:`~loongtrain.apply.parallelize`'s ``alternatives``) it
    is sharded and attended on; None: ``state`` for all. ``source_names`` (a mixture,
    whose microbatches carry ``sources``, ids into these names): each source's loss, targets and
    tokens too, summed over the ranks in the step's one all-reduce.
    """
    batches = [as_microbatch(mb) for mb in microbatches]
    shards = [_shard(i, mb, state, choose) for i, mb in enumerate(batches)]
    device = shards[0].tokens.device
    # every sp rank sees its own shard, so this sums each replica's targets exactly once
    total_targets = agree_and_count(batches, shards, state)
    if total_targets == 0:
        raise ValueError("the batch has no target tokens (every label is IGNORE_INDEX)")
    # loss, correct predictions, each microbatch's loss (the guard names the one that is not finite),
    # then per source its loss sum, its targets and its tokens: one vector, one all-reduce
    m, g = len(shards), len(source_names)
    sums = torch.zeros(2 + m + 3 * g, dtype=torch.float64, device=device)
    with torch.set_grad_enabled(backward):
        for i, sb in enumerate(shards):
            if g:
                if sb.sources is None:
                    raise ValueError(f"{g} sources named but microbatch {i} carries no source ids (Microbatch.sources)")
                loss_sum, correct, by_source = model(
                    sb.tokens, sb.positions, sb.layout, labels=sb.labels, groups=sb.sources, n_groups=g
                )  # fmt: skip
                sums[2 + m : 2 + m + g] += by_source
                sums[2 + m + g : 2 + m + 2 * g] += torch.bincount(sb.sources[sb.labels != IGNORE_INDEX], minlength=g)
                sums[2 + m + 2 * g :] += torch.bincount(sb.sources.reshape(-1), minlength=g)
            else:
                loss_sum, correct = model(sb.tokens, sb.positions, sb.layout, labels=sb.labels)  # no full logits
            loss = loss_sum / total_targets
            if backward:
                loss.backward()
            sums[2 + i] += loss.detach()
            sums[1] += correct
    sums[0] = sums[2 : 2 + m].sum()
    dist.all_reduce(sums)
    loss_sum, correct, *rest = sums.tolist()
    per_microbatch, source_sums = rest[:m], rest[m : m + g]
    sources = tuple(
        SourceNumbers(name, total / targets if targets else math.nan, int(targets), int(tokens))
        for name, total, targets, tokens in zip(source_names, source_sums, rest[m + g : m + 2 * g], rest[m + 2 * g :])
    )
    own = state.config.balance
    layouts = tuple(
        f"{sb.layout.hp}x{sb.layout.cp}" + ("" if sb.layout.balance == own else f" {sb.layout.balance}")
        for sb in shards
    )
    return StepResult(
        loss=loss_sum, accuracy=correct / total_targets, targets=int(total_targets), layouts=layouts,
        microbatch_losses=tuple(per_microbatch),
        sources=sources,
    )  # fmt: skip
