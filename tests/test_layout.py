"""Rank layout and ParallelConfig: pure arithmetic, no process group."""

from __future__ import annotations

import itertools

import pytest

from loongtrain import ParallelConfig, RankLayout


def _layouts():
    for world, hp, cp, ring_window, placement, order in itertools.product(
        (8, 16), (1, 2, 4), (1, 2, 4, 8), (1, 2, 4), ("head_first", "context_first"), ("contiguous", "interleaved")
    ):
        if cp % ring_window or world % (hp * cp):
            continue
        yield RankLayout.build(ParallelConfig(hp, cp, ring_window, placement, context_order=order), world)


@pytest.mark.parametrize("layout", list(_layouts()), ids=lambda lay: f"{lay.config}-w{lay.world_size}")
def test_coordinates_are_a_bijection_and_groups_partition(layout: RankLayout):
    world = layout.world_size
    coords = [layout.coords(r) for r in range(world)]
    assert len({(c.dp, c.head, c.context) for c in coords}) == world
    for r, c in enumerate(coords):
        assert layout.rank(c.dp, c.head, c.context) == r
        assert c.context == c.outer_pos * layout.ring_window + c.inner_pos
    for family, size in (
        (layout.all_sp_groups(), layout.sp),
        (layout.all_dp_groups(), layout.dp),
        (layout.all_head_groups(), layout.hp),
        (layout.all_context_groups(), layout.cp),
        (layout.all_inner_rings(), layout.ring_window),
        (layout.all_outer_rings(), layout.n_ring_windows),
    ):
        members = sorted(r for g in family for r in g)
        assert members == list(range(world)), "each rank in exactly one group of the family"
        assert all(len(g) == size for g in family)
    for r in range(world):
        c = layout.coords(r)
        assert [layout.coords(m).head for m in layout.head_group(r)] == list(range(layout.hp))
        assert [layout.coords(m).context for m in layout.context_group(r)] == list(range(layout.cp))
        assert set(layout.head_group(r)) <= set(layout.sp_group(r))
        assert set(layout.context_group(r)) <= set(layout.sp_group(r))
        inner = layout.inner_ring(r)
        assert [layout.coords(m).inner_pos for m in inner] == list(range(layout.ring_window))
        assert {layout.coords(m).outer_pos for m in inner} == {c.outer_pos}
        outer = layout.outer_ring(r)
        assert [layout.coords(m).outer_pos for m in outer] == list(range(layout.n_ring_windows))
        assert {layout.coords(m).inner_pos for m in outer} == {c.inner_pos}


def test_sp_block_is_contiguous_and_dp_outermost():
    lay = RankLayout.build(ParallelConfig(hp=2, cp=4), 16)
    assert lay.dp == 2
    assert lay.all_sp_groups() == [tuple(range(8)), tuple(range(8, 16))]
    assert lay.dp_group(3) == (3, 11)


def test_head_first_versus_context_first():
    hf = RankLayout.build(ParallelConfig(hp=4, cp=2, placement="head_first"), 8)
    assert hf.all_head_groups() == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert hf.all_context_groups() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    cf = RankLayout.build(ParallelConfig(hp=4, cp=2, placement="context_first"), 8)
    assert cf.all_context_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert cf.all_head_groups() == [(0, 2, 4, 6), (1, 3, 5, 7)]


def test_double_ring_groups_contiguous_and_interleaved():
    # cp = 8 context ranks in one node order, windows of 2 -> 4 windows
    lay = RankLayout.build(ParallelConfig(cp=8, ring_window=2), 8)
    assert lay.all_inner_rings() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert lay.all_outer_rings() == [(0, 2, 4, 6), (1, 3, 5, 7)]
    inter = RankLayout.build(ParallelConfig(cp=8, ring_window=2, context_order="interleaved"), 8)
    # window o takes every n-th (n = 4) member: the inner rings span, the outer ring is local
    assert inter.all_inner_rings() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert inter.all_outer_rings() == [(0, 1, 2, 3), (4, 5, 6, 7)]
    # the context index (ring order, used for sharding) follows the ring, not the rank
    assert [inter.coords(r).context for r in range(8)] == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.mark.parametrize(
    "kwargs, world, message",
    [
        ({"hp": 2, "cp": 3}, 8, "not divisible by sp = hp*cp"),
        ({"hp": 2, "cp": 2, "dp": 3}, 8, "does not equal the world size 8"),
        ({"cp": 6, "ring_window": 4}, 6, "cp=6 is not divisible by ring_window=4"),
        ({"hp": 0}, 1, "hp=0 must be a positive integer"),
        ({"placement": "diagonal"}, 1, "unknown placement='diagonal'"),
        ({"context_order": "random"}, 1, "unknown context_order='random'"),
    ],
)
def test_config_errors_name_the_values(kwargs, world, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("(", r"\(")):
        RankLayout.build(ParallelConfig(**kwargs), world)


def test_config_dp_derived():
    assert ParallelConfig(hp=2, cp=2).resolve_dp(8) == 2
    assert ParallelConfig(hp=2, cp=2, dp=2).resolve_dp(8) == 2
    assert ParallelConfig(cp=4, ring_window=2).n_ring_windows == 2
