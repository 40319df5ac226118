"""Rank layout arithmetic: which global ranks form each group. Pure, no process group.

Coordinates of a rank: data-parallel index ``d``, head index ``h`` (0..hp-1) and context
index ``c`` (0..cp-1), with ``c = o * ring_window + i`` (``o`` the rank's position on the
outer ring, i.e. its ring window, ``i`` its position on the inner ring). The context index
``c`` is the one source of truth for the ring schedule and for the sequence sharding; the
placement and the context order only decide which global rank carries which coordinates.
"""

from __future__ import annotations

from dataclasses import dataclass

from loongtrain.parallel.config import ParallelConfig


def check_head_split(heads: int, kv_heads: int, hp: int) -> None:
    """Raise ValueError unless ``heads`` query and ``kv_heads`` key/value heads split over ``hp``
    head ranks: ``heads % hp == 0``, and ``kv_heads % hp == 0`` or (replication)
    ``hp % kv_heads == 0``."""
    if heads % kv_heads != 0:
        raise ValueError(
            f"query heads H={heads} are not a multiple of key/value heads G={kv_heads} (GQA needs H % G == 0)"
        )
    if heads % hp != 0:
        options = [x for x in range(1, heads + 1) if heads % x == 0]
        raise ValueError(
            f"query heads H={heads} are not divisible by hp={hp}; choose hp among {options} "
            f"or change the model's head count"
        )
    if hp > kv_heads and hp % kv_heads != 0:
        raise ValueError(
            f"hp={hp} exceeds the key/value heads G={kv_heads} but is not a multiple of G, so KV heads "
            f"cannot be replicated evenly; use hp a multiple of {kv_heads} or a divisor of {kv_heads}"
        )
    if hp <= kv_heads and kv_heads % hp != 0:
        raise ValueError(
            f"key/value heads G={kv_heads} are not divisible by hp={hp}; "
            f"use hp dividing {kv_heads} or a multiple of {kv_heads}"
        )


def head_group_slices(n_heads: int, n_kv_heads: int, groups: int) -> list[tuple[slice, slice]]:
    """Each group's query heads and the key/value heads they read: whole GQA groups per head
    group (``n_kv_heads % groups == 0``), or head groups inside one key/value head
    (``groups % n_kv_heads == 0``: that head's k/v are recomputed by each of its groups)."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"head_groups={groups!r} must be a positive integer (1: the whole layer at once)")
    if n_heads % groups or (n_kv_heads % groups and groups % n_kv_heads):
        raise ValueError(
            f"head_groups={groups} does not split the model's heads (n_heads={n_heads}, n_kv_heads={n_kv_heads}): "
            f"it must divide n_heads and divide or be a multiple of n_kv_heads"
        )
    per_group, ratio = n_heads // groups, n_heads // n_kv_heads
    out = []
    for g in range(groups):
        first = g * per_group
        kv_first = first // ratio
        kv_count = max(1, per_group // ratio)
        out.append((slice(first, first + per_group), slice(kv_first, kv_first + kv_count)))
    return out


def check_head_groups(heads: int, kv_heads: int, groups: int, hp: int) -> None:
    """Raise ValueError unless ``groups`` head groups split the heads (:func:`head_group_slices`)
    and each group's heads split over ``hp`` head ranks (:func:`check_head_split`)."""
    q, kv = head_group_slices(heads, kv_heads, groups)[0]
    try:
        check_head_split(q.stop - q.start, kv.stop - kv.start, hp)
    except ValueError as e:
        raise ValueError(
            f"head_groups={groups}: a group of {q.stop - q.start} query and {kv.stop - kv.start} key/value "
            f"heads does not split over hp={hp} ({e}); use fewer head groups"
        ) from None


