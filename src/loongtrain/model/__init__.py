"""The Llama-style model (no parallel code) and its presets.

``ModelConfig``, ``PRESETS``, ``RopeScaling``, ``extend_context`` and ``model_config`` are
pure; the model itself (torch) is loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loongtrain._lazy import lazy_attributes
from loongtrain.model.config import PRESETS, ModelConfig, RopeScaling, extend_context, model_config

_LAZY = {name: "loongtrain.model.llama" for name in ("Transformer", "build_model", "init_value", "sdpa_attention")}

__all__ = [
    "PRESETS",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "build_model",
    "extend_context",
    "init_value",
    "model_config",
    "sdpa_attention",
]


__getattr__ = lazy_attributes(__name__, _LAZY)


if TYPE_CHECKING:
    from loongtrain.model.llama import Transformer, build_model, init_value, sdpa_attention
