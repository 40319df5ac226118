"""Event-driven simulation of one layer's attention (forward, then backward) on the ranks
of one context group. Pure.

Each rank runs a program transcribed from ``attention/double_ring.py`` (and the head
all-to-alls of ``attention/ops.py``): compute a block, start a ring exchange, wait for
one. A transfer starts when its sender and receiver have both posted it and the
sender's link of that ring is free; links are FIFO resources, so a KV block and a dK/dV
partial on the same ring queue behind each other. Durations come from the cost model
(:mod:`loongtrain.planner.cost`). Transfers are assumed not to slow compute (separate
copy engines, ``overlap = 1``).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

from loongtrain.attention.schedule import block_kind, ring_source
from loongtrain.planner.cost import (
    Layout,
    Workload,
    all_to_all_seconds,
    block_seconds,
    kv_block_bytes,
    replicated_kv_heads,
    ring_hop_seconds,
)
from loongtrain.planner.specs import ClusterSpec, PlanError
from loongtrain.planner.topology import Topology, analyze


@dataclass(frozen=True)
class Interval:
    """Something one rank did: ``lane`` is ``compute``, ``all-to-all``, ``inner link`` or ``outer link``."""

    rank: int
    lane: str
    label: str
    start: float
    end: float


@dataclass
class Timeline:
    """Intervals of one pass (forward or backward) of every simulated rank."""

    intervals: list[Interval] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max((i.end for i in self.intervals), default=0.0)

    def busy(self, rank: int, lane: str = "compute") -> float:
        return sum(i.end - i.start for i in self.intervals if i.rank == rank and i.lane == lane)

    def exposed(self, rank: int = 0) -> float:
        """Time rank ``rank`` is not computing (waiting on transfers or all-to-alls)."""
        return self.makespan - self.busy(rank)

    def count(self, lane: str, label_prefix: str, rank: int = 0) -> int:
        """Transfers sent (link lanes) or blocks run by ``rank`` whose label starts with ``label_prefix``."""
        return sum(1 for i in self.intervals if i.rank == rank and i.lane == lane and i.label.startswith(label_prefix))


# -- the engine -------------------------------------------------------------------------
@dataclass(frozen=True)
class Compute:
    label: str
    seconds: float
    lane: str = "compute"


@dataclass(frozen=True)
class Exchange:
    ring: str  # "inner" or "outer"
    kind: str  # "kv" or "dkv"


@dataclass(frozen=True)
class Wait:
    handle: tuple | None  # None: already complete


Program = Generator  # yields Compute | Exchange | Wait; Exchange is answered with a handle


class _Engine:
    def __init__(self, programs: dict[int, Program], peers: dict[tuple[str, int], tuple[int, int]], hop) -> None:
        self.programs = programs
        self.peers = peers  # (ring, rank) -> (send_to, recv_from)
        self.hop = hop  # (ring, kind) -> seconds
        self.clock = dict.fromkeys(programs, 0.0)
        self.posts: dict[tuple, float] = {}  # (ring, kind, seq, sender) -> time both sides posted so far
        self.posted_by: dict[tuple, set] = {}
        self.seq: dict[tuple, int] = {}
        self.done: dict[tuple, float] = {}  # transfer key (ring, kind, seq, sender) -> end time
        self.link_free: dict[tuple[str, int], float] = {}
        self.timeline = Timeline()

    def _post(self, rank: int, ring: str, kind: str) -> tuple:
        k = self.seq.get((rank, ring, kind), 0)
        self.seq[(rank, ring, kind)] = k + 1
        send_to, recv_from = self.peers[(ring, rank)]
        now = self.clock[rank]
        for key, sender in (((ring, kind, k, rank), rank), ((ring, kind, k, recv_from), recv_from)):
            self.posts[key] = max(self.posts.get(key, 0.0), now)
            self.posted_by.setdefault(key, set()).add(rank)
            receiver = self.peers[(ring, sender)][0]
            if {sender, receiver} <= self.posted_by[key] and key not in self.done:
                start = max(self.posts[key], self.link_free.get((ring, sender), 0.0))
                end = start + self.hop(ring, kind)
                self.link_free[(ring, sender)] = end
                self.done[key] = end
                self.timeline.intervals.append(Interval(sender, f"{ring} link", f"{kind} #{k}", start, end))
        return (ring, kind, k, recv_from)  # the handle: the transfer into this rank

    def run(self) -> Timeline:
        """Advance the rank that can act earliest until every program has finished."""
        reply: dict[int, object] = dict.fromkeys(self.programs)  # value sent into each generator next
        waiting: dict[int, tuple] = {}
        active = set(self.programs)
        while active:
            times = {
                r: max(self.clock[r], self.done[waiting[r]]) if r in waiting else self.clock[r]
                for r in active
                if r not in waiting or waiting[r] in self.done
            }
            if not times:
                raise RuntimeError(f"schedule deadlock: ranks {sorted(waiting)} wait on transfers never posted")
            rank = min(times, key=lambda r: (times[r], r))
            self.clock[rank] = times[rank]
            waiting.pop(rank, None)
            while True:
                try:
                    op = self.programs[rank].send(reply[rank])
                except StopIteration:
                    active.discard(rank)
                    break
                reply[rank] = None
                if isinstance(op, Compute):
                    start = self.clock[rank]
                    self.clock[rank] = start + op.seconds
                    self.timeline.intervals.append(Interval(rank, op.lane, op.label, start, self.clock[rank]))
                elif isinstance(op, Exchange):
                    reply[rank] = self._post(rank, op.ring, op.kind)
                elif isinstance(op, Wait) and op.handle is not None:
                    if op.handle not in self.done:
                        waiting[rank] = op.handle
                        break
                    self.clock[rank] = max(self.clock[rank], self.done[op.handle])
        return self.timeline


# -- the programs (transcribed from attention/double_ring.py) ---------------------------
@dataclass(frozen=True)
class _Costs:
    block_fwd: float
    block_bwd: float
    block_fwd_first: float
    block_bwd_first: float
    a2a_qkv: float
    a2a_out: float


def _forward(c: int, layout: Layout, costs: _Costs, causal: bool) -> Program:
    n, w = layout.n_windows, layout.window
    if layout.hp > 1:
        yield Compute("q, kv", costs.a2a_qkv, "all-to-all")
    for j in range(n):
        outer = (yield Exchange("outer", "kv")) if j + 1 < n else None
        for s in range(w):
            inner = (yield Exchange("inner", "kv")) if s + 1 < w else None
            kind = block_kind(ring_source(c, layout.cp, w, j, s), c, causal).value
            first = j == 0 and s == 0
            yield Compute(f"fwd {kind}", costs.block_fwd_first if first else costs.block_fwd)
            yield Wait(inner)
        yield Wait(outer)
    if layout.hp > 1:
        yield Compute("out", costs.a2a_out, "all-to-all")


def _finish_outer_step(j: int, window_total, outer_in, n: int) -> Program:
    yield Wait(window_total)
    if j > 0:
        yield Wait(outer_in)
    if n == 1:
        return None
    return (yield Exchange("outer", "dkv"))


def _backward(c: int, layout: Layout, costs: _Costs, causal: bool) -> Program:
    n, w = layout.n_windows, layout.window
    if layout.hp > 1:
        yield Compute("dout", costs.a2a_out, "all-to-all")
    tail = None
    outer_in = inner_dkv = None
    for j in range(n):
        outer_kv = (yield Exchange("outer", "kv")) if j + 1 < n else None
        for s in range(w):
            inner_kv = (yield Exchange("inner", "kv")) if s + 1 < w else None
            kind = block_kind(ring_source(c, layout.cp, w, j, s), c, causal).value
            first = j == 0 and s == 0
            yield Compute(f"bwd {kind}", costs.block_bwd_first if first else costs.block_bwd)
            if s > 0:
                yield Wait(inner_dkv)
            if tail is not None:
                outer_in = yield from _finish_outer_step(*tail, outer_in, n)
                tail = None
            if w > 1:
                inner_dkv = yield Exchange("inner", "dkv")
            yield Wait(inner_kv)
        tail = (j, inner_dkv if w > 1 else None)
        yield Wait(outer_kv)
    final = yield from _finish_outer_step(*tail, outer_in, n)
    yield Wait(final)
    if layout.hp > 1:
        yield Compute("dq, dkv", costs.a2a_qkv, "all-to-all")


def _ring_peers(layout: Layout) -> dict[tuple[str, int], tuple[int, int]]:
    """Next and previous context index on the inner and outer ring (as ``RankLayout`` orders them)."""
    n, w = layout.n_windows, layout.window
    peers = {}
    for c in range(layout.cp):
        o, i = divmod(c, w)
        peers[("inner", c)] = (o * w + (i + 1) % w, o * w + (i - 1) % w)
        peers[("outer", c)] = (((o + 1) % n) * w + i, ((o - 1) % n) * w + i)
    return peers


MAX_SIMULATED_RANKS = 256


def simulate_layer(c: ClusterSpec, w: Workload, layout: Layout) -> tuple[Timeline, Timeline]:
    """Forward and backward timelines of one layer's attention on one context group."""
    if layout.cp > MAX_SIMULATED_RANKS:
        raise PlanError(
            f"simulating cp={layout.cp} ranks is too slow for a picture; choose cp <= {MAX_SIMULATED_RANKS}"
        )
    topo: Topology = analyze(layout.hp, layout.cp, layout.window, layout.placement, c.devices_per_node)
    bt = block_seconds(c, w, layout.hp, layout.cp)
    m = w.model
    local = w.micro_batch * w.seq_len / layout.sp
    qkv = local * m.head_dim * w.dtype_bytes * (m.n_heads + 2 * replicated_kv_heads(m, layout.hp))
    out = local * m.head_dim * w.dtype_bytes * m.n_heads
    costs = _Costs(
        bt.fwd,
        bt.bwd,
        bt.fwd_first,
        bt.bwd_first,
        all_to_all_seconds(c, topo.head, qkv),
        all_to_all_seconds(c, topo.head, out),
    )
    both = topo.double_ring_concurrent
    kv = kv_block_bytes(w, layout.hp, layout.cp)
    sizes = {"kv": kv, "dkv": kv_block_bytes(w, layout.hp, layout.cp, w.accum_bytes)}
    rings = {"inner": (topo.inner, topo.outer if both else None), "outer": (topo.outer, topo.inner if both else None)}

    def hop(ring: str, kind: str) -> float:
        traffic, other = rings[ring]
        return ring_hop_seconds(c, traffic, other, sizes[kind])

    peers = _ring_peers(layout)
    timelines = []
    for program in (_forward, _backward):
        programs = {rank: program(rank, layout, costs, w.causal) for rank in range(layout.cp)}
        timelines.append(_Engine(programs, peers, hop).run())
    return timelines[0], timelines[1]
