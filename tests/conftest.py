"""Shared fixtures: one spawned gloo worker pool per world size and test module, reused
by the module's tests.

Pools live for one module, not the whole session: every gloo process group a worker
creates keeps transport threads that wake up while idle, and the pools of a whole session
(hundreds of groups over the layouts the tests touch) were measured burning ~0.85 of the
two cores while other modules' tests ran.
"""

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


@pytest.fixture(scope="module")
def dist_pool():
    """``dist_pool(world)`` -> a WorkerPool of ``world`` gloo ranks (spawned once per module)."""
    pools = _Pools()
    yield pools
    pools.close()
