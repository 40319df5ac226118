"""init_parallel builds exactly the groups the layout describes, and the ZeRO meshes the
pure rank grid describes, at scale, using PyTorch's fake process-group backend (one
process pretends to be one rank of N)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import loongtrain as lt
from loongtrain.options import ZERO_SCOPES
from loongtrain.parallel.zero_grid import zero_mesh_grid


def _ranks(group) -> tuple[int, ...] | None:
    return None if group is None else tuple(dist.get_process_group_ranks(group))


CONFIGS = [
    (1024, dict(hp=8, cp=16, ring_window=4, placement="context_first")),
    (1024, dict(hp=4, cp=64, ring_window=8, context_order="interleaved")),
    (512, dict(hp=1, cp=32, ring_window=1)),
    (256, dict(hp=16, cp=1)),
]


@pytest.mark.parametrize("world, cfg", CONFIGS)
@pytest.mark.parametrize("rank_fraction", [0.0, 0.37, 0.99])
def test_groups_match_layout_at_scale(world, cfg, rank_fraction):
    rank = int(rank_fraction * (world - 1))
    config = lt.ParallelConfig(**cfg)
    dist.init_process_group("fake", rank=rank, world_size=world)
    try:
        state = lt.init_parallel(config)
        layout = lt.RankLayout.build(config, world)
        size_or_none = lambda members: members if len(members) > 1 else None  # noqa: E731
        assert _ranks(state.sp_group) == size_or_none(layout.sp_group(rank))
        assert _ranks(state.dp_group) == size_or_none(layout.dp_group(rank))
        assert _ranks(state.head_group) == size_or_none(layout.head_group(rank))
        # a ring group's ranks come back sorted; the ring order lives in send_to/recv_from
        assert _ranks(state.context_group) == size_or_none(tuple(sorted(layout.context_group(rank))))
        if state.context_group is None:
            assert state.dkv_group is None
        else:  # the dK/dV communicator: the same members, its own group
            assert _ranks(state.dkv_group) == _ranks(state.context_group)
            assert state.dkv_group is not state.context_group
        assert state.context_ranks == layout.context_group(rank)
        for link, members in ((state.inner_ring, layout.inner_ring(rank)), (state.outer_ring, layout.outer_ring(rank))):
            if len(members) == 1:
                assert link is None
                continue
            pos = members.index(rank)
            assert _ranks(link.kv_group) == tuple(sorted(members))
            assert link.kv_group is not state.dkv_group
            assert (link.send_to, link.recv_from) == (members[(pos + 1) % len(members)], members[pos - 1])
        assert set(state.zero_meshes) == set(ZERO_SCOPES)  # built by init_parallel, one per scope
        for scope, mesh in state.zero_meshes.items():
            grid, names = zero_mesh_grid(world, layout.dp, scope)
            row = next(r for r in grid if rank in r)  # the ranks sharding this rank's copy
            assert _ranks(mesh.get_group("shard")) == row
            if "replicate" in names:
                assert _ranks(mesh.get_group("replicate")) == tuple(r[row.index(rank)] for r in grid)
    finally:
        dist.destroy_process_group()
