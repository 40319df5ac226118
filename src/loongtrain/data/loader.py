"""Data sources addressed by a global sample index, and the stateful batch loader.

A step consumes the next ``global_batch`` sample indices; replica ``d`` takes its rows
of each microbatch, and every rank of a replica gets the same full sequences (it keeps
its own shard when the step shards them). Because samples are a function of the index
alone, the loader state is one integer, and a run resumed on another layout (other dp,
hp, cp or world size) sees exactly the samples it would have seen.

Packed sources (a sample is ``(tokens, labels, cu_seqlens)``) give microbatches of one
row: the microbatch's samples concatenated, with their document boundaries. The
boundaries are a function of the sample too, so they need no loader state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from loongtrain.data.batch import Microbatch, pack_rows
from loongtrain.data.recall import IGNORE_INDEX, RecallTask, sample_seed
from loongtrain.data.tokens import TokenFile, TokenFileError

Sample = tuple[torch.Tensor, ...]  # (tokens [S], labels [S]) or, packed, (tokens, labels, cu_seqlens)


class Source(Protocol):
    seq_len: int

    def sample(self, index: int, split: str = "train") -> Sample: ...


def document_boundaries(inputs: torch.Tensor, labels: torch.Tensor, eos: int) -> torch.Tensor:
    """Boundaries of the documents in a window of a token stream: a document ends after each
    ``eos`` input token. Sets the label that would predict across a boundary (the one at an
    ``eos`` input) to IGNORE_INDEX in place; returns ``cu_seqlens`` [D+1]."""
    ends = (inputs == eos).nonzero().flatten()
    labels[ends] = IGNORE_INDEX
    inner = (ends + 1)[ends + 1 < inputs.shape[0]]
    return torch.cat([torch.zeros(1, dtype=torch.int64), inner, torch.tensor([inputs.shape[0]])])


class TokenFileSource:
    """Non-overlapping windows of ``seq_len + 1`` tokens (stride ``seq_len``), in a seeded
    order per epoch; the last ``eval_fraction`` of windows is held out for evaluation.

    With ``eos`` set (packing), each window also yields its document boundaries: documents
    end after each ``eos`` token, no target crosses a boundary, and the attention and RoPE
    positions of each document start afresh. A window's first document may be the tail of
    one that began in the previous window.
    """

    def __init__(
        self, file: TokenFile, seq_len: int, seed: int = 0, eval_fraction: float = 0.01, eos: int | None = None
    ) -> None:
        self.file, self.seq_len, self.seed, self.eos = file, seq_len, seed, eos
        windows = (file.count - 1) // seq_len
        if windows < 2:
            raise TokenFileError(
                f"{file.path}: {file.count} tokens make {windows} sequence(s) of {seq_len}+1 tokens; need at "
                f"least 2 (one to train, one to evaluate): use more text or a smaller data.seq_len"
            )
        self.eval_windows = max(1, int(windows * eval_fraction))
        self.train_windows = windows - self.eval_windows
        self._perm: tuple[int, torch.Tensor] | None = None

    def _window(self, w: int) -> Sample:
        start = w * self.seq_len
        chunk = torch.from_numpy(self.file.tokens[start : start + self.seq_len + 1].astype("int64"))
        inputs, labels = chunk[:-1].clone(), chunk[1:].clone()
        if self.eos is None:
            return inputs, labels
        return inputs, labels, document_boundaries(inputs, labels, self.eos)

    def sample(self, index: int, split: str = "train") -> Sample:
        if split == "eval":
            return self._window(self.train_windows + index % self.eval_windows)
        epoch, pos = divmod(index, self.train_windows)
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(sample_seed("tokens", self.seed, epoch))
            self._perm = (epoch, torch.randperm(self.train_windows, generator=gen))
        return self._window(int(self._perm[1][pos]))


def rows_per_microbatch(global_batch: int, dp: int, micro_batches: int) -> int:
    """Sequences per microbatch per replica; raises unless the batch splits evenly."""
    per_step = dp * micro_batches
    if global_batch % per_step != 0:
        raise ValueError(
            f"data.global_batch={global_batch} is not divisible by dp*micro_batches = "
            f"{dp}*{micro_batches} = {per_step}; every replica needs whole microbatches"
        )
    return global_batch // per_step


@dataclass
class BatchLoader:
    """Hands each replica its microbatches of full sequences; ``state_dict`` resumes it."""

    source: Source
    global_batch: int
    micro_batches: int
    dp: int
    dp_rank: int
    next_index: int = 0
    mask_documents: bool = True  # packed sources: mask attention at document boundaries (False: ablation)

    def __post_init__(self) -> None:
        self.rows = rows_per_microbatch(self.global_batch, self.dp, self.micro_batches)

    def _rows(self, base: int, split: str) -> list[Microbatch]:
        out = []
        for m in range(self.micro_batches):
            first = base + (m * self.dp + self.dp_rank) * self.rows
            samples = [self.source.sample(first + r, split) for r in range(self.rows)]
            if len(samples[0]) == 3:
                out.append(pack_rows(samples, self.mask_documents))
            else:
                out.append(Microbatch(torch.stack([t for t, _ in samples]), torch.stack([lab for _, lab in samples])))
        return out

    def next(self) -> list[Microbatch]:
        """This replica's microbatches of the next step (``[B, S]``, or one packed row ``[1, B*S]``)."""
        batch = self._rows(self.next_index, "train")
        self.next_index += self.global_batch
        return batch

    def eval_batch(self, i: int) -> list[Microbatch]:
        """Held-out global batch ``i`` (same split over replicas as training)."""
        return self._rows(i * self.global_batch, "eval")

    def state_dict(self) -> dict:
        return {"next_index": self.next_index}

    def load_state_dict(self, state: dict) -> None:
        self.next_index = int(state["next_index"])


__all__ = ["IGNORE_INDEX", "BatchLoader", "RecallTask", "TokenFileSource"]
