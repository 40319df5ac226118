"""Parallel layout (pure arithmetic) and process groups.

``ParallelConfig``, ``RankLayout``, ``RankCoords`` and ``AttentionStats`` are pure; the
process-group side (``init_parallel``, ``ParallelState``, ``RingLink``) imports torch and
is loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loongtrain._lazy import lazy_attributes
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.layout import RankCoords, RankLayout
from loongtrain.parallel.stats import AttentionStats

_LAZY = {name: "loongtrain.parallel.state" for name in ("ParallelState", "RingLink", "init_parallel")}

__all__ = ["AttentionStats", "ParallelConfig", "ParallelState", "RankCoords", "RankLayout", "RingLink", "init_parallel"]


__getattr__ = lazy_attributes(__name__, _LAZY)


if TYPE_CHECKING:
    from loongtrain.parallel.state import ParallelState, RingLink, init_parallel
