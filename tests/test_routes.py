"""The ring's routes (pure): every reader gets each block, every gradient gets home, the
transfers match pairwise per slot, and the counts are the hand counts and the minimum.

The check is a symbolic replay of what ``double_ring.py`` does with the routes: who holds
which block at each step, and which readers' gradients each dK/dV partial carries.
"""

import random

import pytest

from loongtrain.attention.mask_plan import MaskPlan
from loongtrain.attention.routes import full_routes, ring_routes
from loongtrain.attention.sharding import sequence_sharding
from loongtrain.parallel import ParallelConfig

pytestmark = pytest.mark.unit

CONFIGS = [(2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (6, 3), (8, 2), (8, 4), (8, 8)]


def _replay(routes):
    """Check the routes of every rank against each other; returns (kv sends, dkv sends) per rank."""
    cfg = routes.config
    cp, n, w = cfg.cp, cfg.n_ring_windows, cfg.ring_window
    inner_next = lambda c: (c // w) * w + (c % w + 1) % w  # noqa: E731
    outer_next = lambda c: ((c // w + 1) % n) * w + c % w  # noqa: E731
    # keys/values: who holds which block, followed from the sends alone (each rank starts with its own)
    held = {(c, 0, 0): c for c in range(cp)}  # (rank, j, s) -> block
    kv_sent = [0] * cp
    for j in range(n):
        for s in range(w):
            for c in range(cp):
                block = held.get((c, j, s))
                assert routes.holds(c, j, s) == (block is not None)
                want = routes.source(c, j, s)
                if routes.reads[c][want]:
                    assert block == want, f"rank {c} reads block {want} at ({j},{s}) but holds {block}"
                if s + 1 < w:
                    hop = routes.kv_inner(c, j, s)
                    nxt = inner_next(c)
                    assert hop.send == routes.kv_inner(nxt, j, s).recv  # the neighbour expects exactly it
                    if hop.send:
                        assert block is not None  # only what it has
                        held[(nxt, j, s + 1)] = block
                    kv_sent[c] += hop.send
            for c in range(cp) if (s == 0 and j + 1 < n) else ():
                hop = routes.kv_outer(c, j)
                nxt = outer_next(c)
                assert hop.send == routes.kv_outer(nxt, j).recv
                if hop.send:
                    assert held.get((c, j, 0)) is not None
                    held[(nxt, j + 1, 0)] = held[(c, j, 0)]
                kv_sent[c] += hop.send
    # dK/dV: each partial is the set of readers whose gradient it carries
    own = {b: ({b} if routes.reads[b][b] else set()) for b in range(cp)}
    in_flight: dict[tuple[int, int], set] = {}  # (dst, block) -> carried set, for the chain
    dkv_sent = [0] * cp
    for j in range(n):
        for s in range(w):
            slot = j * w + s
            assert all(t.src != t.dst for t in routes.dkv_sends(slot))
            sent_now = []
            for c in range(cp):
                role = routes.dkv_role(c, j, s)
                block = routes.source(c, j, s)
                assert role.writes == routes.reads[c][block]
                if role.owner:
                    continue
                if not role.writes:
                    assert role.send_to is None and not role.incoming
                    continue
                carried = in_flight.pop((c, block)) if role.incoming else set()
                assert c not in carried
                carried = carried | {c}
                sent_now.append((c, role.send_to, block, carried))
                dkv_sent[c] += 1
            expected = sorted((src, dst, b) for src, dst, b, _ in sent_now)
            assert expected == sorted((t.src, t.dst, t.block) for t in routes.dkv_sends(slot))
            for _, dst, block, carried in sent_now:
                if dst == block:
                    own[block] |= carried
                else:
                    in_flight[(dst, block)] = carried
    assert not in_flight, f"partials never consumed: {in_flight}"
    for b in range(cp):
        assert own[b] == {c for c in range(cp) if routes.reads[c][b]}, f"block {b}'s gradient misses readers"
    return kv_sent, dkv_sent


@pytest.mark.parametrize("cp, window", CONFIGS)
def test_routes_deliver_every_block_and_gradient(cp, window):
    config = ParallelConfig(cp=cp, ring_window=window)
    rng = random.Random(cp * 100 + window)
    cases = [[[True] * cp for _ in range(cp)], [[c == b for b in range(cp)] for c in range(cp)]]
    cases += [[[c == b or rng.random() < p for b in range(cp)] for c in range(cp)] for p in (0.2, 0.5, 0.8)]
    for reads in cases:
        routes = ring_routes(config, reads)
        kv_sent, dkv_sent = _replay(routes)
        assert kv_sent == [routes.kv_hops(c) for c in range(cp)]
        assert dkv_sent == [routes.dkv_partials(c) for c in range(cp)]
        assert sum(kv_sent) == sum(routes.kv_received(c) for c in range(cp))
        assert sum(dkv_sent) == sum(routes.dkv_received(c) for c in range(cp)) == routes.minimum_transfers()
        # one partial per remote reader: the dK/dV minimum
        assert sum(dkv_sent) == sum(routes.remote_readers(b) for b in range(cp))
        # a block reaches at least its remote readers (relays add the rest)
        assert sum(kv_sent) >= sum(routes.remote_readers(b) for b in range(cp))


@pytest.mark.parametrize("cp, window", CONFIGS)
def test_full_ring_counts_by_hand(cp, window):
    """One causal document: every rank sends cp - 1 key/value blocks per pass and cp - 1 dK/dV partials."""
    routes = full_routes(ParallelConfig(cp=cp, ring_window=window))
    for c in range(cp):
        assert routes.kv_hops(c) == cp - 1
        assert routes.dkv_partials(c) == cp - 1


def test_local_documents_need_no_transfer():
    routes = ring_routes(ParallelConfig(cp=4, ring_window=2), [[c == b for b in range(4)] for c in range(4)])
    assert [routes.kv_hops(c) for c in range(4)] == [0] * 4
    assert [routes.dkv_partials(c) for c in range(4)] == [0] * 4


def test_a_block_travels_only_to_its_farthest_reader():
    """Plain ring of 8: block 2 read by ranks 3 and 4 only goes 2 hops; rank 4's partial is the
    second link of the chain 3 -> 4 -> 2 (home)."""
    reads = [[c == b for b in range(8)] for c in range(8)]
    reads[3][2] = reads[4][2] = True
    routes = ring_routes(ParallelConfig(cp=8, ring_window=8), reads)
    assert [routes.kv_hops(c) for c in range(8)] == [0, 0, 1, 1, 0, 0, 0, 0]
    assert [routes.dkv_partials(c) for c in range(8)] == [0, 0, 0, 1, 1, 0, 0, 0]
    assert routes.dkv_role(3, 0, 1).send_to == 4 and routes.dkv_role(4, 0, 2).send_to == 2


def test_double_ring_relays_through_windows_without_readers():
    """cp=8 in windows of 2: block 0 read only by rank 6 (window 3) crosses windows 1 and 2 on
    the outer ring, then returns as one partial."""
    reads = [[c == b for b in range(8)] for c in range(8)]
    reads[6][0] = True
    routes = ring_routes(ParallelConfig(cp=8, ring_window=2), reads)
    assert [routes.kv_hops(c) for c in range(8)] == [1, 0, 1, 0, 1, 0, 0, 0]  # 0 -> 2 -> 4 -> 6
    assert [routes.dkv_partials(c) for c in range(8)] == [0, 0, 0, 0, 0, 0, 1, 0]


@pytest.mark.parametrize("window", [None, 7, 40])
def test_mask_plan_reads_are_its_calls(window):
    """The read matrix (a cheap interval test) says exactly which pairs have kernel calls."""
    rng = random.Random(3)
    seq, cp = 256, 4
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, seq), rng.randint(1, 12)))
        bounds = (0, *cuts, seq)
        for balance in ("zigzag", "documents"):
            plan = MaskPlan(sequence_sharding(seq, 1, cp, bounds, balance), bounds, True, window)
            for c in range(cp):
                for src in range(cp):
                    assert plan.reads(c, src) == bool(plan.calls(c, src)), (bounds, balance, c, src)
