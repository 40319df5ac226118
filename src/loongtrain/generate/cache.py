"""The K/V cache of a generation, sharded over the ranks as training shards a sequence.

The prefill is the training forward over the packed prompts (one document each), and each
layer keeps what its rank attended with: after the head all-to-all, its head group's
key/value heads for its context rank's tokens
(:func:`~loongtrain.attention.head_context.head_context_attention_kv`). On a rank, each
prompt's entries are kept apart, in position order, with room for the tokens to come.

A decoded token (pass-Q, as Meta's context-parallel inference calls it): every rank computes
the new token's q, k, v (the model runs replicated on one token per prompt); the key/value
goes to one context rank, round robin from the rank holding the fewest of the prompt's
tokens, so the shards stay balanced; each context rank attends the query of its head group's
heads to its own entries (``(out, lse)``), the partial results merge by their log-sum-exp
across the context group, and the head groups' outputs are gathered. A sliding window keeps
only the entries the window can still see.

Which tokens a rank keeps and where a new one goes are pure functions of the layout and the
prompt boundaries (:func:`context_positions`, :func:`first_owners`): every rank derives them
with no communication.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loongtrain.attention.comm import all_gather_flat
from loongtrain.attention.kernels import block_forward
from loongtrain.attention.layout import SequenceLayout
from loongtrain.parallel import ParallelState

Tensor = torch.Tensor


def context_positions(layout: SequenceLayout, context: int) -> Tensor:
    """Global positions of the tokens context rank ``context`` holds after the head all-to-all
    (the order of its key/value block: the pieces of its head ranks one after another)."""
    ranges = [r for head in range(layout.hp) for r in layout.ranges(head, context)]
    return torch.cat([torch.arange(start, start + n) for start, n in ranges])


def prompt_entries(positions: Tensor, cu: Sequence[int], prompts: int) -> list[tuple[Tensor, Tensor]]:
    """For each of the first ``prompts`` documents of boundaries ``cu``: the indices into
    ``positions`` of its tokens and their positions within it, in position order."""
    bounds = torch.tensor(cu, dtype=torch.int64)
    doc = torch.searchsorted(bounds, positions, right=True) - 1
    out = []
    for p in range(prompts):
        index = torch.nonzero(doc == p).flatten()
        index = index[torch.argsort(positions[index])]
        out.append((index, positions[index] - bounds[p]))
    return out


def first_owners(layout: SequenceLayout, cu: Sequence[int], prompts: int) -> list[int]:
    """The context rank each prompt's first decoded token's key/value goes to: the one that
    holds the fewest of the prompt's tokens (ties: the lowest index); the next ones follow round robin."""
    counts = [[len(index) for index, _ in prompt_entries(context_positions(layout, c), cu, prompts)]
              for c in range(layout.cp)]  # fmt: skip
    return [min(range(layout.cp), key=lambda c: (counts[c][p], c)) for p in range(prompts)]


def owner(first: int, step: int, cp: int) -> int:
    """The context rank of a prompt's ``step``-th decoded key/value (0-based), its first at ``first``."""
    return (first + step) % cp


class PromptCache:
    """One prompt's keys and values on this rank for one layer: ``kv`` [2, capacity, Gh, d]
    with their in-prompt positions, ascending; the live entries are ``[start, length)``."""

    def __init__(self, kv: Tensor, positions: Tensor, capacity: int) -> None:
        n = kv.shape[1]
        self.kv = kv.new_empty((2, max(capacity, n, 1), *kv.shape[2:]))
        self.kv[:, :n] = kv
        self.positions = torch.empty(self.kv.shape[1], dtype=torch.int64)
        self.positions[:n] = positions
        self.start, self.length = 0, n

    def evict(self, before: int) -> None:
        """Drop the entries at positions ``< before`` (a sliding window's past)."""
        live = self.positions[self.start : self.length]
        self.start += int(torch.searchsorted(live, torch.tensor(before)).item())

    def append(self, kv: Tensor, position: int) -> None:
        """Keep ``kv`` [2, Gh, d] at ``position`` (after every entry held)."""
        if self.length == self.kv.shape[1]:  # full: move the live entries to the front
            n = self.length - self.start
            if n == self.kv.shape[1]:
                raise RuntimeError("the K/V cache of a prompt is full (its capacity was computed too small)")
            self.kv[:, :n] = self.kv[:, self.start : self.length].clone()
            self.positions[:n] = self.positions[self.start : self.length].clone()
            self.start, self.length = 0, n
        self.kv[:, self.length] = kv
        self.positions[self.length] = position
        self.length += 1

    def live(self) -> tuple[Tensor, Tensor]:
        """The live keys and values, [n, Gh, d] each."""
        kv = self.kv[:, self.start : self.length]
        return kv[0], kv[1]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass(frozen=True)
