"""Document-aware load balance: which equal-token chunks each context rank holds. Pure.

Zigzag (chunks ``c`` and ``2cp-1-c`` of ``2cp``) balances causal work for one long
document, not for a mix of documents. The ``documents`` balance cuts the sequence into
``m * cp`` equal chunks, estimates each chunk's attention work from the document
boundaries (the keys its tokens see), and gives every context rank ``m`` chunks so that
the largest per-rank work is as small as a deterministic greedy finds: chunks by
decreasing work, each onto the least-loaded rank that still has room (ties: lowest
index). ``m`` grows (2, 4, 8, ...) until the imbalance is within 2% or chunks would get
shorter than :data:`MIN_CHUNK` tokens; the best assignment found is kept. Every rank
computes the same answer from the same boundaries, with no communication.

Work is counted for causal attention without a sliding window (what the sharding knows); with
a sliding window or full attention the assignment is still valid, only balanced for the
causal case.
"""

from __future__ import annotations

from dataclasses import dataclass

from loongtrain.attention.documents import Boundaries, range_work

#: Chunks are not cut shorter than this (kernel efficiency falls with tiny blocks).
MIN_CHUNK = 64
#: Stop refining once max/mean work per rank is within this factor.
GOOD_ENOUGH = 1.02
CHUNK_COUNTS = (2, 4, 8, 16, 32)


@dataclass(frozen=True)
class ChunkAssignment:
    """``chunks[c]``: the global ``(start, length)`` chunks of context rank ``c``, ascending."""

    chunks: tuple[tuple[tuple[int, int], ...], ...]
    loads: tuple[int, ...]  # attention work per context rank

    @property
    def imbalance(self) -> float:
        """max / mean work per rank (1.0 is perfect)."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean else 1.0


def greedy_assign(works: list[int], ranks: int, per_rank: int) -> list[list[int]]:
    """Chunk indices per rank: decreasing work onto the least-loaded rank with room."""
    order = sorted(range(len(works)), key=lambda i: (-works[i], i))
    loads = [0] * ranks
    members: list[list[int]] = [[] for _ in range(ranks)]
    for index in order:
        rank = min((r for r in range(ranks) if len(members[r]) < per_rank), key=lambda r: (loads[r], r))
        members[rank].append(index)
        loads[rank] += works[index]
    return [sorted(m) for m in members]


def assignment(seq_len: int, cp: int, per_rank: int, boundaries: Boundaries) -> ChunkAssignment:
    """The greedy assignment of ``per_rank * cp`` equal chunks over ``cp`` ranks."""
    n = per_rank * cp
    size = seq_len // n
    works = [range_work(boundaries, i * size, (i + 1) * size) for i in range(n)]
    members = greedy_assign(works, cp, per_rank)
    return ChunkAssignment(
        chunks=tuple(tuple((i * size, size) for i in m) for m in members),
        loads=tuple(sum(works[i] for i in m) for m in members),
    )


def balance_documents(seq_len: int, cp: int, boundaries: Boundaries) -> ChunkAssignment:
    """The document-aware assignment (see the module docstring). ``seq_len % (2 * cp) == 0``."""
    if seq_len % (2 * cp) != 0:
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp}")
    best: ChunkAssignment | None = None
    for per_rank in CHUNK_COUNTS:
        if seq_len % (per_rank * cp) != 0 or (per_rank > 2 and seq_len // (per_rank * cp) < MIN_CHUNK):
            break
        found = assignment(seq_len, cp, per_rank, boundaries)
        if best is None or found.imbalance < best.imbalance - 1e-9:
            best = found
        if best.imbalance <= GOOD_ENOUGH:
            break
    return best
