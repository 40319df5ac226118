"""Distributed attention: block kernels, ring, double ring, head all-to-all, 2D.

The exports below import torch and are loaded on first use, so the pure modules of this
package (``schedule``) can be imported without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loongtrain._lazy import lazy_attributes

_LAZY = {
    "SequenceLayout": "loongtrain.attention.layout",
    "head_context_attention": "loongtrain.attention.head_context",
    "sequence_layout": "loongtrain.attention.layout",
    "shard_sequence": "loongtrain.attention.layout",
    "unshard_sequence": "loongtrain.attention.layout",
}

__all__ = ["SequenceLayout", "head_context_attention", "sequence_layout", "shard_sequence", "unshard_sequence"]


__getattr__ = lazy_attributes(__name__, _LAZY)


if TYPE_CHECKING:
    from loongtrain.attention.head_context import head_context_attention
    from loongtrain.attention.layout import (
        SequenceLayout,
        sequence_layout,
        shard_sequence,
        unshard_sequence,
    )
