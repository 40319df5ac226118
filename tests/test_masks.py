"""Document/window masks as pure arithmetic: boundary checks, token work, the document
balancer, the per-block kernel calls (against a brute-force visibility matrix) and the
single-process ring replay with masks (against float64 attention)."""

from __future__ import annotations

import bisect
import math
import random

import pytest
import torch

from loongtrain.attention.balance import LOCALITY_IMBALANCE, balance_documents, balance_locality
from loongtrain.attention.documents import as_boundaries, check_sliding_window, range_work
from loongtrain.attention.layout import sequence_layout
from loongtrain.attention.mask_plan import BAND, CAUSAL, FULL, MaskPlan, zigzag_calls
from loongtrain.attention.routes import full_routes
from loongtrain.attention.schedule import block_kind
from loongtrain.attention.sharding import sequence_sharding, zigzag_sharding
from loongtrain.parallel.config import ParallelConfig
from replay_check import check_masked_replay

from reference import visibility


def _random_case(rng: random.Random):
    hp, cp = rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 4])
    seq = 2 * hp * cp * rng.choice([1, 2, 3, 5, 8])
    cuts = sorted(rng.sample(range(1, seq), min(rng.randint(0, 6), seq - 1)))
    return hp, cp, seq, (0, *cuts, seq)


@pytest.mark.parametrize(
    "cu, message",
    [
        ([1, 8], "must start at 0"),
        ([0, 4], "must end at the global sequence length S=8"),
        ([0, 5, 3, 8], "strictly increasing, got 5 then 3"),
        ([0, 4, 4, 8], "strictly increasing, got 4 then 4"),
        ([0], "at least two entries"),
        (torch.tensor([0.0, 8.0]), "1-D integer tensor"),
        (torch.tensor([[0, 8]]), "1-D integer tensor"),
    ],
)
def test_bad_boundaries_name_the_problem(cu, message):
    with pytest.raises(ValueError, match=message):
        as_boundaries(cu, 8)


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_bad_window_is_refused(window):
    with pytest.raises(ValueError, match="must be a positive int"):
        check_sliding_window(window)


def test_boundaries_accept_lists_and_tensors():
    assert as_boundaries([0, 3, 8], 8) == as_boundaries(torch.tensor([0, 3, 8]), 8) == (0, 3, 8)
    assert as_boundaries(None, 8) is None


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 1, 3, 7, 100])
def test_range_work_counts_visible_keys(causal, window):
    seq, cu = 40, [0, 7, 8, 25, 40]
    keep = visibility(seq, cu, causal, window)
    for start, stop in [(0, 40), (3, 19), (8, 9), (24, 31)]:
        assert range_work(tuple(cu), start, stop, causal, window) == int(keep[start:stop].sum())


def test_balancer_is_zigzag_for_one_document():
    for cp in (1, 2, 4, 8):
        found = balance_documents(64 * cp, cp, (0, 64 * cp))
        assert found.chunks == zigzag_sharding(64 * cp, 1, cp).content
        assert found.imbalance == pytest.approx(1.0)


def _zigzag_loads(seq, cp, cu):
    return [sum(range_work(cu, s, s + n) for s, n in content) for content in zigzag_sharding(seq, 1, cp).content]


def test_balancer_fixes_one_long_document_plus_short_ones():
    seq, cp = 8192, 4
    cu = (0, 4096, *range(4096 + 256, seq, 256), seq)  # half the sequence one document, then 256-token ones
    zig = _zigzag_loads(seq, cp, cu)
    found = balance_documents(seq, cp, cu)
    assert max(zig) / (sum(zig) / cp) > 1.3  # zigzag is badly balanced here
    assert found.imbalance <= 1.05
    assert sum(found.loads) == sum(zig) == range_work(cu, 0, seq)
    for chunks in found.chunks:
        assert sum(n for _, n in chunks) == seq // cp and list(chunks) == sorted(chunks)


def _lognormal(seq: int, median: int, seed: int) -> tuple[int, ...]:
    rng, cu = random.Random(seed), [0]
    while cu[-1] < seq:
        cu.append(min(seq, cu[-1] + max(1, int(rng.lognormvariate(math.log(median), 1.0)))))
    return tuple(cu)


