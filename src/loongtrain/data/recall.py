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

import dataclasses
import hashlib
from dataclasses import dataclass

import torch

from loongtrain.data.identity import data_fingerprint

IGNORE_INDEX = -100


def sample_seed(*parts) -> int:
    """A 63-bit seed from any parts (stable across processes and runs)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class RecallVocabulary:
    """Token ids shared by the recall tasks (fields ``filler``, ``keys``, ``values``)."""

    filler: int
    keys: int
    values: int

    def identity(self) -> dict:
        """What decides the task's samples (every field: lengths, vocabulary, seed)."""
        return {"kind": type(self).__name__, **dataclasses.asdict(self)}

    def fingerprint(self) -> str:
        """:meth:`identity`'s digest, which a checkpoint records (a changed seed or length is seen)."""
        return data_fingerprint(self.identity())

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


@dataclass(frozen=True)
class RecallTask(RecallVocabulary):
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


@dataclass(frozen=True)
class PackedRecallTask(RecallVocabulary):
    """Associative recall on packed documents whose facts conflict across documents.

    A sequence of ``seq_len`` tokens holds documents of ``doc_len / 2`` to ``3 * doc_len / 2``
    tokens. Each document states ``facts`` key-value facts among filler and ends with
    ``queries`` questions about its own keys. Keys come from one small pool, so other
    documents of the same sequence state *other* values for the same keys: a model that
    attends across document boundaries is misled, one with document masks is not. With
    RoPE positions restarting per document, a model without masks cannot tell its own
    document's facts from the others by distance either. ``sample`` returns the document
    boundaries as a third element. Token ids as in :class:`RecallTask`.
    """

    seq_len: int
    doc_len: int = 64
    keys: int = 8
    values: int = 8
    facts: int = 4
    queries: int = 4
    filler: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.facts > self.keys:
            raise ValueError(f"recall: facts={self.facts} exceed keys={self.keys} (keys must be distinct)")
        if self.facts + self.queries > self.min_doc_len:
            raise ValueError(
                f"recall: facts + queries = {self.facts + self.queries} do not fit in the shortest document "
                f"({self.min_doc_len} tokens = doc_len / 2); raise data.doc_len or lower facts/queries"
            )
        if self.doc_len > self.seq_len:
            raise ValueError(f"recall: doc_len={self.doc_len} exceeds seq_len={self.seq_len}")

    @property
    def min_doc_len(self) -> int:
        return max(1, self.doc_len // 2)

    def lengths(self, gen: torch.Generator) -> list[int]:
        """Document lengths filling the sequence (the last one takes the remainder)."""
        out, left = [], self.seq_len
        lo, hi = self.min_doc_len, self.doc_len + self.doc_len // 2
        while left >= 2 * lo:
            length = min(left - lo, int(torch.randint(lo, hi + 1, (1,), generator=gen)))
            out.append(length)
            left -= length
        out.append(left)
        return out

    def sample(self, index: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sequence ``index`` of ``split``: (tokens [S], labels [S], cu_seqlens [D+1])."""
        gen = torch.Generator().manual_seed(sample_seed("packed-recall", self.seed, split, index))
        tokens = torch.randint(0, self.filler, (self.seq_len,), generator=gen)
        labels = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        cu = [0]
        for length in self.lengths(gen):
            start, body = cu[-1], length - self.queries
            keys = torch.randperm(self.keys, generator=gen)[: self.facts]
            values = torch.randint(0, self.values, (self.facts,), generator=gen)
            slots = start + torch.randperm(body, generator=gen)[: self.facts]
            tokens[slots] = self.filler + keys * self.values + values
            asked = torch.randint(0, self.facts, (self.queries,), generator=gen)
            tokens[start + body : start + length] = self.query0 + keys[asked]
            labels[start + body : start + length] = self.answer0 + values[asked]
            cu.append(start + length)
        return tokens, labels, torch.tensor(cu, dtype=torch.int64)
