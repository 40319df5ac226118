"""Which transfers of a layout leave a node, and through which NIC, read from
:class:`RankLayout`. Pure.

All context groups (and all head groups) of a layout run their transfers at the same
time, so what matters for a ring step is the slowest hop of the ring and how many
transfers share a link: a node's fabric, or a NIC. A node's ``nics_per_node`` NICs serve
consecutive local ranks (GPU-NIC affinity: NCCL sends a GPU's inter-node traffic through
its closest NIC), so the hops of ranks bound to one NIC share it.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass

from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.layout import RankLayout


@dataclass(frozen=True)
class RingTraffic:
    """One ring family (inner or outer) of a layout.

    ``crosses``: some hop leaves its node (the ring step then runs at NIC speed);
    ``off_node``/``on_node``: the largest number of hops that leave / stay inside one node
    at the same time (over all rings of the family, per node); ``per_nic``: the largest
    number of hops that go through one NIC at the same time (sending or receiving).
    """

    size: int
    crosses: bool
    off_node: int
    on_node: int
    per_nic: int = 0


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
    #: distinct (inner hops, outer hops) through one NIC, over the NICs both rings use
    nic_loads: tuple[tuple[int, int], ...] = ()

    @property
    def double_ring_concurrent(self) -> bool:
        """Inner and outer hops are in flight together (``1 < ring_window < cp``)."""
        return self.inner.size > 1 and self.outer.size > 1


def _scan_world(sp: int, devices_per_node: int) -> int:
    """Ranks to scan: whole nodes and whole replicas (the pattern repeats beyond)."""
    return sp * devices_per_node // math.gcd(sp, devices_per_node)


def nic_of(rank: int, devices_per_node: int, nics_per_node: int) -> tuple[int, int]:
    """``(node, NIC)`` that ``rank``'s inter-node traffic goes through: NICs serve consecutive local ranks."""
    node, local = divmod(rank, devices_per_node)
    return node, local * nics_per_node // devices_per_node


@functools.lru_cache(maxsize=64)
def _nodes_and_nics(world: int, devices_per_node: int, nics_per_node: int) -> tuple[list[int], list[int]]:
    """Every rank's node and NIC (numbered over all nodes)."""
    node = [r // devices_per_node for r in range(world)]
    return node, [node[r] * nics_per_node + nic_of(r, devices_per_node, nics_per_node)[1] for r in range(world)]


def _ring_traffic(rings: list[tuple[int, ...]], node: list[int], nic: list[int]) -> tuple[RingTraffic, dict]:
    """The family's traffic and its hops per NIC (``{NIC id: hops}``, receiving sides as
    ``~id``); ``node`` and ``nic`` give every scanned rank's node and (globally numbered) NIC."""
    size = len(rings[0])
    off, on = [0] * (node[-1] + 1), [0] * (node[-1] + 1)
    sent, received = [0] * (nic[-1] + 1), [0] * (nic[-1] + 1)
    if size > 1:
        for members in rings:
            for src, dst in zip(members, members[1:] + members[:1]):
                a = node[src]
                if a == node[dst]:
                    on[a] += 1
                else:
                    off[a] += 1
                    sent[nic[src]] += 1
                    received[nic[dst]] += 1
    nics = {i: hops for i, hops in enumerate(sent) if hops} | {~i: hops for i, hops in enumerate(received) if hops}
    traffic = RingTraffic(
        size=size, crosses=any(off), off_node=max(off), on_node=max(on), per_nic=max(nics.values(), default=0)
    )
    return traffic, nics


@functools.lru_cache(maxsize=256)
def _rank_table(hp: int, cp: int, placement: str, world: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``table[d][h][c]``: the global rank of coordinates (d, h, c), from ``RankLayout.rank``
    (the ring window does not move ranks in the contiguous context order)."""
    layout = RankLayout.build(ParallelConfig(hp=hp, cp=cp, placement=placement), world)  # type: ignore[arg-type]
    return tuple(tuple(tuple(layout.rank(d, h, c) for c in range(cp)) for h in range(hp)) for d in range(layout.dp))


@functools.lru_cache(maxsize=4096)
def analyze(config: ParallelConfig, devices_per_node: int, nics_per_node: int | None = None) -> Topology:
    """Node locality of ``config``'s groups on nodes of ``devices_per_node`` ranks with
    ``nics_per_node`` NICs (default: one per rank); ``config.dp`` is ignored.

    Scans every ring and head group of ``lcm(sp, devices_per_node)`` ranks, with members in
    the order ``RankLayout.inner_ring`` / ``outer_ring`` / ``head_group`` give them.
    """
    nics_per_node = nics_per_node or devices_per_node
    hp, cp, placement, w = config.hp, config.cp, config.placement, config.ring_window
    table = _rank_table(hp, cp, placement, _scan_world(hp * cp, devices_per_node))
    inner_rings, outer_rings = [], []
    for by_head in table:
        for ranks in by_head:  # context index c = o * ring_window + i
            inner_rings += [ranks[o * w : (o + 1) * w] for o in range(config.n_ring_windows)]
            outer_rings += [ranks[i::w] for i in range(w)]
    node, nic = _nodes_and_nics(len(table) * hp * cp, devices_per_node, nics_per_node)
    inner, inner_nics = _ring_traffic(inner_rings, node, nic)
    outer, outer_nics = _ring_traffic(outer_rings, node, nic)
    loads = {(inner_nics.get(i, 0), outer_nics.get(i, 0)) for i in inner_nics.keys() | outer_nics.keys()}
    return Topology(
        head=_head_traffic(hp, cp, placement, devices_per_node),
        inner=inner,
        outer=outer,
        nic_loads=tuple(sorted(loads)),
    )


@functools.lru_cache(maxsize=1024)
def _head_traffic(hp: int, cp: int, placement: str, devices_per_node: int) -> HeadTraffic:
    """The head groups' node locality (the ring window does not move ranks)."""
    table = _rank_table(hp, cp, placement, _scan_world(hp * cp, devices_per_node))
    off_peers, ranks_off = 0, {}
    for by_head in table:
        for c in range(cp):
            per_node = Counter(ranks[c] // devices_per_node for ranks in by_head)
            for node, here in per_node.items():
                peers_off = hp - here  # the group's members on other nodes
                off_peers = max(off_peers, peers_off)
                if peers_off:
                    ranks_off[node] = ranks_off.get(node, 0) + here
    return HeadTraffic(size=hp, off_peers=off_peers, ranks_off=max(ranks_off.values(), default=0))


def group_span(members: tuple[int, ...], devices_per_node: int) -> tuple[int, int]:
    """(nodes the group spans, members on its fullest node)."""
    counts: dict[int, int] = {}
    for r in members:
        counts[r // devices_per_node] = counts.get(r // devices_per_node, 0) + 1
    return len(counts), max(counts.values())
