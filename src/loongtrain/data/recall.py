"""Synthetic associative recall over a long sequence.

Each sequence holds ``facts`` key-value facts at random positions among filler tokens;
its last ``queries`` tokens name a key each, and the target at each query is that key's
value. A fact is one token standing for the pair (key, value), so the task needs one
attention hop, but that hop must reach back over the whole sequence: the facts sit
anywhere, the queries at the end, so with sequence parallelism the answer lies on
other ranks' shards. Only the query positions are scored; chance accuracy is
``1 / values``.

Token ids: filler ``[0, F)``, facts ``F + key * V + value``, queries ``Q0 + key``,
answers ``A0 + value``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


def sample_seed(*parts) -> int:
    """A 63-bit seed from any parts (stable across processes and runs)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class RecallTask:
    seq_len: int
    keys: int = 8
    values: int = 8
    facts: int = 4
    queries: int = 32
    filler: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.facts > self.keys:
            raise ValueError(f"recall: facts={self.facts} exceed keys={self.keys} (keys must be distinct)")
        if self.facts + self.queries > self.seq_len:
            raise ValueError(
                f"recall: facts + queries = {self.facts + self.queries} do not fit in seq_len={self.seq_len}"
            )

    @property
    def query0(self) -> int:
        return self.filler + self.keys * self.values

    @property
    def answer0(self) -> int:
        return self.query0 + self.keys

    @property
    def vocab_size(self) -> int:
        return self.answer0 + self.values

    @property
    def chance(self) -> float:
        return 1.0 / self.values

    def sample(self, index: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``index`` of ``split``: (tokens [S], labels [S]); a function of the index."""
        gen = torch.Generator().manual_seed(sample_seed("recall", self.seed, split, index))
        s, body = self.seq_len, self.seq_len - self.queries
        tokens = torch.randint(0, self.filler, (s,), generator=gen)
        labels = torch.full((s,), IGNORE_INDEX, dtype=torch.long)
        keys = torch.randperm(self.keys, generator=gen)[: self.facts]
        values = torch.randint(0, self.values, (self.facts,), generator=gen)
        slots = torch.randperm(body, generator=gen)[: self.facts]
        tokens[slots] = self.filler + keys * self.values + values
        asked = torch.randint(0, self.facts, (self.queries,), generator=gen)
        tokens[body:] = self.query0 + keys[asked]
        labels[body:] = self.answer0 + values[asked]
        return tokens, labels
