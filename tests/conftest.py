"""Shared fixtures: one spawned gloo worker pool per world size, reused by all tests."""

from __future__ import annotations

import pytest

from dist_pool import WorkerPool


class _Pools:
    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def __call__(self, world: int) -> WorkerPool:
        pool = self._pools.get(world)
        if pool is None or not pool.alive:
            pool = self._pools[world] = WorkerPool(world)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def dist_pool():
    """``dist_pool(world)`` -> a WorkerPool of ``world`` gloo ranks (spawned once)."""
    pools = _Pools()
    yield pools
    pools.close()
