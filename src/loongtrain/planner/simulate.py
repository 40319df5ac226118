"""Event-driven simulation of one layer's attention (forward, then backward) on every rank of
whole nodes, with transfers sharing modelled links. Pure.

Each rank runs a program transcribed from ``attention/double_ring.py`` (and the head
all-to-alls of ``attention/ops.py``): compute a block, start a ring exchange, wait for
one. Block and all-to-all durations come from the cost model
(:mod:`loongtrain.planner.cost`); how transfers share the hardware does not. Every
transfer is a flow through the links it crosses, at the rates the cluster gives them:

- inside a node: the sender's link and the receiver's link (``intra_bw_gbs`` each) and
  the node's fabric (``intra_node_bw_gbs``);
- between nodes: the sender's NIC and the receiver's NIC (``nic_bw_gbs`` each; a node's
  ``nics_per_node`` NICs serve consecutive local ranks, as NCCL binds a GPU to its
  closest NIC);

and concurrent flows share every link max-min fairly (progressive filling). A transfer
starts when its sender and receiver have both posted it, after the link latency. All
ranks of ``lcm(sp, devices_per_node)`` consecutive ranks (whole nodes, whole replicas)
run, so the outer and inner transfers of every context group compete for the NICs as
they would on the machine; the recorded timeline is that of the first context group
(``rank`` = its context index). Transfers are assumed not to slow compute (separate copy
engines, ``overlap = 1``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Generator
from dataclasses import dataclass, field, replace

from loongtrain.attention.schedule import block_kind, ring_source
from loongtrain.parallel.layout import RankLayout
from loongtrain.planner.cost import (
    Candidate,
    Workload,
    all_to_all_seconds,
    block_seconds,
    candidate_topology,
    head_all_to_all_bytes,
    kv_block_bytes,
)
from loongtrain.planner.specs import ClusterSpec, PlanError
from loongtrain.planner.topology import nic_of


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
    """Intervals of one pass (forward or backward) of the first context group's ranks."""

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


# -- the links --------------------------------------------------------------------------
class _Network:
    """Flows on capacitated links; rates max-min fair with a per-flow cap.

    A flow's bytes left are brought up to date only when the rates of its component (the
    flows that share links with it, transitively) change, which is all an event touches.
    """

    def __init__(self) -> None:
        self.capacity: dict[tuple, float] = {}
        self.flows: dict[tuple, list] = {}  # key -> [bytes left, as of time, rate, links, cap]
        self.users: dict[tuple, set] = {}  # link -> keys of the flows on it
        self.finish: dict[tuple, float] = {}

    def add(self, key: tuple, nbytes: float, links: tuple, cap: float, now: float) -> None:
        self.flows[key] = [nbytes, now, 0.0, links, cap]
        for link in links:
            self.users.setdefault(link, set()).add(key)
        self._share(self._component([key]), now)

    def remove(self, key: tuple, now: float) -> None:
        links = self.flows.pop(key)[3]
        del self.finish[key]
        neighbours = []
        for link in links:
            self.users[link].discard(key)
            neighbours += self.users[link]
        self._share(self._component(neighbours), now)

    def next_done(self) -> tuple[float, tuple] | None:
        if not self.finish:
            return None
        key = min(self.finish, key=self.finish.__getitem__)
        return self.finish[key], key

    def _component(self, start: list) -> set:
        seen, todo = set(start), list(start)
        while todo:
            for link in self.flows[todo.pop()][3]:
                for other in self.users[link]:
                    if other not in seen:
                        seen.add(other)
                        todo.append(other)
        return seen

    def _share(self, keys: set, now: float) -> None:
        """Progressive filling over ``keys``: raise every unfrozen flow's rate until a link or its cap is full."""
        for key in keys:
            flow = self.flows[key]
            flow[0] = max(0.0, flow[0] - flow[2] * (now - flow[1]))
            flow[1], flow[2] = now, 0.0
        room = {link: self.capacity[link] for key in keys for link in self.flows[key][3]}
        active = set(keys)
        while active:
            users: dict[tuple, int] = {}
            for key in active:
                for link in self.flows[key][3]:
                    users[link] = users.get(link, 0) + 1
            step = min(
                min(room[link] / n for link, n in users.items()),
                min(self.flows[k][4] - self.flows[k][2] for k in active),
            )
            for key in active:
                self.flows[key][2] += step
                for link in self.flows[key][3]:
                    room[link] -= step
            full = {link for link in users if room[link] <= 1e-9 * self.capacity[link]}
            active = {
                k
                for k in active
                if self.flows[k][2] < self.flows[k][4] * (1 - 1e-12) and full.isdisjoint(self.flows[k][3])
            }
        for key in keys:
            left, _, rate, _, _ = self.flows[key]
            self.finish[key] = now + (left / rate if rate > 0 else math.inf)


# -- rank programs (transcribed from attention/double_ring.py) ---------------------------
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


@dataclass(frozen=True)
class _Costs:
    block_fwd: float
    block_bwd: float
    block_fwd_first: float
    block_bwd_first: float
    a2a_qkv: float
    a2a_out: float


