"""Loss by position: the mean next-token loss in log-spaced position buckets over windows of
held-out text. Pure (no process group).

Position ``p`` is the index of the predicting token: its loss is that of token ``p + 1``
given the ``p + 1`` tokens before it. A model that uses its context has a loss that falls
with position; one that ignores everything beyond some distance flattens out there.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from loongtrain.data.recall import sample_seed
from loongtrain.data.tokens import TokenFile, TokenFileError


def bucket_edges(length: int, buckets: int) -> list[int]:
    """Edges ``[0 = e_0 < e_1 = 1 < ... < e_n = length]`` of at most ``buckets`` position
    buckets: position 0 alone, then log-spaced ``e_i = round(length ** ((i - 1) / (buckets - 1)))``
    (duplicates dropped); bucket ``i`` holds positions ``[e_i, e_{i+1})``."""
    if length < 1 or buckets < 1:
        raise ValueError(f"bucket_edges: length={length} and buckets={buckets} must be positive")
    if buckets == 1:
        return [0, length]
    inner = {min(length, round(length ** (i / (buckets - 1)))) for i in range(buckets)}
    return sorted({0, length} | inner)


@dataclass
class LossByPosition:
    """Summed loss and scored-token counts per bucket of ``edges`` (float64, order-independent
    of how windows were split over ranks: windows are added in index order)."""

    edges: list[int]
    sums: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    windows: int = 0

    def __post_init__(self) -> None:
        if not self.sums:
            self.sums = [0.0] * (len(self.edges) - 1)
            self.counts = [0] * (len(self.edges) - 1)

    def add(self, loss: torch.Tensor, scored: torch.Tensor) -> None:
        """One window's per-position ``loss`` [L] (float) and ``scored`` [L] (bool)."""
        if loss.shape[0] != self.edges[-1]:
            raise ValueError(f"a window of {loss.shape[0]} positions for buckets up to {self.edges[-1]}")
        loss = torch.where(scored, loss.double(), 0.0)
        for i, (lo, hi) in enumerate(zip(self.edges[:-1], self.edges[1:])):
            self.sums[i] += float(loss[lo:hi].sum())
            self.counts[i] += int(scored[lo:hi].sum())
        self.windows += 1

    def means(self) -> list[float | None]:
        return [s / c if c else None for s, c in zip(self.sums, self.counts)]

    def overall(self) -> float | None:
        total = sum(self.counts)
        return sum(self.sums) / total if total else None

    def rows(self) -> list[dict]:
        """One dict per bucket: positions ``[lo, hi)``, mean loss, scored tokens."""
        return [
            {"lo": lo, "hi": hi, "mean_loss": mean, "tokens": count}
            for lo, hi, mean, count in zip(self.edges[:-1], self.edges[1:], self.means(), self.counts)
        ]


@dataclass(frozen=True)
class Window:
    """One held-out window: ``tokens`` [L] and ``labels`` [L] (the next tokens; IGNORE_INDEX
    where nothing is scored)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    start: int  # offset in the token file
    crosses_documents: bool


def file_windows(file: TokenFile, length: int, count: int, seed: int) -> list[Window]:
    """``count`` windows of ``length`` tokens (+1 for the last label) from ``file``: starting at
    the start of documents long enough for a whole window when the file records documents
    (chosen by ``seed``, in file order), else evenly spaced through the file. Every position is
    scored. Raises TokenFileError when the file is too short."""
    need = length + 1
    if file.count < need * count:
        raise TokenFileError(
            f"{file.path}: {file.count} tokens cannot give {count} window(s) of {length}+1 tokens for the loss "
            f"by position; use a longer file, fewer eval.loss_windows or a smaller eval.loss_len"
        )
    starts: list[int] = []
    crosses = True
    if file.knows_documents:
        doc = file.document_starts()
        ends = np.append(doc[1:], file.count)
        long_enough = doc[ends - doc >= need]
        if long_enough.size >= count:
            gen = random.Random(sample_seed("loss-windows", seed, length))
            starts = sorted(int(s) for s in gen.sample(list(long_enough), count))
            crosses = False
    if not starts:
        stride = (file.count - need) // max(1, count - 1) if count > 1 else 0
        starts = [i * stride for i in range(count)]
    out = []
    for start in starts:
        chunk = torch.from_numpy(np.asarray(file.tokens[start : start + need], dtype=np.int64))
        out.append(Window(chunk[:-1].clone(), chunk[1:].clone(), start, crosses))
    return out


def heldout_windows(source, count: int) -> list[Window]:
    """Up to ``count`` of a training source's held-out windows (``TokenFileSource.sample(i,
    "eval")``: its labels, with non-targets ignored)."""
    out = []
    for i in range(min(count, source.eval_sequences)):
        tokens, labels = source.sample(i, "eval")[:2]
        out.append(Window(tokens, labels, (source.train_sequences + i) * source.seq_len, False))
    return out
