"""Parallel layout (pure arithmetic) and process groups."""

from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.layout import RankCoords, RankLayout
from loongtrain.parallel.state import ParallelState, RingLink, init_parallel
from loongtrain.parallel.stats import AttentionStats

__all__ = ["AttentionStats", "ParallelConfig", "ParallelState", "RankCoords", "RankLayout", "RingLink", "init_parallel"]
