"""loongtrain: long-sequence LLM training with 2D head-context parallelism."""

from loongtrain.attention import head_context_attention, shard_sequence, unshard_sequence
from loongtrain.parallel import ParallelConfig, ParallelState, RankLayout, init_parallel

__version__ = "0.1.0"

__all__ = [
    "ParallelConfig",
    "ParallelState",
    "RankLayout",
    "head_context_attention",
    "init_parallel",
    "shard_sequence",
    "unshard_sequence",
]
