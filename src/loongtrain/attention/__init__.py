"""Distributed attention: block kernels, ring, double ring, head all-to-all, 2D."""

from loongtrain.attention.head_context import head_context_attention
from loongtrain.attention.sharding import shard_sequence, unshard_sequence

__all__ = ["head_context_attention", "shard_sequence", "unshard_sequence"]
