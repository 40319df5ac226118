"""The Llama-style model (no parallel code) and its presets."""

from loongtrain.model.config import PRESETS, ModelConfig, RopeScaling, extend_context, model_config
from loongtrain.model.llama import Transformer, build_model, init_value, sdpa_attention

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
