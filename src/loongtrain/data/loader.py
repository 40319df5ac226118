"""Data sources addressed by a global sample index, and the stateful batch loader.

A step consumes the next ``global_batch`` sample indices; replica ``d`` takes its rows
of each microbatch, and every rank of a replica gets the same full sequences (it keeps
its own zigzag shard when the step shards them). Because samples are a function of the
index alone, the loader state is one integer, and a run resumed on another layout (other
dp, hp, cp or world size) sees exactly the samples it would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from loongtrain.data.recall import IGNORE_INDEX, RecallTask, sample_seed
from loongtrain.data.tokens import TokenFile, TokenFileError


class Source(Protocol):
    seq_len: int

    def sample(self, index: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]: ...


class TokenFileSource:
    """Non-overlapping windows of ``seq_len + 1`` tokens (stride ``seq_len``), in a seeded
    order per epoch; the last ``eval_fraction`` of windows is held out for evaluation."""

    def __init__(self, file: TokenFile, seq_len: int, seed: int = 0, eval_fraction: float = 0.01) -> None:
        self.file, self.seq_len, self.seed = file, seq_len, seed
        windows = (file.count - 1) // seq_len
        if windows < 2:
            raise TokenFileError(
                f"{file.path}: {file.count} tokens make {windows} sequence(s) of {seq_len}+1 tokens; need at "
                f"least 2 (one to train, one to evaluate): use more text or a smaller data.seq_len"
            )
        self.eval_windows = max(1, int(windows * eval_fraction))
        self.train_windows = windows - self.eval_windows
        self._perm: tuple[int, torch.Tensor] | None = None

    def _window(self, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = w * self.seq_len
        chunk = torch.from_numpy(self.file.tokens[start : start + self.seq_len + 1].astype("int64"))
        return chunk[:-1].clone(), chunk[1:].clone()

    def sample(self, index: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
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

    def __post_init__(self) -> None:
        self.rows = rows_per_microbatch(self.global_batch, self.dp, self.micro_batches)

    def _rows(self, base: int, split: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for m in range(self.micro_batches):
            first = base + (m * self.dp + self.dp_rank) * self.rows
            pairs = [self.source.sample(first + r, split) for r in range(self.rows)]
            out.append((torch.stack([t for t, _ in pairs]), torch.stack([lab for _, lab in pairs])))
        return out

    def next(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This replica's microbatches ``[(tokens [B, S], labels [B, S]), ...]`` of the next step."""
        batch = self._rows(self.next_index, "train")
        self.next_index += self.global_batch
        return batch

    def eval_batch(self, i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Held-out global batch ``i`` (same split over replicas as training)."""
        return self._rows(i * self.global_batch, "eval")

    def state_dict(self) -> dict:
        return {"next_index": self.next_index}

    def load_state_dict(self, state: dict) -> None:
        self.next_index = int(state["next_index"])


__all__ = ["IGNORE_INDEX", "BatchLoader", "RecallTask", "TokenFileSource"]
