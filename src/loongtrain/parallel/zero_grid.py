"""Rank grids of the hybrid-ZeRO meshes, by scope. Pure arithmetic, no process group.

Global rank ``r = d * sp + local`` (data parallel outermost). The grid is the rank
layout of the DeviceMesh that FSDP shards over: rows are replicas of the model states,
a row's ranks shard one copy. ``init_parallel`` builds its meshes from it and the planner
reads the group shapes from it.
"""

from __future__ import annotations

import functools

from loongtrain.options import check_zero_scope

ZeroGrid = tuple[tuple[int, ...], ...]


@functools.lru_cache(maxsize=64)
def zero_mesh_grid(world: int, dp: int, scope: str) -> tuple[ZeroGrid, tuple[str, ...]]:
    """``(grid, dim_names)`` of ``scope``'s mesh over ``world`` ranks with ``dp`` replicas.

    ``dp_sp``: one row of every rank, dims ``("shard",)``; ``sp``: a row per replica;
    ``dp``: a row per sp position (its ranks across the replicas); ``none``: a row per
    rank. The last three have dims ``("replicate", "shard")``.
    """
    check_zero_scope(scope)
    sp = world // dp
    by_replica = tuple(tuple(range(d * sp, (d + 1) * sp)) for d in range(dp))  # [dp][sp]
    if scope == "dp_sp":
        return (tuple(range(world)),), ("shard",)
    if scope == "sp":
        return by_replica, ("replicate", "shard")
    if scope == "dp":
        return tuple(zip(*by_replica)), ("replicate", "shard")
    return tuple((r,) for r in range(world)), ("replicate", "shard")
