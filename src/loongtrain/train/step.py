"""One optimisation step's forward/backward on sequence shards, with the loss normalised
by the global number of target tokens (so summed gradients equal the unsharded ones).

Packed microbatches (``Microbatch.cu_seqlens``) are sharded with the state's balance; the
model gets each shard's in-document positions and the global boundaries, which its
attention turns into document masks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loongtrain.attention import shard_sequence
from loongtrain.attention.sharding import check_sequence_length
from loongtrain.data.batch import Microbatch
from loongtrain.data.recall import IGNORE_INDEX
from loongtrain.parallel import ParallelState


@dataclass(frozen=True)
class ShardedBatch:
    """This rank's shard of a :class:`Microbatch`: what the model and the loss take."""

    tokens: torch.Tensor  # [B, S/sp]
    labels: torch.Tensor  # [B, S/sp]
    positions: torch.Tensor  # [1, S/sp] RoPE positions (restarting per document)
    cu_seqlens: torch.Tensor | None  # global document boundaries (CPU), or None


def shard_microbatch(batch: Microbatch, state: ParallelState) -> ShardedBatch:
    """This rank's shard of ``batch`` (tokens, labels, positions), laid out by ``state.config.balance``."""
    check_sequence_length(batch.tokens.shape[1], state.hp, state.cp)
    cu = batch.attention_documents

    def shard(x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(x, state, cu_seqlens=cu)

    return ShardedBatch(shard(batch.tokens), shard(batch.labels), shard(batch.positions()), cu)


def shard_batch(
    tokens: torch.Tensor, labels: torch.Tensor, state: ParallelState
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's shard of unpacked ``tokens``/``labels`` [B, S] and the matching position ids."""
    sharded = shard_microbatch(Microbatch(tokens, labels), state)
    return sharded.tokens, sharded.labels, sharded.positions


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy (float32) over labels != IGNORE_INDEX."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def count_targets(labels: list[torch.Tensor], device: torch.device, group=None) -> torch.Tensor:
    """Target tokens in ``labels`` summed over the ranks of ``group`` (default: all)."""
    count = torch.zeros((), dtype=torch.float64, device=device)
    for lab in labels:
        count += (lab != IGNORE_INDEX).sum()
    if dist.is_initialized():
        dist.all_reduce(count, group=group)
    return count


@dataclass(frozen=True)
class StepResult:
    """Global results of one step (the same on every rank)."""

    loss: float  # mean loss per target token over all replicas and microbatches
    accuracy: float  # fraction of targets whose argmax prediction is right
    targets: int  # target tokens in the global batch


def as_microbatch(batch: Microbatch | tuple[torch.Tensor, torch.Tensor]) -> Microbatch:
    """A :class:`Microbatch`, also from a plain ``(tokens, labels)`` pair."""
    return batch if isinstance(batch, Microbatch) else Microbatch(*batch)


def forward_backward(
    model: torch.nn.Module,
    state: ParallelState,
    microbatches: list[Microbatch | tuple[torch.Tensor, torch.Tensor]],
    *,
    backward: bool = True,
) -> StepResult:
    """Forward (and backward) over this replica's ``microbatches`` of full sequences.

    Each microbatch is a :class:`Microbatch` (or a ``(tokens, labels)`` pair) [B, S] of this
    data-parallel replica (the same on every rank of its sp group). With ``backward`` the
    gradients of the global mean loss accumulate in the parameters; without it
    (evaluation) no graph is built.
    """
    shards = [shard_microbatch(as_microbatch(mb), state) for mb in microbatches]
    device = shards[0].tokens.device
    # every sp rank sees its own shard, so this sums each replica's targets exactly once
    total_targets = count_targets([sb.labels for sb in shards], device).item()
    if total_targets == 0:
        raise ValueError("the batch has no target tokens (every label is IGNORE_INDEX)")
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, correct predictions
    with torch.set_grad_enabled(backward):
        for sb in shards:
            logits = model(sb.tokens, sb.positions, sb.cu_seqlens)
            labels = sb.labels
            loss = lm_loss_sum(logits, labels) / total_targets
            if backward:
                loss.backward()
            scored = labels != IGNORE_INDEX
            sums[0] += loss.detach()
            sums[1] += (logits.detach().argmax(dim=-1)[scored] == labels[scored]).sum()
    dist.all_reduce(sums)
    loss_sum, correct = sums.tolist()
    return StepResult(loss=loss_sum, accuracy=correct / total_targets, targets=int(total_targets))
