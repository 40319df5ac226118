"""The Llama-style model (no parallel code) and its presets.

``ModelConfig``, ``PRESETS`` and ``model_config`` are pure; the model itself (torch) is
loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from loongtrain.model.config import PRESETS, ModelConfig, model_config

_LAZY = {name: "loongtrain.model.llama" for name in ("Transformer", "build_model", "init_value", "sdpa_attention")}

__all__ = ["PRESETS", "ModelConfig", "Transformer", "build_model", "init_value", "model_config", "sdpa_attention"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from loongtrain.model.llama import Transformer, build_model, init_value, sdpa_attention
