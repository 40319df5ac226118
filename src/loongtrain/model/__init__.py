"""The Llama-style model (no parallel code) and its presets."""

from loongtrain.model.config import PRESETS, ModelConfig, model_config
from loongtrain.model.llama import Transformer, build_model, init_value, sdpa_attention

__all__ = ["PRESETS", "ModelConfig", "Transformer", "build_model", "init_value", "model_config", "sdpa_attention"]
