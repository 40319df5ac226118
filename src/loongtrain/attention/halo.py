"""The halo of a sliding-window layer: only the key/value columns its window reaches. Pure.

The ring (:mod:`routes`) moves whole key/value blocks, one way round: a block read by the
rank just *before* its owner travels ``cp - 1`` hops. Under zigzag rank ``c`` holds chunks
``c`` and ``2cp - 1 - c``; with a window ``w`` below a chunk its first chunk reads the tail of
chunk ``c - 1`` (rank ``c - 1``) and its second the tail of chunk ``2cp - 2 - c`` (rank
``c + 1``), so a sliding layer would move as many bytes as a full one. What it needs is the
``w - 1`` keys before each chunk: the *halo*.

From a :class:`~loongtrain.attention.mask_plan.MaskPlan` alone (no communication), every
rank derives the same :class:`HaloPlan`: for each (reader, owner) pair the local columns of
the owner's block that the reader's calls touch, merged into ranges. The owner sends those
columns once, straight to the reader (one point-to-point transfer per pair and pass); the
reader runs its calls on the compact piece (columns renumbered, the masks' global positions
unchanged); in backward each reader sends the piece's float32 dK/dV back to the owner, which
adds it into its own columns. The bytes of a sliding layer are then ``O(w)`` per rank
whatever the sequence length. A plan takes the halo only where it moves fewer columns than
the ring's routes (:func:`halo_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from loongtrain.attention.routes import RingRoutes

if TYPE_CHECKING:
    from loongtrain.attention.mask_plan import Call, MaskPlan

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class HaloPiece:
    """Columns ``ranges`` (local ``[start, stop)`` of ``owner``'s block) that ``reader`` reads."""

    owner: int
    reader: int
    ranges: Ranges

    @property
    def length(self) -> int:
        return sum(b - a for a, b in self.ranges)

    def renumber(self, calls: tuple[Call, ...]) -> tuple[Call, ...]:
        """``calls`` on the owner's block with their columns renumbered into the compact piece
        (the ranges one after another)."""
        out, offsets, at = [], [], 0
        for a, b in self.ranges:
            offsets.append((a, b, at))
            at += b - a
        for call in calls:
            a, _, base = next(r for r in offsets if r[0] <= call.col0 and call.col1 <= r[1])
            out.append(call._replace(col0=base + call.col0 - a, col1=base + call.col1 - a))
        return tuple(out)


def merged_columns(calls: tuple[Call, ...]) -> Ranges:
    """The columns ``calls`` touch, as sorted disjoint ranges (touching ranges merged)."""
    merged: list[list[int]] = []
    for a, b in sorted((c.col0, c.col1) for c in calls):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return tuple((a, b) for a, b in merged)


@dataclass(frozen=True)
class HaloPlan:
    """Every (owner, reader) piece of one mask plan's context group."""

    cp: int
    pieces: tuple[HaloPiece, ...]

    def incoming(self, context: int) -> tuple[HaloPiece, ...]:
        """The pieces context rank ``context`` reads, by owner."""
        return tuple(p for p in self.pieces if p.reader == context)

    def outgoing(self, context: int) -> tuple[HaloPiece, ...]:
        """The pieces of context rank ``context``'s block that others read, by reader."""
        return tuple(p for p in self.pieces if p.owner == context)

    def columns(self) -> int:
        """Key/value columns moved in one pass over the whole context group."""
        return sum(p.length for p in self.pieces)


def halo_of(masks: MaskPlan) -> HaloPlan:
    """The halo pieces of ``masks``: for each reader and each other rank's block, the columns
    its calls touch."""
    cp = masks.sharding.cp
    pieces = []
    for owner in range(cp):
        for reader in range(cp):
            if reader != owner:
                calls = masks.calls(reader, owner)
                if calls:
                    pieces.append(HaloPiece(owner, reader, merged_columns(calls)))
    return HaloPlan(cp, tuple(pieces))


def ring_columns(routes: RingRoutes, block: int) -> int:
    """Key/value columns the ring's ``routes`` move in one pass (every block ``block`` columns)."""
    return sum(routes.kv_received(c) for c in range(routes.cp)) * block


def halo_plan(masks: MaskPlan, routes: RingRoutes) -> HaloPlan | None:
    """The halo of a sliding-window plan when it moves fewer key/value columns than the ring's
    ``routes`` (the dK/dV partials follow the same columns); None otherwise (full attention,
    one rank, or a window that reaches whole blocks)."""
    if masks.sliding_window is None or masks.sharding.cp == 1:
        return None
    halo = halo_of(masks)
    block = sum(length for _, length in masks.sharding.content[0])
    return halo if halo.columns() < ring_columns(routes, block) else None