def _forward(c: int, layout: Candidate, costs: _Costs, causal: bool) -> Program:
    config = layout.parallel
    n, w = config.n_ring_windows, config.ring_window
    if config.hp > 1:
        yield Compute("q, kv", costs.a2a_qkv, "all-to-all")
    for j in range(n):
        outer = (yield Exchange("outer", "kv")) if j + 1 < n else None
        for s in range(w):
            inner = (yield Exchange("inner", "kv")) if s + 1 < w else None
            kind = block_kind(ring_source(c, config, j, s), c, causal).value
            first = j == 0 and s == 0
            yield Compute(f"fwd {kind}", costs.block_fwd_first if first else costs.block_fwd)
            yield Wait(inner)
        yield Wait(outer)
    if config.hp > 1:
        yield Compute("out", costs.a2a_out, "all-to-all")


def _backward(c: int, layout: Candidate, costs: _Costs, causal: bool) -> Program:
    """Every rank reads every block (:mod:`loongtrain.attention.routes`): a window's readers
    chain one partial along the inner ring; its last reader sends the window's total home
    (ring ``home{j}``: from window ``o`` to window ``o - j``; inside the window for ``j = 0``)."""
    config = layout.parallel
    n, w = config.n_ring_windows, config.ring_window
    if config.hp > 1:
        yield Compute("dout", costs.a2a_out, "all-to-all")
    chain = None  # the partial arriving for the next step
    totals = []
    for j in range(n):
        outer_kv = (yield Exchange("outer", "kv")) if j + 1 < n else None
        for s in range(w):
            inner_kv = (yield Exchange("inner", "kv")) if s + 1 < w else None
            kind = block_kind(ring_source(c, config, j, s), c, causal).value
            first = j == 0 and s == 0
            yield Compute(f"bwd {kind}", costs.block_bwd_first if first else costs.block_bwd)
            if chain is not None:
                yield Wait(chain)
                chain = None
            if not first and s + 1 < w:
                chain = yield Exchange("inner", "dkv")
            elif not first:
                totals.append((yield Exchange("inner" if j == 0 else f"home{j}", "dkv")))
            yield Wait(inner_kv)
        yield Wait(outer_kv)
    for total in totals:
        yield Wait(total)
    if config.hp > 1:
        yield Compute("dq, dkv", costs.a2a_qkv, "all-to-all")


# -- the engine -------------------------------------------------------------------------
class _Engine:
    """Runs every rank's program in global time order; transfers are flows on ``_Network``."""

    def __init__(self, c: ClusterSpec, programs: dict, peers: dict, sizes: dict, recorded: dict) -> None:
        self.c = c
        self.programs = programs  # global rank -> generator
        self.peers = peers  # (ring, rank) -> (send_to, recv_from)
        self.sizes = sizes  # kind -> bytes
        self.recorded = recorded  # global rank -> context index, for the ranks whose timeline is kept
        self.net = _Network()
        self.posted: dict[tuple, dict[int, float]] = {}  # transfer key -> {rank: post time}
        self.seq: dict[tuple, int] = {}
        self.done: dict[tuple, float] = {}
        self.waiters: dict[tuple, list[int]] = {}
        self.starts: list[tuple[float, tuple]] = []  # heap of (start time, transfer key) after latency
        self.timeline = Timeline()

    def _links(self, src: int, dst: int) -> tuple[tuple, float]:
        c, dpn = self.c, self.c.devices_per_node
        a, b = src // dpn, dst // dpn
        cap = self.net.capacity
        if a == b:
            links = (("out", src), ("in", dst), ("fabric", a))
            cap.setdefault(links[0], c.intra_bw_gbs * 1e9)
            cap.setdefault(links[1], c.intra_bw_gbs * 1e9)
            cap.setdefault(links[2], c.intra_node_bw_gbs * 1e9)
            return links, c.intra_bw_gbs * 1e9
        links = (("nic out", a, self._nic(src)), ("nic in", b, self._nic(dst)))
        for link in links:
            cap.setdefault(link, c.nic_bw_gbs * 1e9)
        return links, c.nic_bw_gbs * 1e9

    def _nic(self, rank: int) -> int:
        """The NIC a rank's inter-node traffic uses (:func:`topology.nic_of`)."""
        return nic_of(rank, self.c.devices_per_node, self.c.nics_per_node)[1]

    def _post(self, rank: int, ring: str, kind: str, now: float) -> tuple:
        k = self.seq.get((rank, ring, kind), 0)
        self.seq[(rank, ring, kind)] = k + 1
        send_to, recv_from = self.peers[(ring, rank)]
        for sender in (rank, recv_from):  # this rank's send, and the receive from its predecessor
            key = (ring, kind, k, sender)
            posts = self.posted.setdefault(key, {})
            posts[rank] = now
            receiver = self.peers[(ring, sender)][0]
            if sender in posts and receiver in posts:
                same = sender // self.c.devices_per_node == receiver // self.c.devices_per_node
                latency = (self.c.intra_latency_us if same else self.c.inter_latency_us) * 1e-6
                heapq.heappush(self.starts, (max(posts.values()) + latency, key))
        return (ring, kind, k, recv_from)  # the handle: the transfer into this rank

    def _step(self, rank: int, now: float, reply) -> tuple[float | None, object]:
        """Run ``rank`` from ``now`` until it computes (returns its next ready time) or blocks (None)."""
        program = self.programs[rank]
        while True:
            try:
                op = program.send(reply)
            except StopIteration:
                return None, None
            reply = None
            if isinstance(op, Compute):
                if rank in self.recorded:
                    self.timeline.intervals.append(
                        Interval(self.recorded[rank], op.lane, op.label, now, now + op.seconds)
                    )
                return now + op.seconds, None
            if isinstance(op, Exchange):
                reply = self._post(rank, op.ring, op.kind, now)
            elif isinstance(op, Wait) and op.handle is not None:
                if op.handle not in self.done:
                    self.waiters.setdefault(op.handle, []).append(rank)
                    return None, None
                now = max(now, self.done[op.handle])

    def run(self) -> Timeline:
        ready = [(0.0, rank) for rank in self.programs]
        heapq.heapify(ready)
        flow_start: dict[tuple, float] = {}
        while ready or self.starts or self.net.flows:
            t_rank = ready[0][0] if ready else math.inf
            t_start = self.starts[0][0] if self.starts else math.inf
            done = self.net.next_done()
            t_done = done[0] if done else math.inf
            t = min(t_rank, t_start, t_done)
            if t == math.inf:
                raise RuntimeError("schedule deadlock: ranks wait on transfers that are never posted")
            if t_done == t:
                key = done[1]
                self.net.remove(key, t)
                self.done[key] = t
                ring, kind, k, sender = key
                if sender in self.recorded:
                    lane = "inner link" if ring == "inner" else "outer link"  # a total home crosses windows
                    self.timeline.intervals.append(
                        Interval(self.recorded[sender], lane, f"{kind} #{k}", flow_start[key], t)
                    )
                for rank in self.waiters.pop(key, []):
                    heapq.heappush(ready, (t, rank))
            elif t_start == t:
                _, key = heapq.heappop(self.starts)
                ring, kind, _, sender = key
                links, cap = self._links(sender, self.peers[(ring, sender)][0])
                flow_start[key] = t
                self.net.add(key, self.sizes[kind], links, cap, t)
            else:
                _, rank = heapq.heappop(ready)
                nxt, _ = self._step(rank, t, None)
                if nxt is not None:
                    heapq.heappush(ready, (nxt, rank))
        return self.timeline


