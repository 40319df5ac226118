"""loongtrain: long-sequence LLM training with 2D head-context parallelism.

The public names below are imported on first use (PEP 562), so ``import loongtrain`` and
the pure modules (``loongtrain.planner``, ``loongtrain.options``, ``loongtrain.model.config``,
``loongtrain.parallel.layout``) do not import torch.

- attention: ``ParallelConfig``, ``init_parallel`` -> ``ParallelState``, ``RankLayout``,
  ``sequence_layout`` -> ``SequenceLayout``, ``shard_sequence`` / ``unshard_sequence``,
  ``head_context_attention``;
- training: ``model_config`` and ``build_model`` (on the meta device), ``parallelize``
  (attention wiring, activation checkpointing and the other ``MemoryOptions``, hybrid
  ZeRO), ``materialize``, ``forward_backward``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loongtrain._lazy import lazy_attributes

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "ParallelConfig": "loongtrain.parallel.config",
    "ParallelState": "loongtrain.parallel.state",
    "RankLayout": "loongtrain.parallel.layout",
    "init_parallel": "loongtrain.parallel.state",
    "head_context_attention": "loongtrain.attention.head_context",
    "SequenceLayout": "loongtrain.attention.layout",
    "sequence_layout": "loongtrain.attention.layout",
    "shard_sequence": "loongtrain.attention.layout",
    "unshard_sequence": "loongtrain.attention.layout",
    "model_config": "loongtrain.model.config",
    "build_model": "loongtrain.model.llama",
    "MemoryOptions": "loongtrain.options",
    "materialize": "loongtrain.apply.init",
    "parallelize": "loongtrain.apply",
    "forward_backward": "loongtrain.train.step",
}
# subpackages reachable as attributes
_SUBPACKAGES = (
    "apply", "attention", "data", "eval", "generate", "hf", "model", "parallel", "planner", "tools", "train",
)  # fmt: skip

__all__ = [
    "MemoryOptions",
    "ParallelConfig",
    "SequenceLayout",
    "ParallelState",
    "RankLayout",
    "build_model",
    "forward_backward",
    "head_context_attention",
    "init_parallel",
    "materialize",
    "model_config",
    "parallelize",
    "sequence_layout",
    "shard_sequence",
    "unshard_sequence",
]


__getattr__ = lazy_attributes(__name__, _EXPORTS, _SUBPACKAGES)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # for type checkers and IDEs; never executed
    from loongtrain.apply import parallelize
    from loongtrain.apply.init import materialize
    from loongtrain.attention.head_context import head_context_attention
    from loongtrain.attention.layout import (
        SequenceLayout,
        sequence_layout,
        shard_sequence,
        unshard_sequence,
    )
    from loongtrain.model.config import model_config
    from loongtrain.model.llama import build_model
    from loongtrain.options import MemoryOptions
    from loongtrain.parallel.config import ParallelConfig
    from loongtrain.parallel.layout import RankLayout
    from loongtrain.parallel.state import ParallelState, init_parallel
    from loongtrain.train.step import forward_backward
