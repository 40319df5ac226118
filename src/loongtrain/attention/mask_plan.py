"""Which kernels a (query block, key/value block) pair runs under a document / sliding-window mask. Pure.

A context rank's block is its *content* (see :mod:`sharding`): chunks in ascending global
order. Cut at document boundaries, a block is a list of *segments*: runs of consecutive
global positions inside one chunk and one document. Two segments of the same sharding
are either the same global range or disjoint, so for a query segment ``a`` and a key
segment ``b`` of one document, token ``i`` of ``a`` sees the contiguous key interval
``[lo(i), hi(i)]`` of ``b`` (causal: ``j <= i``; sliding window: ``|i - j| < W``), with ``lo``
and ``hi`` non-decreasing in ``i``. From that, pure interval arithmetic classifies each
pair, and the block becomes a list of :class:`Call` s:

- ``full``: every row sees every column: the plain kernel;
- ``causal``: a square whose rows see the columns up to their own (top-left aligned
  causal kernel);
- ``band``: anything else (sliding-window edges): a masked kernel on a row tile trimmed
  to the columns its rows see, so no row is fully masked and masks stay small; for a kernel
  that takes the band as its window (no mask: ``band_tile`` 0) one call per segment pair.

Pairs with no visible token run nothing. Full calls on adjacent rows/columns are merged,
and in a rank's own block each document's segments form one causal call when the sliding window
does not cut it, so a single document under zigzag runs exactly the kernels of the plain
causal ring. Rows and columns of a call are contiguous local ranges (no gathers).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from loongtrain.attention.documents import Boundaries, document_of
from loongtrain.attention.routes import RingRoutes, ring_routes
from loongtrain.attention.schedule import BlockKind, ring_source
from loongtrain.attention.sharding import SequenceSharding
from loongtrain.parallel.config import ParallelConfig

FULL, CAUSAL, BAND = "full", "causal", "band"
#: Largest row tile of a masked (band) call; a tile of ``t`` rows costs a
#: ``t x (sliding_window + t)`` mask.
MAX_BAND_TILE = 512
MIN_BAND_TILE = 64


class Segment(NamedTuple):
    """A run of consecutive global positions in one chunk and one document."""

    local: int  # first local index
    start: int  # first global position
    length: int
    doc: int


class Call(NamedTuple):
    """One kernel call: local query rows ``[row0, row1)`` against local key columns ``[col0, col1)``.

    ``kind`` is ``full``, ``causal`` or ``band``; for ``band``, ``q_start``/``k_start`` are the
    global positions of the first row and column (the mask is computed from them).
    """

    row0: int
    row1: int
    col0: int
    col1: int
    kind: str
    q_start: int = 0
    k_start: int = 0

    @property
    def computed(self) -> int:
        """Score elements the kernel computes (a causal square counts its triangle)."""
        rows, cols = self.row1 - self.row0, self.col1 - self.col0
        return rows * (rows + 1) // 2 if self.kind == CAUSAL else rows * cols


def zigzag_calls(kind: BlockKind, rows: int) -> tuple[Call, ...]:
    """The one call of a zigzag block of ``kind`` on ``rows`` local tokens (two chunks): what a
    :class:`MaskPlan` of one zigzag document gives (tested), for pricing and timing a block."""
    half = rows // 2
    return {
        BlockKind.DIAGONAL: (Call(0, rows, 0, rows, CAUSAL),),
        BlockKind.FULL: (Call(0, rows, 0, rows, FULL),),
        BlockKind.KV_FIRST_HALF: (Call(0, rows, 0, half, FULL),),
        BlockKind.Q_SECOND_HALF: (Call(half, rows, 0, rows, FULL),),
    }[kind]


def segments(ranges, boundaries: Boundaries) -> list[Segment]:
    """The segments of content ``ranges`` (global ``(start, length)`` in local order)."""
    out: list[Segment] = []
    local = 0
    for start, length in ranges:
        pos, end = start, start + length
        doc = document_of(boundaries, pos)
        while pos < end:
            stop = min(end, boundaries[doc + 1])
            out.append(Segment(local, pos, stop - pos, doc))
            local += stop - pos
            pos, doc = stop, doc + 1
    return out


@dataclass(frozen=True)
class _Pair:
    """Visibility of key range ``[ks, ke)`` from query range ``[qs, qe)`` (one document)."""

    qs: int
    qe: int
    ks: int
    ke: int
    causal: bool
    sliding_window: int | None

    def lo(self, i: int) -> int:
        return self.ks if self.sliding_window is None else max(self.ks, i - self.sliding_window + 1)

    def hi(self, i: int) -> int:
        if self.causal:
            return min(self.ke - 1, i)
        return self.ke - 1 if self.sliding_window is None else min(self.ke - 1, i + self.sliding_window - 1)

    def rows(self) -> tuple[int, int] | None:
        """First and last query position that sees any key, or None."""
        first, last = self.qs, self.qe - 1
        if self.causal:
            first = max(first, self.ks)
        if self.sliding_window is not None:
            first = max(first, self.ks - self.sliding_window + 1)
            last = min(last, self.ke + self.sliding_window - 2)
        return (first, last) if first <= last else None


def _tile_call(pair: _Pair, t0: int, t1: int, row_base: int, col_base: int) -> Call:
    """The call for query positions ``[t0, t1]`` (inclusive, all seeing something)."""
    lo0, hi1 = pair.lo(t0), pair.hi(t1)
    row0, row1 = row_base + t0 - pair.qs, row_base + t1 + 1 - pair.qs
    col0, col1 = col_base + lo0 - pair.ks, col_base + hi1 + 1 - pair.ks
    if pair.lo(t1) == lo0 and pair.hi(t0) == hi1:
        return Call(row0, row1, col0, col1, FULL)
    if pair.lo(t1) == lo0 and pair.hi(t0) == lo0 and hi1 - lo0 == t1 - t0:
        return Call(row0, row1, col0, col1, CAUSAL)
    return Call(row0, row1, col0, col1, BAND, t0, lo0)


def pair_calls(
    a: Segment, b: Segment, causal: bool, sliding_window: int | None, band_tile: int = MAX_BAND_TILE
) -> list[Call]:
    """Calls for query segment ``a`` against key segment ``b`` of the same document; a band in
    row tiles of at most ``band_tile`` rows (0: untiled, for kernels that take it as a window)."""
    pair = _Pair(a.start, a.start + a.length, b.start, b.start + b.length, causal, sliding_window)
    rows = pair.rows()
    if rows is None:
        return []
    first, last = rows
    whole = _tile_call(pair, first, last, a.local, b.local)
    if whole.kind != BAND or band_tile == 0:
        return [whole]
    tile = max(MIN_BAND_TILE, min(band_tile, sliding_window or band_tile))
    return [_tile_call(pair, t, min(t + tile, last + 1) - 1, a.local, b.local) for t in range(first, last + 1, tile)]


def _merge_full(calls: list[Call]) -> list[Call]:
    """Merge full calls that share rows and touch in columns, then share columns and touch in rows."""
    full = sorted(c for c in calls if c.kind == FULL)
    rest = [c for c in calls if c.kind != FULL]
    merged: list[Call] = []
    for c in full:  # sorted by rows then columns
        if merged and merged[-1][:2] == c[:2] and merged[-1].col1 == c.col0:
            merged[-1] = merged[-1]._replace(col1=c.col1)
        else:
            merged.append(c)
    merged.sort(key=lambda c: (c.col0, c.col1, c.row0))
    out: list[Call] = []
    for c in merged:
        if out and (out[-1].col0, out[-1].col1) == (c.col0, c.col1) and out[-1].row1 == c.row0:
            out[-1] = out[-1]._replace(row1=c.row1)
        else:
            out.append(c)
    return sorted(out + rest)


def block_calls(
    q_segs: list[Segment], k_segs: list[Segment], same_block: bool, causal: bool, sliding_window: int | None,
    band_tile: int = MAX_BAND_TILE,
) -> tuple[Call, ...]:  # fmt: skip
    """The calls of one (query block, key/value block) pair, sorted by rows."""
    by_doc: dict[int, list[Segment]] = {}
    for s in k_segs:
        by_doc.setdefault(s.doc, []).append(s)
    calls: list[Call] = []
    q_by_doc: dict[int, list[Segment]] = {}
    for s in q_segs:
        q_by_doc.setdefault(s.doc, []).append(s)
    for doc, qs in q_by_doc.items():
        ks = by_doc.get(doc)
        if not ks:
            continue
        if same_block:
            first, last = qs[0], qs[-1]
            span = last.start + last.length - 1 - first.start
            if sliding_window is None or span < sliding_window:  # one square: the document's own triangle (or all)
                row0, row1 = first.local, last.local + last.length
                calls.append(Call(row0, row1, row0, row1, CAUSAL if causal else FULL))
                continue
        for a in qs:
            for b in ks:
                calls += pair_calls(a, b, causal, sliding_window, band_tile)
    return tuple(_merge_full(calls))


@dataclass(frozen=True)
class MaskPlan:
    """The calls of every (context rank, key/value source) pair for one mask and sharding."""

    sharding: SequenceSharding
    boundaries: Boundaries
    causal: bool
    sliding_window: int | None
    band_tile: int = MAX_BAND_TILE  # rows of a band call at most (0: untiled, a kernel's window)

    @functools.cached_property
    def _segments(self) -> list[list[Segment]]:
        return [segments(self.sharding.content[c], self.boundaries) for c in range(self.sharding.cp)]

    def segments(self, context: int) -> list[Segment]:
        return self._segments[context]

    @functools.cached_property
    def _calls(self) -> dict[tuple[int, int], tuple[Call, ...]]:
        return {}

    def calls(self, context: int, source: int) -> tuple[Call, ...]:
        """Calls of context rank ``context`` on the key/value block of context rank ``source``."""
        found = self._calls.get((context, source))
        if found is None:
            found = self._calls[(context, source)] = block_calls(
                self._segments[context],
                self._segments[source],
                context == source,
                self.causal,
                self.sliding_window,
                self.band_tile,
            )
        return found

    def reads(self, context: int, source: int) -> bool:
        """Whether some query of context rank ``context`` sees a key of ``source``'s block."""
        if context == source:
            return bool(self._segments[context])
        keys: dict[int, list[Segment]] = {}
        for b in self._segments[source]:
            keys.setdefault(b.doc, []).append(b)
        for a in self._segments[context]:
            for b in keys.get(a.doc, ()):
                pair = _Pair(a.start, a.start + a.length, b.start, b.start + b.length, self.causal, self.sliding_window)
                if pair.rows() is not None:
                    return True
        return False

    @functools.cached_property
    def _routes(self) -> dict[int, RingRoutes]:
        return {}

    def routes(self, config: ParallelConfig) -> RingRoutes:
        """The transfers of ``config``'s double ring under this mask (:mod:`routes`; cached)."""
        found = self._routes.get(config.ring_window)
        if found is None:
            cp = self.sharding.cp
            reads = [[self.reads(c, src) for src in range(cp)] for c in range(cp)]
            found = self._routes[config.ring_window] = ring_routes(config, reads)
        return found

    @functools.cached_property
    def _halos(self) -> dict:
        return {}

    def halo(self, config: ParallelConfig):
        """The :class:`~loongtrain.attention.halo.HaloPlan` a sliding window takes instead of
        ``config``'s ring when it moves fewer key/value columns; None: the ring (cached)."""
        if config.ring_window not in self._halos:
            from loongtrain.attention.halo import halo_plan  # halo reads this plan's calls

            self._halos[config.ring_window] = halo_plan(self, self.routes(config))
        return self._halos[config.ring_window]

    @functools.cached_property
    def _empty_steps(self) -> dict[int, frozenset[tuple[int, int]]]:
        return {}

    def empty_steps(self, config: ParallelConfig) -> frozenset[tuple[int, int]]:
        """Ring steps ``(outer, inner)`` of ``config``'s double ring at which no rank of the
        context group computes anything."""
        found = self._empty_steps.get(config.ring_window)
        if found is None:
            cp = self.sharding.cp
            found = self._empty_steps[config.ring_window] = frozenset(
                (j, s)
                for j in range(config.n_ring_windows)
                for s in range(config.ring_window)
                if not any(self.calls(c, ring_source(c, config, j, s)) for c in range(cp))
            )
        return found
