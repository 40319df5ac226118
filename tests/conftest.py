"""Tests by cost, and the shared worker pools.

Every test is ``unit`` (no processes; marked here when it has no other mark), ``dist`` (bodies
on the spawned gloo pool below) or ``e2e`` (a command, script or training run in
subprocesses). The suite runs the cheapest modules first: those with unit tests only, then
those with dist tests, then those with end-to-end ones (a module's tests stay together, so
its pools are spawned once). ``bash scripts/test.sh -m unit`` is the one-minute subset.

The fixture: one spawned gloo worker pool per world size and test module, reused by the
module's tests.

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


COSTS = ("unit", "dist", "e2e")


def _cost(item: pytest.Item) -> str:
    if item.get_closest_marker("e2e") is not None:
        return "e2e"
    if item.get_closest_marker("dist") is not None or "dist_pool" in getattr(item, "fixturenames", ()):
        return "dist"
    return "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark unit tests and order modules by their most expensive test (stable otherwise)."""
    module_cost: dict[str, int] = {}
    for item in items:
        cost = _cost(item)
        if cost != "e2e" and item.get_closest_marker(cost) is None:
            item.add_marker(getattr(pytest.mark, cost))
        key = item.nodeid.split("::")[0]
        module_cost[key] = max(module_cost.get(key, 0), COSTS.index(cost))
    items.sort(key=lambda item: module_cost[item.nodeid.split("::")[0]])


@pytest.fixture(scope="module")
def dist_pool():
    """``dist_pool(world)`` -> a WorkerPool of ``world`` gloo ranks (spawned once per module)."""
    pools = _Pools()
    yield pools
    pools.close()