def check_sequence_length(seq_len: int, hp: int, cp: int) -> None:
    """Raise ValueError unless ``seq_len`` can be sharded over ``hp x cp`` ranks:
    ``seq_len % (2 * hp * cp) == 0`` (zigzag cuts it into ``2*cp`` chunks, each split over
    ``hp`` ranks; the document balance needs the same multiple)."""
    multiple = 2 * hp * cp
    if seq_len <= 0 or seq_len % multiple != 0:
        padded = max(multiple, -(-seq_len // multiple) * multiple)
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2*sp = 2*{hp}*{cp} = {multiple} "
            f"(zigzag sharding cuts it into 2*cp chunks split over hp ranks); pad the "
            f"sequence to a multiple of {multiple} (e.g. {padded})"
        )


@dataclass(frozen=True)
class RankCoords:
    """Coordinates of one global rank in the ``dp x hp x cp`` layout."""

    dp: int
    head: int
    context: int
    outer_pos: int  # position on the outer ring (which ring window)
    inner_pos: int  # position on the inner ring (inside the ring window)


@dataclass(frozen=True)
class RankLayout:
    """The layout of ``world_size`` ranks under a ``ParallelConfig``.

    All methods are pure arithmetic; group-returning methods give global ranks in the
    order that the communication uses (head order, ring order).
    """

    config: ParallelConfig
    world_size: int
    dp: int

    @classmethod
    def build(cls, config: ParallelConfig, world_size: int) -> RankLayout:
        """Validate ``config`` against ``world_size`` and return the layout."""
        return cls(config=config, world_size=world_size, dp=config.resolve_dp(world_size))

    # -- degrees -------------------------------------------------------------------
    @property
    def hp(self) -> int:
        return self.config.hp

    @property
    def cp(self) -> int:
        return self.config.cp

    @property
    def sp(self) -> int:
        return self.config.sp

    @property
    def ring_window(self) -> int:
        return self.config.ring_window

    @property
    def n_ring_windows(self) -> int:
        return self.config.n_ring_windows

    # -- coordinates <-> rank ------------------------------------------------------
    def _context_slot(self, c: int) -> int:
        """Physical slot (0..cp-1) of context index ``c`` in the placement."""
        if self.config.context_order == "contiguous":
            return c
        o, i = divmod(c, self.ring_window)
        return i * self.n_ring_windows + o

    def _context_index(self, slot: int) -> int:
        if self.config.context_order == "contiguous":
            return slot
        i, o = divmod(slot, self.n_ring_windows)
        return o * self.ring_window + i

    def rank(self, dp: int, head: int, context: int) -> int:
        """Global rank with coordinates ``(dp, head, context)``."""
        for name, value, bound in (
            ("dp", dp, self.dp),
            ("head", head, self.hp),
            ("context", context, self.cp),
        ):
            if not 0 <= value < bound:
                raise ValueError(f"RankLayout.rank: {name}={value} out of range [0, {bound})")
        slot = self._context_slot(context)
        if self.config.placement == "head_first":
            local = slot * self.hp + head
        else:
            local = head * self.cp + slot
        return dp * self.sp + local

    def coords(self, rank: int) -> RankCoords:
        """Coordinates of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"RankLayout.coords: rank={rank} out of range [0, {self.world_size})")
        dp, local = divmod(rank, self.sp)
        if self.config.placement == "head_first":
            slot, head = divmod(local, self.hp)
        else:
            head, slot = divmod(local, self.cp)
        context = self._context_index(slot)
        outer_pos, inner_pos = divmod(context, self.ring_window)
        return RankCoords(dp=dp, head=head, context=context, outer_pos=outer_pos, inner_pos=inner_pos)

    # -- groups of one rank --------------------------------------------------------
    def sp_group(self, rank: int) -> tuple[int, ...]:
        """The ``sp`` ranks of ``rank``'s replica, in global-rank order."""
        start = self.coords(rank).dp * self.sp
        return tuple(range(start, start + self.sp))

    def dp_group(self, rank: int) -> tuple[int, ...]:
        """Ranks with the same (head, context) in every replica, ordered by dp."""
        x = self.coords(rank)
        return tuple(self.rank(d, x.head, x.context) for d in range(self.dp))

    def head_group(self, rank: int) -> tuple[int, ...]:
        """Ranks of the all-to-all group, ordered by head index."""
        x = self.coords(rank)
        return tuple(self.rank(x.dp, h, x.context) for h in range(self.hp))

    def context_group(self, rank: int) -> tuple[int, ...]:
        """Ranks of the ring group, ordered by context index ``c``."""
        x = self.coords(rank)
        return tuple(self.rank(x.dp, x.head, c) for c in range(self.cp))

    def inner_ring(self, rank: int) -> tuple[int, ...]:
        """Ranks of ``rank``'s ring window, ordered by position on the inner ring."""
        x = self.coords(rank)
        base = x.outer_pos * self.ring_window
        return tuple(self.rank(x.dp, x.head, base + i) for i in range(self.ring_window))

    def outer_ring(self, rank: int) -> tuple[int, ...]:
        """Ranks at ``rank``'s inner-ring position in every ring window, ordered by window."""
        x = self.coords(rank)
        return tuple(self.rank(x.dp, x.head, o * self.ring_window + x.inner_pos) for o in range(self.n_ring_windows))

    # -- every group of a family (for building process groups) ---------------------
    def _family(self, member_fn) -> list[tuple[int, ...]]:
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(member_fn(r), None)
        return list(seen)

    def all_sp_groups(self) -> list[tuple[int, ...]]:
        return self._family(self.sp_group)

    def all_dp_groups(self) -> list[tuple[int, ...]]:
        return self._family(self.dp_group)

    def all_head_groups(self) -> list[tuple[int, ...]]:
        return self._family(self.head_group)

    def all_context_groups(self) -> list[tuple[int, ...]]:
        return self._family(self.context_group)

    def all_inner_rings(self) -> list[tuple[int, ...]]:
        return self._family(self.inner_ring)

    def all_outer_rings(self) -> list[tuple[int, ...]]:
        return self._family(self.outer_ring)
