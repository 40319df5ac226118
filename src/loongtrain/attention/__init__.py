"""Distributed attention: block kernels, ring, double ring, head all-to-all, 2D.

The exports below import torch and are loaded on first use, so the pure modules of this
package (``schedule``) can be imported without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loongtrain._lazy import lazy_attributes

_LAZY = {
    "head_context_attention": "loongtrain.attention.head_context",
    "shard_sequence": "loongtrain.attention.sharding",
    "unshard_sequence": "loongtrain.attention.sharding",
}

__all__ = ["head_context_attention", "shard_sequence", "unshard_sequence"]


__getattr__ = lazy_attributes(__name__, _LAZY)


if TYPE_CHECKING:
    from loongtrain.attention.head_context import head_context_attention
    from loongtrain.attention.sharding import shard_sequence, unshard_sequence