class DecodeStep:
    """What every rank knows of one decoding step: each prompt's new position and the context
    rank its key/value goes to."""

    positions: tuple[int, ...]
    owners: tuple[int, ...]


class LayerCache:
    """One layer's cache on this rank: a :class:`PromptCache` per prompt (filled by the prefill)."""

    def __init__(self, sliding_window: int | None) -> None:
        self.window = sliding_window
        self.prompts: list[PromptCache] = []

    def fill(self, kv: Tensor, entries: list[tuple[Tensor, Tensor]], lengths: Sequence[int], appends: int) -> None:
        """From the prefill's key/value block ``kv`` [2, Sc, Gh, d] and each prompt's
        :func:`prompt_entries`: keep what the first decoded token (at position ``lengths[p]``)
        can see, with room for ``appends`` more entries per prompt."""
        self.prompts = []
        for (index, positions), length in zip(entries, lengths):
            if self.window is not None:
                keep = positions > length - self.window
                index, positions = index[keep], positions[keep]
            capacity = len(index) + appends
            if self.window is not None:
                capacity = min(capacity, self.window)
            self.prompts.append(PromptCache(kv[:, index], positions, capacity))

    def attend(self, q: Tensor, kv: Tensor, step: DecodeStep, context: int) -> tuple[Tensor, Tensor]:
        """Keep the new keys/values ``kv`` [2, P, Gh, d] of the prompts this rank owns at
        ``step``, then attend ``q`` [P, Hh, d] to each prompt's live entries here:
        ``(out [P, Hh, d], lse [P, Hh])`` in float32 (lse -inf where this rank holds none)."""
        scale = q.shape[-1] ** -0.5
        out = q.new_zeros(q.shape, dtype=torch.float32)
        lse = q.new_full(q.shape[:2], -math.inf, dtype=torch.float32)
        for p, cache in enumerate(self.prompts):
            position = step.positions[p]
            if self.window is not None:
                cache.evict(position - self.window + 1)
            if step.owners[p] == context:
                cache.append(kv[:, p], position)
            k, v = cache.live()
            if k.shape[0] == 0:
                continue
            o, s = block_forward(q[p][None, None], k[None], v[None], causal=False, scale=scale)
            out[p], lse[p] = o[0, 0].float(), s[0, 0].float()
        return out, lse

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.prompts)


def merge_partials(out: Tensor, lse: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """The attention over every rank of ``group``: their ``(out [P, Hh, d], lse [P, Hh])``
    partials (float32, gathered in one collective) merged by log-sum-exp (in group order, so
    every rank gets the same bits)."""
    if group is None:
        return out
    world = dist.get_world_size(group)
    mine = torch.cat((out.reshape(-1), lse.reshape(-1)))
    every = mine.new_empty(world * mine.numel())
    all_gather_flat(every, mine, group)
    every = every.view(world, -1)
    outs = every[:, : out.numel()].view(world, *out.shape)
    lses = every[:, out.numel() :].view(world, *lse.shape)
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total).nan_to_num_(0.0)  # a rank holding none: exp(-inf) = 0
    return (weights.unsqueeze(-1) * outs).sum(dim=0)


def gather_heads(out: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """[P, Hh, d] of each head rank -> [P, hp * Hh, d] (head chunk ``r`` from head rank ``r``)."""
    if group is None:
        return out
    hp = dist.get_world_size(group)
    parts = out.new_empty((hp * out.shape[0], *out.shape[1:]))
    all_gather_flat(parts, out.contiguous(), group)
    return parts.view(hp, *out.shape).movedim(0, 1).reshape(out.shape[0], hp * out.shape[1], out.shape[2])


def my_heads(q: Tensor, kv: Tensor, state: ParallelState) -> tuple[Tensor, Tensor]:
    """This head rank's query heads of ``q`` [P, H, d] and key/value heads of ``kv`` [2, P, G, d]
    (each KV head replicated ``hp // G`` times first where ``hp > G``), as the head all-to-all
    splits them."""
    hp, head = state.hp, state.coords.head
    if hp > kv.shape[2]:
        kv = kv.repeat_interleave(hp // kv.shape[2], dim=2)
    hq, hk = q.shape[1] // hp, kv.shape[2] // hp
    return q[:, head * hq : (head + 1) * hq], kv[:, :, head * hk : (head + 1) * hk]
