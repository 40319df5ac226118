"""Tests by cost, and the shared worker pools.

Every test is ``unit`` (no processes; marked here when it has no other mark), ``dist`` (bodies
on the gloo worker pool below) or ``e2e`` (a command, script or training run in
subprocesses). The suite runs the cheapest modules first: those with unit tests only, then
those with dist tests, then those with end-to-end ones (a module's tests stay together).
``bash scripts/test.sh -m unit`` is the one-minute subset.

The fixture: the dist modules, which run one after the other, share one gloo worker pool
per world size (workers forked from a server that imported torch once per session: a pool
starts in 0.03-0.06 s after the server's 1.2 s, where spawned workers took 1.2 s for 2 ranks,
2.5-3.1 s for 4 and 6.0 s for 8, measured); the shared pools are closed before the first end-to-end module, and an
end-to-end module that needs a pool gets its own, closed when it ends. Every gloo process
group keeps transport threads that wake up while idle: pools holding the groups of a
whole session's layouts were measured burning ~0.85 of the two cores while the
subprocesses of end-to-end tests ran; destroying the groups instead (to keep the pools)
left later modules with DeviceMeshes of destroyed groups.
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
        self._pools.clear()


COSTS = ("unit", "dist", "e2e")


def _cost(item: pytest.Item) -> str:
    if item.get_closest_marker("e2e") is not None:
        return "e2e"
    if item.get_closest_marker("dist") is not None or "dist_pool" in getattr(item, "fixturenames", ()):
        return "dist"
    return "unit"


#: cost index of each module (its most expensive test), filled at collection
MODULE_COST: dict[str, int] = {}
#: pools shared by the dist modules (which run one after the other); closed before the first
#: end-to-end module, whose subprocesses need the cores
SHARED = _Pools()


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark unit tests and order modules by their most expensive test (stable otherwise)."""
    for item in items:
        cost = _cost(item)
        if cost != "e2e" and item.get_closest_marker(cost) is None:
            item.add_marker(getattr(pytest.mark, cost))
        MODULE_COST[_module(item)] = max(MODULE_COST.get(_module(item), 0), COSTS.index(cost))
    items.sort(key=lambda item: MODULE_COST[_module(item)])


def _in_e2e_module(node: pytest.Item | pytest.Module) -> bool:
    return MODULE_COST.get(node.nodeid.split("::")[0], 0) == COSTS.index("e2e")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _in_e2e_module(item):
        SHARED.close()


def pytest_sessionfinish(session: pytest.Session) -> None:
    SHARED.close()


@pytest.fixture(scope="module")
def dist_pool(request: pytest.FixtureRequest):
    """``dist_pool(world)`` -> a WorkerPool of ``world`` gloo ranks: shared by the dist modules
    (spawned once for all of them), the module's own in an end-to-end module."""
    if not _in_e2e_module(request.node):
        yield SHARED
        return
    pools = _Pools()
    yield pools
    pools.close()
