"""Zigzag index maps, head all-to-all packing and the ring schedule: pure functions."""

from __future__ import annotations

import itertools

import pytest
import torch

from loongtrain.attention.comm import pack_head_to_seq, pack_seq_to_head, unpack_head_to_seq, unpack_seq_to_head
from loongtrain.attention.schedule import BlockKind, block_kind, ring_source
from loongtrain.attention.sharding import check_sequence_length, zigzag_sharding
from loongtrain.parallel.config import ParallelConfig

GRID = [(hp, cp) for hp, cp in itertools.product((1, 2, 3, 4), (1, 2, 3, 4, 8))]


def shard_positions(seq: int, hp: int, cp: int, head: int, context: int) -> list[int]:
    """Zigzag global token positions held by rank ``(head, context)``, in local order."""
    return [p for s, n in zigzag_sharding(seq, hp, cp).ranges(head, context) for p in range(s, s + n)]


@pytest.mark.parametrize("hp, cp", GRID)
def test_shards_partition_the_sequence(hp, cp):
    seq = 2 * hp * cp * 3
    seen = []
    for h in range(hp):
        for c in range(cp):
            pos = shard_positions(seq, hp, cp, h, c)
            assert len(pos) == seq // (hp * cp)
            seen += pos
    assert sorted(seen) == list(range(seq))


@pytest.mark.parametrize("hp, cp", GRID)
def test_head_gather_yields_the_zigzag_chunks(hp, cp):
    """After the all-to-all gathers the hp pieces in head order, context rank c holds
    chunk c followed by chunk 2cp-1-c."""
    seq = 2 * hp * cp * 2
    chunk = seq // (2 * cp)
    for c in range(cp):
        gathered = [p for h in range(hp) for p in shard_positions(seq, hp, cp, h, c)]
        first, second = c, 2 * cp - 1 - c
        expected = list(range(first * chunk, (first + 1) * chunk)) + list(range(second * chunk, (second + 1) * chunk))
        assert gathered == expected


def test_ranges_straddle_chunks_for_odd_hp():
    # hp=3, cp=1, S=6: content = chunks [0:3] and [3:6]; pieces of 2 tokens
    assert zigzag_sharding(6, 3, 1).ranges(1, 0) == [(2, 1), (3, 1)]


def test_sequence_length_error_names_the_fix():
    with pytest.raises(ValueError, match=r"not divisible by 2\*sp = 2\*2\*4 = 16.*e\.g\. 1008"):
        check_sequence_length(1000, 2, 4)


def _simulate_all_to_all(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """all_to_all_single semantics: rank r receives chunk r of every rank, in rank order."""
    world = len(inputs)
    return [torch.stack([inputs[src][dst] for src in range(world)]) for dst in range(world)]


@pytest.mark.parametrize("hp", [1, 2, 4])
def test_seq_to_head_all_to_all_packing(hp):
    batch, seq_local, heads, dim = 2, 3, 8, 5
    full = torch.randn(batch, hp * seq_local, heads, dim)  # sequence order = head-rank order
    shards = [full[:, r * seq_local : (r + 1) * seq_local] for r in range(hp)]
    received = _simulate_all_to_all([pack_seq_to_head(x, hp) for x in shards])
    per_head = heads // hp
    for r in range(hp):
        got = unpack_seq_to_head(received[r])
        torch.testing.assert_close(got, full[:, :, r * per_head : (r + 1) * per_head], rtol=0, atol=0)
    # and back
    back = _simulate_all_to_all([pack_head_to_seq(unpack_seq_to_head(x), hp) for x in received])
    for r in range(hp):
        torch.testing.assert_close(unpack_head_to_seq(back[r]), shards[r], rtol=0, atol=0)


def _ring_sources(c: int, cp: int, window: int) -> list[int]:
    """Sources visited by rank ``c``, in schedule order (outer step major)."""
    config = ParallelConfig(cp=cp, ring_window=window)
    return [ring_source(c, config, j, s) for j in range(cp // window) for s in range(window)]


@pytest.mark.parametrize("cp, window", [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (8, 4), (6, 3)])
def test_every_rank_visits_every_block_once(cp, window):
    for c in range(cp):
        srcs = _ring_sources(c, cp, window)
        assert srcs[0] == c
        assert sorted(srcs) == list(range(cp))


@pytest.mark.parametrize("cp, window", [(4, 2), (8, 2), (8, 4), (6, 3)])
def test_double_ring_moves_blocks_along_its_rings(cp, window):
    """The block held at (j, s+1) is the one the inner predecessor held at (j, s); the
    block at (j+1, 0) is the one the outer predecessor held at (j, 0)."""
    n = cp // window
    config = ParallelConfig(cp=cp, ring_window=window)
    for c in range(cp):
        o, i = divmod(c, window)
        inner_prev = o * window + (i - 1) % window
        outer_prev = ((o - 1) % n) * window + i
        for j in range(n):
            for s in range(window - 1):
                assert ring_source(c, config, j, s + 1) == ring_source(inner_prev, config, j, s)
            if j + 1 < n:
                assert ring_source(c, config, j + 1, 0) == ring_source(outer_prev, config, j, 0)


def _pairs_of_block(kind: BlockKind, q_pos: list[int], k_pos: list[int]) -> list[tuple[int, int]]:
    half = len(q_pos) // 2
    if kind is BlockKind.DIAGONAL:  # top-left aligned causal mask on local indices
        return [(q_pos[a], k_pos[b]) for a in range(len(q_pos)) for b in range(len(k_pos)) if b <= a]
    if kind is BlockKind.KV_FIRST_HALF:
        return [(qp, kp) for qp in q_pos for kp in k_pos[:half]]
    if kind is BlockKind.Q_SECOND_HALF:
        return [(qp, kp) for qp in q_pos[half:] for kp in k_pos]
    return [(qp, kp) for qp in q_pos for kp in k_pos]


@pytest.mark.parametrize("cp, window", [(1, 1), (2, 1), (4, 1), (4, 2), (8, 4), (6, 3)])
@pytest.mark.parametrize("causal", [True, False])
def test_schedule_covers_the_mask_exactly_and_balances_work(cp, window, causal):
    seq = 2 * cp * 3
    positions = [shard_positions(seq, 1, cp, 0, c) for c in range(cp)]
    covered: list[tuple[int, int]] = []
    work = []
    for c in range(cp):
        pairs = []
        for src in _ring_sources(c, cp, window):
            pairs += _pairs_of_block(block_kind(src, c, causal), positions[c], positions[src])
        covered += pairs
        work.append(len(pairs))
    expected = [(i, j) for i in range(seq) for j in range(seq) if (j <= i or not causal)]
    assert sorted(covered) == sorted(expected), "each allowed (query, key) pair exactly once"
    assert len(set(work)) == 1, f"unbalanced work per context rank: {work}"
