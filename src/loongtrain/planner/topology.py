"""Which transfers of a layout leave a node, read from :class:`RankLayout`. Pure.

All context groups (and all head groups) of a layout run their transfers at the same
time, so what matters for a ring step is the slowest hop of the ring and how many
transfers leave each node at once (they share the node's NICs).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.layout import RankLayout


@dataclass(frozen=True)
class RingTraffic:
    """One ring family (inner or outer) of a layout.

    ``crosses``: some hop leaves its node (the ring step then runs at NIC speed);
    ``off_node``/``on_node``: the largest number of hops that leave / stay inside one node
    at the same time (over all rings of the family, per node).
    """

    size: int
    crosses: bool
    off_node: int
    on_node: int


@dataclass(frozen=True)
class HeadTraffic:
    """The head (all-to-all) groups: ``off_peers`` of the ``hp - 1`` peers of a rank are
    on other nodes (largest over ranks); ``ranks_off`` ranks of a node send off it."""

    size: int
    off_peers: int
    ranks_off: int


@dataclass(frozen=True)
class Topology:
    """Node locality of the head groups and both rings of one layout."""

    head: HeadTraffic
    inner: RingTraffic
    outer: RingTraffic

    @property
    def double_ring_concurrent(self) -> bool:
        """Inner and outer hops are in flight together (``1 < window < cp``)."""
        return self.inner.size > 1 and self.outer.size > 1


def _scan_world(sp: int, devices_per_node: int) -> int:
    """Ranks to scan: whole nodes and whole replicas (the pattern repeats beyond)."""
    return sp * devices_per_node // math.gcd(sp, devices_per_node)


def _ring_traffic(rings: list[tuple[int, ...]], devices_per_node: int) -> RingTraffic:
    size = len(rings[0])
    off: dict[int, int] = {}
    on: dict[int, int] = {}
    for members in rings:
        if size < 2:
            break
        for pos, src in enumerate(members):
            dst = members[(pos + 1) % size]
            node = src // devices_per_node
            table = off if dst // devices_per_node != node else on
            table[node] = table.get(node, 0) + 1
    return RingTraffic(
        size=size, crosses=bool(off), off_node=max(off.values(), default=0), on_node=max(on.values(), default=0)
    )


@functools.lru_cache(maxsize=256)
def _rank_table(hp: int, cp: int, placement: str, world: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``table[d][h][c]``: the global rank of coordinates (d, h, c), from ``RankLayout.rank``
    (the window does not move ranks in the contiguous context order)."""
    layout = RankLayout.build(ParallelConfig(hp=hp, cp=cp, placement=placement), world)  # type: ignore[arg-type]
    return tuple(tuple(tuple(layout.rank(d, h, c) for c in range(cp)) for h in range(hp)) for d in range(layout.dp))


@functools.lru_cache(maxsize=4096)
def analyze(hp: int, cp: int, window: int, placement: str, devices_per_node: int) -> Topology:
    """Node locality of a layout's groups on nodes of ``devices_per_node`` ranks.

    Scans every ring and head group of ``lcm(sp, devices_per_node)`` ranks, with members in
    the order ``RankLayout.inner_ring`` / ``outer_ring`` / ``head_group`` give them.
    """
    ParallelConfig(hp=hp, cp=cp, window=window, placement=placement)  # type: ignore[arg-type]  # validates
    table = _rank_table(hp, cp, placement, _scan_world(hp * cp, devices_per_node))
    n = cp // window
    inner_rings, outer_rings, head_groups = [], [], []
    for by_head in table:
        for ranks in by_head:  # context index c = o * window + i
            inner_rings += [ranks[o * window : (o + 1) * window] for o in range(n)]
            outer_rings += [ranks[i::window] for i in range(window)]
        head_groups += [tuple(ranks[c] for ranks in by_head) for c in range(cp)]
    off_peers, ranks_off = 0, {}
    for members in head_groups:
        nodes = [r // devices_per_node for r in members]
        for node in nodes:
            peers_off = sum(1 for other in nodes if other != node)
            off_peers = max(off_peers, peers_off)
            if peers_off:
                ranks_off[node] = ranks_off.get(node, 0) + 1
    return Topology(
        head=HeadTraffic(size=hp, off_peers=off_peers, ranks_off=max(ranks_off.values(), default=0)),
        inner=_ring_traffic(inner_rings, devices_per_node),
        outer=_ring_traffic(outer_rings, devices_per_node),
    )


def group_span(members: tuple[int, ...], devices_per_node: int) -> tuple[int, int]:
    """(nodes the group spans, members on its fullest node)."""
    counts: dict[int, int] = {}
    for r in members:
        counts[r // devices_per_node] = counts.get(r // devices_per_node, 0) + 1
    return len(counts), max(counts.values())
