"""The longest sequence that trains on a number of devices: ``loongtrain plan --max-seq-len``. Pure.

Lengths are searched on multiples of a unit every layout of the devices can shard
(``lcm(2 * devices, 1024)``: the zigzag split needs ``seq_len % (2 * sp) == 0`` and every
``sp`` divides ``devices``), one sequence per optimizer step: doubling from one unit until a
length does not fit, then bisection. "Fits" is the plan's own test: some layout, with the
memory options the search chooses for it, fits device memory and the node's host memory.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from loongtrain.model.config import ModelConfig
from loongtrain.planner.cost import Workload
from loongtrain.planner.estimate import Estimate
from loongtrain.planner.search import (
    SearchResult,
    check_devices,
    evaluate_layouts,
    fits_somewhere,
    search_layouts,
    too_big_message,
)
from loongtrain.planner.specs import ClusterSpec, PlanError

#: lengths beyond this many units are not searched (2^30 tokens at the smallest unit)
MAX_UNITS = 2**20


@dataclass
class MaxSeqLen:
    """The answer: the plan at the longest length, and why one unit more does not fit."""

    result: SearchResult  # the plan at ``seq_len``
    unit: int  # lengths searched are multiples of this
    limit: str  # why ``seq_len + unit`` does not fit (the leanest layout's largest term)
    limiting: Estimate | None  # the leanest layout at ``seq_len + unit``
    lengths_tried: int
    elapsed_s: float

    @property
    def seq_len(self) -> int:
        return self.result.workload.seq_len


def length_unit(devices: int) -> int:
    """Lengths every layout of ``devices`` shards: multiples of ``lcm(2 * devices, 1024)``."""
    return math.lcm(2 * devices, 1024)


def max_seq_len(c: ClusterSpec, model: ModelConfig, devices: int, micro_batch: int = 1) -> MaxSeqLen:
    """The longest sequence (a multiple of :func:`length_unit`) that trains on ``devices`` of
    ``c``; raise :class:`PlanError` when even one unit does not fit."""
    t0 = time.perf_counter()
    unit = length_unit(devices)
    tried = 0

    def workload(units: int) -> Workload:
        return Workload(model, units * unit, batch=micro_batch, micro_batch=micro_batch)

    def fits(units: int) -> bool:
        nonlocal tried
        tried += 1
        return fits_somewhere(c, workload(units), devices)

    check_devices(c, devices)
    if not fits(1):
        reason = too_big_message(c, workload(1), devices, evaluate_layouts(c, workload(1), devices)[2])
        raise PlanError(f"--max-seq-len: even the shortest length {unit} does not fit: {reason}")
    lo, hi = 1, 2
    while hi <= MAX_UNITS and fits(hi):
        lo, hi = hi, hi * 2
    if hi > MAX_UNITS:
        raise PlanError(f"--max-seq-len: {lo * unit} tokens still fit; the search stops there")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    result = search_layouts(c, workload(lo), devices)
    _, _, too_big = evaluate_layouts(c, workload(lo + 1), devices)
    limiting = min(too_big, key=lambda e: (e.memory.total, e.host_per_node)) if too_big else None
    limit = too_big_message(c, workload(lo + 1), devices, too_big, hint=False) if too_big else ""
    return MaxSeqLen(result, unit, limit, limiting, tried, time.perf_counter() - t0)
