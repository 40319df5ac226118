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

The ``locality`` balance (:func:`balance_locality`) also weighs where the keys must go:
documents stay whole on one rank where the balance allows, long ones lie on runs of
ring-adjacent ranks, so the ring (whose routes follow the documents,
:mod:`loongtrain.attention.routes`) carries only what they need.

Work is counted for causal attention without a sliding window (what the sharding knows); with
a sliding window or full attention the assignment is still valid, only balanced for the
causal case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loongtrain.attention.documents import Boundaries, document_of, range_work

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


# -- locality: documents whole where they fit, long ones on a contiguous run of ranks ----
#: How widely a document with more work than ``mean / spread`` is cut: into ``k = ceil(spread *
#: work / mean)`` pieces. Contiguous pieces of equal length have causal work rising 1 : 3 : 5
#: ..., so the last of ``k`` pieces does about ``2 / k`` of the document's work: ``spread = 2``
#: keeps it within a rank's mean. Each value is tried; see :func:`balance_locality`.
SPREADS = (1.0, 1.5, 2.0, 3.0, 4.0, 1e9)
#: The largest work imbalance (max / mean) locality accepts before trading locality for balance.
LOCALITY_IMBALANCE = 1.10


def _even_parts(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def _merged(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for start, length in sorted(ranges):
        if out and out[-1][0] + out[-1][1] == start:
            out[-1][1] += length
        else:
            out.append([start, length])
    return tuple((s, n) for s, n in out)


def balance_locality(seq_len: int, cp: int, boundaries: Boundaries) -> ChunkAssignment:
    """Each context rank ``seq_len / cp`` tokens, documents kept on as few ring-adjacent ranks
    as the work balance allows. Pure and deterministic (every rank computes the same).

    Tries :data:`SPREADS` (:func:`locality_assignment`) and keeps, among the assignments
    whose imbalance is at most :data:`LOCALITY_IMBALANCE`, the one that cuts documents into
    the fewest pieces (then: lower imbalance); when none is balanced enough, the most
    balanced one.
    """
    if seq_len % (2 * cp) != 0:
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp}")
    found = [locality_assignment(seq_len, cp, boundaries, spread) for spread in SPREADS]
    good = [a for a in found if a.imbalance <= LOCALITY_IMBALANCE]
    if good:
        return min(good, key=lambda a: (document_pieces(a, boundaries), a.imbalance))
    return min(found, key=lambda a: (a.imbalance, document_pieces(a, boundaries)))


def document_pieces(found: ChunkAssignment, boundaries: Boundaries) -> int:
    """How many (rank, document) pieces an assignment makes (the documents' count when none is cut)."""
    total = 0
    for chunks in found.chunks:
        docs: set[int] = set()
        for start, length in chunks:
            docs.update(range(document_of(boundaries, start), document_of(boundaries, start + length - 1) + 1))
        total += len(docs)
    return total


def _shortest_run(room: list[int], length: int) -> int:
    """First rank of the shortest run of consecutive ranks (wrapping) with ``length`` tokens of
    room in all (ties: more room, then the lower rank)."""
    cp = len(room)
    best = None
    for r in range(cp):
        total, m = 0, 0
        while total < length and m < cp:
            total += room[(r + m) % cp]
            m += 1
        if total >= length and (best is None or (m, -total, r) < best):
            best = (m, -total, r)
    return best[2]


def locality_assignment(seq_len: int, cp: int, boundaries: Boundaries, spread: float) -> ChunkAssignment:
    """One locality assignment (see :func:`balance_locality`) for one ``spread``:

    - A document whose causal work is within ``mean / spread`` of a rank's mean work and
      that fits in a shard stays whole on one rank.
    - A larger one is cut into ``k`` equal contiguous pieces on consecutive context ranks
      ``r, r + 1, ...`` (wrapping around the ring), so its keys only travel forward, to the
      ranks that read them; ``r`` is the run whose busiest rank is least loaded. A document
      that needs the whole ring is cut zigzag over it instead (chunks ``c`` and ``2k - 1 - c``),
      the balanced layout of one long document.
    - The whole documents then go, by decreasing work, to the least-loaded rank with room;
      one that fits nowhere whole is split over the shortest run of adjacent ranks with
      room for it.
    """
    shard = seq_len // cp
    docs = [(boundaries[i], boundaries[i + 1] - boundaries[i]) for i in range(len(boundaries) - 1)]
    works = [range_work(boundaries, start, start + length) for start, length in docs]
    mean = sum(works) / cp
    room = [shard] * cp
    loads = [0] * cp
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(cp)]

    def put(rank: int, start: int, length: int) -> None:
        ranges[rank].append((start, length))
        room[rank] -= length
        loads[rank] += range_work(boundaries, start, start + length)

    wide, whole = [], []
    for index, ((_, length), work) in enumerate(zip(docs, works)):
        k = max(-(-length // shard), math.ceil(min(spread * work / mean, cp) - 1e-9) if mean else 1)
        (wide if k > 1 else whole).append((work, index, min(k, cp)))
    for work, index, k in sorted(wide, key=lambda x: (-x[0], x[1])):
        start, length = docs[index]
        chunks = _even_parts(length, 2 * cp)
        if k == cp and all(room[c] >= chunks[c] + chunks[2 * cp - 1 - c] for c in range(cp)):
            # the whole ring: zigzag pieces (balanced for one document)
            offsets = [start + sum(chunks[:i]) for i in range(2 * cp)]
            for c in range(cp):
                for i in (c, 2 * cp - 1 - c):
                    put(c, offsets[i], chunks[i])
            continue
        while True:  # more ranks until some run has room for the pieces
            pieces = _even_parts(length, k)
            runs = [r for r in range(cp) if all(room[(r + m) % cp] >= pieces[m] for m in range(k))]
            if runs or k == cp:
                break
            k += 1
        if not runs:  # no run has room for equal pieces: placed (split) with the whole ones
            whole.append((work, index, 0))
            continue
        gain = [range_work(boundaries, start + sum(pieces[:m]), start + sum(pieces[: m + 1])) for m in range(k)]
        best = min(runs, key=lambda r: (max(loads[(r + m) % cp] + gain[m] for m in range(k)), r))
        offset = start
        for m in range(k):
            put((best + m) % cp, offset, pieces[m])
            offset += pieces[m]
    for _, index, _ in sorted(whole, key=lambda x: (-x[0], x[1])):
        start, length = docs[index]
        fits = [r for r in range(cp) if room[r] >= length]
        if fits:
            put(min(fits, key=lambda r: (loads[r], r)), start, length)
            continue
        rank = _shortest_run(room, length)
        while length:  # split over the shortest run of ring-adjacent ranks with room for it
            take = min(room[rank], length)
            if take:
                put(rank, start, take)
                start, length = start + take, length - take
            rank = (rank + 1) % cp
    assert all(r == 0 for r in room), room  # every token placed exactly once
    return ChunkAssignment(chunks=tuple(_merged(r) for r in ranges), loads=tuple(loads))
