"""Which ring transfers one attention call needs: the routes of every key/value block. Pure.

In the double ring (:mod:`schedule`), the block of context rank ``B`` visits every rank of
the context group once, in a fixed order: at outer step ``j`` it reaches window ``o_B + j``
over the outer ring (its *spine*), then walks that window's inner ring for ``s = 1 ..
ring_window - 1`` steps. A document / sliding-window mask (:class:`MaskPlan`) says which
ranks *read* a block (some query of theirs sees one of its keys). From that alone, with no
communication, every rank derives the same transfers:

- **keys/values** go only as far as the farthest reader: an inner hop ``s -> s + 1`` of
  window ``j`` runs when a rank later in that window reads the block; an outer hop ``j ->
  j + 1`` when a rank in a later window does (ranks in between relay it);
- **dK/dV** (backward): the ranks that read a block in one window, other than its owner,
  form a chain in visiting order; the first starts a float32 partial, each adds its own
  gradient and passes it to the next reader of that window, and the last sends the window's
  total straight to the block's owner, which adds it at the end. Every remote reader sends
  exactly one partial, so the dK/dV bytes are the minimum (one per remote reader), and the
  owner's own gradient never travels. Inside a window the chain follows the inner ring when
  the readers are consecutive; the total's trip home is one transfer, hidden behind the
  compute that follows.

With every rank reading every block (one causal document) this is the full double ring:
``cp - 1`` key/value hops per pass and ``cp - 1`` dK/dV partials per rank.

``slot`` numbers the ring steps ``(j, s)`` as ``j * ring_window + s``. A transfer is
posted by sender and receiver in the same slot (after that slot's compute for dK/dV, at
its start for keys/values), so every rank posts the same transfers at the same point.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

from loongtrain.attention.schedule import ring_source
from loongtrain.parallel.config import ParallelConfig


class Hop(NamedTuple):
    """Whether this rank sends its key/value block on and receives the next one."""

    send: bool
    recv: bool


class DkvSend(NamedTuple):
    """A dK/dV partial of block ``block`` leaving context rank ``src`` for ``dst`` in a slot."""

    src: int
    dst: int
    block: int
    home: bool  # a window's total going to the block's owner (else: to the next reader)


class DkvRole(NamedTuple):
    """What rank ``c`` does with the gradient of the block it holds in a slot."""

    writes: bool  # it reads the block, so it has a gradient for it
    owner: bool  # the block is its own (the gradient stays)
    incoming: bool  # a partial of earlier readers in this window arrives first
    send_to: int | None  # where the partial goes (the next reader, or the owner)


@dataclass(frozen=True)
class RingRoutes:
    """Transfers of the double ring of ``config`` when rank ``c`` reads block ``src`` iff
    ``reads[c][src]``. Build with :func:`ring_routes`; every query is pure arithmetic."""

    config: ParallelConfig
    reads: tuple[tuple[bool, ...], ...]

    @property
    def cp(self) -> int:
        return self.config.cp

    def source(self, c: int, j: int, s: int) -> int:
        """The block context rank ``c`` holds at step ``(j, s)``."""
        return ring_source(c, self.config, j, s)

    def reader(self, block: int, j: int, s: int) -> int:
        """The rank that holds ``block`` at step ``(j, s)`` of its route."""
        w, n = self.config.ring_window, self.config.n_ring_windows
        o, i = divmod(block, w)
        return ((o + j) % n) * w + (i + s) % w

    @functools.cached_property
    def _window_readers(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """``(block, j)`` -> inner steps ``s`` at which a rank other than the owner reads it."""
        w, n = self.config.ring_window, self.config.n_ring_windows
        out = {}
        for block in range(self.cp):
            for j in range(n):
                out[(block, j)] = tuple(
                    s for s in range(w) if (j, s) != (0, 0) and self.reads[self.reader(block, j, s)][block]
                )
        return out

    @functools.cached_property
    def _last_window(self) -> tuple[int, ...]:
        """Per block, the last outer step at which some rank reads it (0: its own window only)."""
        n = self.config.n_ring_windows
        return tuple(max([0] + [j for j in range(n) if self._window_readers[(b, j)]]) for b in range(self.cp))

    def inner_needed(self, block: int, j: int, s: int) -> bool:
        """Whether ``block`` makes the inner hop ``s -> s + 1`` of its outer step ``j``."""
        return any(t > s for t in self._window_readers[(block, j)])

    def outer_needed(self, block: int, j: int) -> bool:
        """Whether ``block`` makes the outer hop ``j -> j + 1``."""
        return self._last_window[block] > j

    def kv_inner(self, c: int, j: int, s: int) -> Hop:
        """Rank ``c``'s inner key/value transfer at step ``(j, s)`` (``s + 1 < ring_window``)."""
        return Hop(self.inner_needed(self.source(c, j, s), j, s), self.inner_needed(self.source(c, j, s + 1), j, s))

    def kv_outer(self, c: int, j: int) -> Hop:
        """Rank ``c``'s outer key/value transfer during outer step ``j`` (``j + 1 < n``)."""
        return Hop(self.outer_needed(self.source(c, j, 0), j), self.outer_needed(self.source(c, j + 1, 0), j))

    def holds(self, c: int, j: int, s: int) -> bool:
        """Whether rank ``c`` has the block of step ``(j, s)`` (it was sent that far)."""
        block = self.source(c, j, s)
        if s > 0:
            return self.inner_needed(block, j, s - 1)
        return j == 0 or self.outer_needed(block, j - 1)

    def dkv_role(self, c: int, j: int, s: int) -> DkvRole:
        """What rank ``c`` does with the gradient of its block at step ``(j, s)``."""
        block = self.source(c, j, s)
        if (j, s) == (0, 0):
            return DkvRole(self.reads[c][block], True, False, None)
        if not self.reads[c][block]:
            return DkvRole(False, False, False, None)
        steps = self._window_readers[(block, j)]
        k = steps.index(s)
        send_to = self.reader(block, j, steps[k + 1]) if k + 1 < len(steps) else block
        return DkvRole(True, False, k > 0, send_to)

    @functools.cached_property
    def _dkv_slots(self) -> tuple[tuple[DkvSend, ...], ...]:
        w, n = self.config.ring_window, self.config.n_ring_windows
        slots = []
        for j in range(n):
            for s in range(w):
                sends = []
                for c in range(self.cp):
                    role = self.dkv_role(c, j, s)
                    if role.send_to is not None:
                        block = self.source(c, j, s)
                        sends.append(DkvSend(c, role.send_to, block, role.send_to == block))
                slots.append(tuple(sends))
        return tuple(slots)

    def dkv_sends(self, slot: int) -> tuple[DkvSend, ...]:
        """Every dK/dV partial sent in ``slot`` (by any rank of the context group)."""
        return self._dkv_slots[slot]

    @functools.cached_property
    def _arrivals(self) -> dict[tuple[int, int], tuple[DkvSend, ...]]:
        out: dict[tuple[int, int], list[DkvSend]] = {}
        for slot, sends in enumerate(self._dkv_slots):
            for t in sends:
                out.setdefault((t.dst, slot), []).append(t)
        return {key: tuple(value) for key, value in out.items()}

    def dkv_arrivals(self, c: int, slot: int) -> tuple[DkvSend, ...]:
        """The dK/dV partials sent to rank ``c`` in ``slot``."""
        return self._arrivals.get((c, slot), ())

    # -- counts (what ``state.stats`` sees, and the minimum) -----------------------------
    def _kv_hops(self, c: int) -> list[Hop]:
        w, n = self.config.ring_window, self.config.n_ring_windows
        inner = [self.kv_inner(c, j, s) for j in range(n) for s in range(w - 1)]
        return inner + [self.kv_outer(c, j) for j in range(n - 1)]

    def kv_hops(self, c: int) -> int:
        """Key/value blocks rank ``c`` sends in one pass (forward, or the backward's replay)."""
        return sum(hop.send for hop in self._kv_hops(c))

    def kv_received(self, c: int) -> int:
        """Key/value blocks rank ``c`` receives in one pass."""
        return sum(hop.recv for hop in self._kv_hops(c))

    def dkv_partials(self, c: int) -> int:
        """dK/dV partials rank ``c`` sends in one backward."""
        return sum(1 for slot in self._dkv_slots for t in slot if t.src == c)

    def dkv_received(self, c: int) -> int:
        """dK/dV partials rank ``c`` receives in one backward."""
        return sum(len(self.dkv_arrivals(c, slot)) for slot in range(len(self._dkv_slots)))

    def minimum_transfers(self) -> int:
        """The fewest block transfers of one pass over the whole context group: each block once
        to each rank other than its owner that reads it (:meth:`remote_readers`). A forward
        needs this many key/value blocks, a backward as many again and as many dK/dV partials."""
        return sum(self.remote_readers(b) for b in range(self.cp))

    def remote_readers(self, block: int) -> int:
        """Ranks other than its owner that read ``block``: the fewest transfers that bring it to
        them (and the fewest dK/dV partials that bring their gradients back)."""
        return sum(self.reads[c][block] for c in range(self.cp) if c != block)


def ring_routes(config: ParallelConfig, reads) -> RingRoutes:
    """The routes of ``config``'s double ring for the read matrix ``reads[c][src]`` (bools)."""
    cp = config.cp
    table = tuple(tuple(bool(x) for x in row) for row in reads)
    if len(table) != cp or any(len(row) != cp for row in table):
        raise ValueError(f"ring_routes: reads must be {cp} x {cp} (context ranks x blocks)")
    return RingRoutes(config, table)


def full_routes(config: ParallelConfig) -> RingRoutes:
    """Routes when every rank reads every block (one causal document, or full attention)."""
    return _full(config.cp, config.ring_window)


@functools.lru_cache(maxsize=64)
def _full(cp: int, ring_window: int) -> RingRoutes:
    return ring_routes(ParallelConfig(cp=cp, ring_window=ring_window), [[True] * cp for _ in range(cp)])
