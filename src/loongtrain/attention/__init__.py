"""Distributed attention: block kernels, ring, double ring, head all-to-all, 2D.

The exports below import torch and are loaded on first use, so the pure modules of this
package (``schedule``) can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_LAZY = {
    "head_context_attention": "loongtrain.attention.head_context",
    "shard_sequence": "loongtrain.attention.sharding",
    "unshard_sequence": "loongtrain.attention.sharding",
}

__all__ = ["head_context_attention", "shard_sequence", "unshard_sequence"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from loongtrain.attention.head_context import head_context_attention
    from loongtrain.attention.sharding import shard_sequence, unshard_sequence
