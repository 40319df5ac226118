"""Enumerate the layouts of a request, rank them, pick the baselines' best. Pure.

A layout is (dp, hp, cp, ring_window, placement, ZeRO scope, checkpoint mode) with
``dp * hp * cp = devices``. Equivalent layouts are listed once: a plain ring is
``ring_window=1`` (``ring_window=cp`` is the same ring), placement only matters when
``hp > 1`` and ``cp > 1``, and ZeRO scopes that shard over the same group are merged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loongtrain.model.config import ModelConfig
from loongtrain.options import (
    ACTIVATION_CHECKPOINT_MODES,
    PLACEMENTS,
    ZERO_SCOPES,
    check_activation_checkpoint,
    check_zero_scope,
)
from loongtrain.parallel.layout import check_head_split, check_sequence_length
from loongtrain.planner.cost import Candidate, Workload
from loongtrain.planner.estimate import Estimate, estimate
from loongtrain.planner.memory import memory_bytes
from loongtrain.planner.specs import ClusterSpec, PlanError

GiB = 2**30


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _passes(check, *args) -> bool:
    try:
        check(*args)
    except ValueError:
        return False
    return True


def head_degree_ok(m: ModelConfig, hp: int) -> bool:
    """``hp`` divides the query heads and fits the KV heads (the library's ``check_head_split``)."""
    return _passes(check_head_split, m.n_heads, m.n_kv_heads, hp)


def sequence_ok(seq_len: int, sp: int) -> bool:
    """``seq_len`` zigzag-shards over ``sp`` ranks (the library's ``check_sequence_length``)."""
    return _passes(check_sequence_length, seq_len, 1, sp)


def zero_scopes(dp: int, sp: int) -> tuple[str, ...]:
    """Scopes with distinct shard groups (``dp`` is ``none`` when dp=1, ``sp`` is ``dp_sp``; ...)."""
    if dp == 1 and sp == 1:
        return ("none",)
    if dp == 1:
        return ("none", "dp_sp")
    if sp == 1:
        return ("none", "dp")
    return ZERO_SCOPES


def check_devices(c: ClusterSpec, devices: int) -> None:
    """Raise :class:`PlanError` unless ``devices`` is whole nodes (or part of one) of ``c``."""
    dpn = c.devices_per_node
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise PlanError(f"devices={devices!r} must be a positive integer")
    if devices % dpn != 0 and not (devices < dpn and dpn % devices == 0):
        lower, upper = devices // dpn * dpn, -(-devices // dpn) * dpn
        raise PlanError(
            f"devices={devices} is not a multiple of devices_per_node={dpn} of cluster {c.name!r}; "
            f"use whole nodes (e.g. {lower or dpn} or {upper}), or a divisor of {dpn} for part of one node"
        )
    if devices > c.max_devices:
        raise PlanError(
            f"devices={devices} exceeds cluster {c.name!r}: {c.nodes} nodes x {dpn} = {c.max_devices} devices; "
            "raise `nodes` in a cluster file to plan a bigger machine"
        )


def check_workload(w: Workload) -> None:
    """Raise :class:`PlanError` unless the workload's sizes are positive integers that fit together."""
    for name in ("seq_len", "batch", "micro_batch"):
        value = getattr(w, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name}={value!r} must be a positive integer")
    if w.batch % w.micro_batch != 0:
        raise PlanError(f"batch={w.batch} is not a multiple of micro_batch={w.micro_batch}")


def enumerate_layouts(m: ModelConfig, w: Workload, devices: int) -> list[Candidate]:
    """Every distinct valid layout of ``devices`` for ``w`` (memory not yet checked)."""
    out: list[Candidate] = []
    for sp in divisors(devices):
        dp = devices // sp
        if w.batch % (dp * w.micro_batch) != 0:
            continue
        if not sequence_ok(w.seq_len, sp):
            continue
        for hp in divisors(sp):
            if not head_degree_ok(m, hp):
                continue
            cp = sp // hp
            ring_windows = [x for x in divisors(cp) if x < cp] or [1]
            placements = PLACEMENTS if hp > 1 and cp > 1 else ("head_first",)
            for ring_window in ring_windows:
                for placement in placements:
                    for zero in zero_scopes(dp, sp):
                        for ckpt in ACTIVATION_CHECKPOINT_MODES:
                            out.append(Candidate(dp, hp, cp, ring_window, placement, zero, ckpt))
    return out


def _why_none_valid(m: ModelConfig, w: Workload, devices: int) -> str:
    sps = divisors(devices)
    batch_ok = [sp for sp in sps if w.batch % (devices // sp * w.micro_batch) == 0]
    if not batch_ok:
        return f"batch={w.batch} sequences cannot be split over any data-parallel degree of {devices} devices"
    seq_ok = [sp for sp in batch_ok if sequence_ok(w.seq_len, sp)]
    if not seq_ok:
        return (
            f"seq_len={w.seq_len} is not a multiple of 2*sp for any sequence-parallel degree sp in {batch_ok} "
            f"(zigzag sharding cuts the sequence into 2*cp chunks); pad it to a multiple of {2 * max(batch_ok)}"
        )
    return (
        f"no hp divides the model's heads (H={m.n_heads}, G={m.n_kv_heads}) within sp in {seq_ok}; "
        "hp must divide H and either divide G or be a multiple of it"
    )


#: Baselines priced by the same model: layout families people would otherwise run.
BASELINES: dict[str, Callable[[Candidate], bool]] = {
    # DeepSpeed-Ulysses: head all-to-all only (sp = hp <= H); ZeRO, ordinary checkpointing
    "DeepSpeed-Ulysses": lambda x: x.cp == 1 and x.checkpoint != "sc++",
    # Megatron-LM context parallelism: one zigzag ring over the sp ranks (hp = 1)
    "Megatron-CP": lambda x: x.hp == 1 and x.ring_window == 1 and x.checkpoint != "sc++",
    # USP (yunchang): 2D with the head group on consecutive ranks, plain ring, no SC++
    "USP 2D": lambda x: x.placement == "head_first" and x.ring_window == 1 and x.checkpoint != "sc++",
}


@dataclass
class SearchResult:
    """Ranked estimates of a request; ``ranked`` holds the layouts that fit, fastest first."""

    cluster: ClusterSpec
    workload: Workload
    devices: int
    ranked: list[Estimate]
    too_big: list[Estimate]
    baselines: dict[str, Estimate | None]
    n_candidates: int  # layouts evaluated
    elapsed_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Estimate:
        return self.ranked[0]


def _memory_floor(w: Workload, layouts: list[Candidate]) -> tuple[float, Candidate]:
    best = min(layouts, key=lambda x: memory_bytes(w, x).total)
    return memory_bytes(w, best).total, best


def _devices_that_fit(c: ClusterSpec, w: Workload, devices: int) -> int | None:
    d = devices * 2
    while d <= c.max_devices:
        layouts = enumerate_layouts(w.model, w, d)
        if layouts and _memory_floor(w, layouts)[0] <= c.usable_memory_bytes:
            return d
        d *= 2
    return None


def search_layouts(c: ClusterSpec, w: Workload, devices: int) -> SearchResult:
    """Estimate every valid layout of ``devices``; raise :class:`PlanError` if none is valid or fits."""
    check_devices(c, devices)
    check_workload(w)
    t0 = time.perf_counter()
    layouts = enumerate_layouts(w.model, w, devices)
    if not layouts:
        raise PlanError(f"no valid layout for {devices} devices: {_why_none_valid(w.model, w, devices)}")
    estimates = [estimate(c, w, x) for x in layouts]
    ranked = sorted((e for e in estimates if e.fits), key=lambda e: (e.step_s, e.memory.total))
    too_big = sorted((e for e in estimates if not e.fits), key=lambda e: e.step_s)
    if not ranked:
        need, smallest = _memory_floor(w, layouts)
        more = _devices_that_fit(c, w, devices)
        hint = f"; {more} devices would fit" if more else "; it does not fit on any size of this cluster either"
        raise PlanError(
            f"seq_len={w.seq_len} does not fit on {devices} devices of {c.name!r}: the leanest layout "
            f"({smallest.label()}) needs {need / GiB:.1f} GiB per device, more than the usable "
            f"{c.usable_memory_bytes / GiB:.1f} GiB ({c.usable_memory_fraction:.0%} of {c.device_memory_gib:g} GiB)"
            f"{hint}, or use a shorter sequence"
        )
    baselines = {name: next((e for e in ranked if keep(e.candidate)), None) for name, keep in BASELINES.items()}
    return SearchResult(
        cluster=c,
        workload=w,
        devices=devices,
        ranked=ranked,
        too_big=too_big,
        baselines=baselines,
        n_candidates=len(layouts),
        elapsed_s=time.perf_counter() - t0,
    )


def check_candidate(w: Workload, candidate: Candidate, devices: int) -> None:
    """Raise :class:`PlanError` naming what makes ``candidate`` invalid for ``w`` on ``devices``.

    The rules are the library's own: ``ParallelConfig`` (degrees, ring window, placement, the
    world size), ``check_head_split``, ``check_sequence_length`` and the option checks.
    """
    m, x = w.model, candidate
    try:
        x.parallel_config().resolve_dp(devices)
    except ValueError as exc:
        raise PlanError(f"layout: {exc}") from None
    for what, check, args in (
        (f"layout zero={x.zero!r}", check_zero_scope, (x.zero,)),
        (f"layout ckpt={x.checkpoint!r}", check_activation_checkpoint, (x.checkpoint,)),
        (f"layout hp={x.hp} does not fit the model's heads", check_head_split, (m.n_heads, m.n_kv_heads, x.hp)),
        (f"seq_len={w.seq_len}", check_sequence_length, (w.seq_len, x.hp, x.cp)),
    ):
        try:
            check(*args)
        except ValueError as exc:
            raise PlanError(f"{what}: {exc}") from None
    if w.batch % (x.dp * w.micro_batch) != 0:
        raise PlanError(f"batch={w.batch} is not a multiple of dp*micro_batch = {x.dp}*{w.micro_batch}")