MAX_SIMULATED_RANKS = 512


def simulate_layer(c: ClusterSpec, w: Workload, layout: Candidate) -> tuple[Timeline, Timeline]:
    """Forward and backward timelines of one layer's attention (first context group's ranks)."""
    p = layout.parallel
    world = p.sp * c.devices_per_node // math.gcd(p.sp, c.devices_per_node)
    if world > MAX_SIMULATED_RANKS:
        raise PlanError(
            f"simulating {world} ranks (whole nodes of sp={p.sp}) is too slow for a picture; "
            f"choose sp with lcm(sp, {c.devices_per_node}) <= {MAX_SIMULATED_RANKS}"
        )
    topo = candidate_topology(c, layout)
    bt = block_seconds(c, w, p.hp, p.cp)
    qkv, out = head_all_to_all_bytes(w, p.sp, p.hp)
    costs = _Costs(
        bt.fwd,
        bt.bwd,
        bt.fwd_first,
        bt.bwd_first,
        all_to_all_seconds(c, topo.head, qkv),
        all_to_all_seconds(c, topo.head, out),
    )
    sizes = {
        "kv": kv_block_bytes(w, p.hp, p.cp),
        "dkv": kv_block_bytes(w, p.hp, p.cp, w.accum_bytes),
    }
    ranks = RankLayout.build(replace(p, dp=None), world)
    peers = {}
    for rank in range(world):
        for ring, members in (("inner", ranks.inner_ring(rank)), ("outer", ranks.outer_ring(rank))):
            pos = members.index(rank)
            peers[(ring, rank)] = (members[(pos + 1) % len(members)], members[pos - 1])
        x, nw = ranks.coords(rank), p.ring_window
        for j in range(1, p.n_ring_windows):  # a window total's way home: (o, i) -> (o - j, i + 1)
            to = ((x.outer_pos - j) % p.n_ring_windows) * nw + (x.inner_pos + 1) % nw
            frm = ((x.outer_pos + j) % p.n_ring_windows) * nw + (x.inner_pos - 1) % nw
            peers[(f"home{j}", rank)] = (ranks.rank(x.dp, x.head, to), ranks.rank(x.dp, x.head, frm))
    first_group = {ranks.rank(0, 0, ctx): ctx for ctx in range(p.cp)}
    timelines = []
    for program in (_forward, _backward):
        programs = {r: program(ranks.coords(r).context, layout, costs, w.causal) for r in range(world)}
        timelines.append(_Engine(c, programs, peers, sizes, first_group).run())
    return timelines[0], timelines[1]