def _ranks_of_documents(found, cu) -> list[list[int]]:
    """Context ranks holding some of each document, in document order."""
    held: list[set] = [set() for _ in range(len(cu) - 1)]
    for c, chunks in enumerate(found.chunks):
        for start, length in chunks:
            for pos in range(start, start + length):
                held[bisect.bisect_right(cu, pos) - 1].add(c)
    return [sorted(h) for h in held]


def test_locality_is_zigzag_for_one_document():
    for cp in (2, 4, 8):
        found = balance_locality(64 * cp, cp, (0, 64 * cp))
        flat = [[p for s, n in chunks for p in range(s, s + n)] for chunks in found.chunks]
        assert flat == [[p for s, n in c for p in range(s, s + n)] for c in zigzag_sharding(64 * cp, 1, cp).content]


def test_locality_keeps_documents_that_fit_whole():
    seq, cp = 8192, 4
    cu = tuple(range(0, seq + 1, 512))  # 16 equal documents: 4 whole ones per rank
    found = balance_locality(seq, cp, cu)
    assert all(len(ranks) == 1 for ranks in _ranks_of_documents(found, cu))
    assert found.imbalance == pytest.approx(1.0)


@pytest.mark.parametrize("seq, cp, median", [(32768, 4, 512), (65536, 8, 1024), (65536, 8, 4096), (16384, 2, 2048)])
def test_locality_balances_work_and_keeps_documents_on_adjacent_ranks(seq, cp, median):
    for seed in range(3):
        cu = _lognormal(seq, median, seed)
        found = balance_locality(seq, cp, cu)
        assert found.imbalance <= LOCALITY_IMBALANCE, (seed, found.imbalance)
        assert sum(found.loads) == range_work(cu, 0, seq)
        for chunks in found.chunks:
            assert sum(n for _, n in chunks) == seq // cp and list(chunks) == sorted(chunks)
        docs = _ranks_of_documents(found, cu)
        for d, ranks in enumerate(docs):
            if len(ranks) in (1, cp):
                continue
            # a run of consecutive context ranks (wrapping around the ring); a document split to
            # fill gaps may skip one full rank (which then relays its keys)
            gaps = [(b - a) % cp for a, b in zip(ranks, ranks[1:] + ranks[:1])]
            span = cp - max(gaps) + 1  # the shortest arc of the ring that holds them all
            assert span <= len(ranks) + 1, (seed, d, ranks)
        short = [ranks for (a, b), ranks in zip(zip(cu, cu[1:]), docs) if b - a <= seq // cp // 4]
        if len(short) >= 10:  # short documents stay whole (the last few fill the ranks' gaps)
            assert sum(len(r) == 1 for r in short) >= 0.8 * len(short)
        # the ring carries no more than under the documents balance (far less with many documents)
        ring = ParallelConfig(cp=cp, ring_window=cp)
        plans = {b: MaskPlan(sequence_sharding(seq, 1, cp, cu, b), cu, True, None) for b in ("documents", "locality")}
        hops = {b: sum(p.routes(ring).kv_hops(c) for c in range(cp)) for b, p in plans.items()}
        assert hops["locality"] <= hops["documents"], (seed, hops)
        if median <= 1024:
            assert hops["locality"] <= 0.7 * hops["documents"], (seed, hops)


def _positions(sharding, head: int, context: int) -> list[int]:
    return [p for s, n in sharding.ranges(head, context) for p in range(s, s + n)]


def test_sharding_partitions_the_sequence_for_every_balance():
    rng = random.Random(3)
    for _ in range(50):
        hp, cp, seq, cu = _random_case(rng)
        for balance in ("zigzag", "documents", "locality"):
            sharding = sequence_sharding(seq, hp, cp, cu, balance)
            seen = [p for c in range(cp) for h in range(hp) for p in _positions(sharding, h, c)]
            assert sorted(seen) == list(range(seq))
            for c in range(cp):  # the head all-to-all yields the content in ascending order
                gathered = [p for h in range(hp) for p in _positions(sharding, h, c)]
                assert gathered == sorted(gathered)


def _coverage(plan, seq, cp, causal, window):
    """How many times the calls compute each (query, key) pair; asserts band rows see something."""
    content = [torch.tensor([p for s, n in plan.sharding.content[c] for p in range(s, s + n)]) for c in range(cp)]
    cover = torch.zeros(seq, seq, dtype=torch.int32)
    for c in range(cp):
        for src in range(cp):
            for call in plan.calls(c, src):
                rows, cols = content[c][call.row0 : call.row1], content[src][call.col0 : call.col1]
                sub = torch.ones(len(rows), len(cols), dtype=torch.bool)
                if call.kind == CAUSAL:
                    sub = sub.tril()
                elif call.kind == BAND:
                    i, j = rows[:, None], cols[None, :]
                    assert (rows == call.q_start + torch.arange(len(rows))).all()
                    assert (cols == call.k_start + torch.arange(len(cols))).all()
                    sub = (i - j < window) & ((j <= i) if causal else (j - i < window))
                    assert sub.any(dim=1).all(), "a masked call has a row that sees nothing"
                else:
                    assert call.kind == FULL
                cover[rows[:, None], cols[None, :]] += sub.int()
    return cover


def test_calls_cover_every_visible_pair_exactly_once():
    rng = random.Random(0)
    for _ in range(200):
        hp, cp, seq, cu = _random_case(rng)
        window = rng.choice([None, 1, 2, 3, 5, 8, seq, 2 * seq])
        causal = rng.random() < 0.7
        balance = rng.choice(["zigzag", "documents"])
        plan = MaskPlan(sequence_sharding(seq, hp, cp, cu, balance), cu, causal, window)
        cover = _coverage(plan, seq, cp, causal, window)
        assert cover.max() <= 1, "a pair is computed twice"
        assert torch.equal(cover == 1, visibility(seq, cu, causal, window)), (hp, cp, seq, cu, window, causal)


def test_one_document_runs_the_plain_ring_kernels():
    """Under zigzag, one document needs exactly the kernels of the plain causal ring: one per block."""
    seq, cp = 64, 4
    plan = MaskPlan(zigzag_sharding(seq, 1, cp), (0, seq), True, None)
    for c in range(cp):
        for src in range(cp):
            (call,) = plan.calls(c, src)
            assert call.kind == (CAUSAL if src == c else FULL)
            if src < c:  # all of q against the first key chunk
                assert call[:4] == (0, 16, 0, 8)
            elif src > c:  # the second query chunk against all keys
                assert call[:4] == (8, 16, 0, 16)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_the_plain_ring_is_the_plan_of_one_zigzag_document(cp, causal):
    """The ring runs the plan's calls for every sequence: for one document under zigzag they
    are the zigzag block kinds' single kernels (the schedule's rule, written independently)."""
    seq = 2 * cp * 12
    layout = sequence_layout(seq, ParallelConfig(cp=cp))
    plan = layout.mask_plan(causal, None)
    for c in range(cp):
        for src in range(cp):
            assert plan.calls(c, src) == zigzag_calls(block_kind(src, c, causal), seq // cp), (c, src)
    assert layout.mask_plan(causal, seq).calls(0, 0) == plan.calls(0, 0)  # a window of the whole sequence is none
    assert plan.routes(ParallelConfig(cp=cp)) == full_routes(ParallelConfig(cp=cp))


def test_documents_on_chunk_edges_skip_every_foreign_block():
    seq, cp = 64, 4
    cu = tuple(range(0, seq + 1, seq // (2 * cp)))
    plan = MaskPlan(zigzag_sharding(seq, 1, cp), cu, True, None)
    for c in range(cp):
        assert all(not plan.calls(c, src) for src in range(cp) if src != c)
    assert plan.empty_steps(ParallelConfig(cp=cp)) == {(j, 0) for j in range(1, cp)}


@pytest.mark.parametrize("seed", range(8))
def test_ring_replay_with_masks_matches_float64(seed):
    rng = random.Random(seed)
    cp = rng.choice([1, 2, 3, 4])
    window = rng.choice([w for w in range(1, cp + 1) if cp % w == 0])
    seq = 2 * cp * rng.choice([3, 5, 8])
    cuts = sorted(rng.sample(range(1, seq), rng.randint(1, 6)))
    cu = (0, *cuts, seq)
    sliding = rng.choice([None, 2, 5, seq // 2])
    causal = seed % 3 != 2
    plan = MaskPlan(sequence_sharding(seq, 1, cp, cu, rng.choice(["zigzag", "documents"])), cu, causal, sliding)
    check_masked_replay(plan, window, batch=2, seed=seed)
