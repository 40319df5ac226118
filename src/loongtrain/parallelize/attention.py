"""Wire the model's attention to 2D head-context attention."""

from __future__ import annotations

from functools import partial

from loongtrain.attention import head_context_attention
from loongtrain.model.config import ModelConfig
from loongtrain.model.llama import Transformer
from loongtrain.parallel import ParallelState


def check_model_fits(cfg: ModelConfig, hp: int) -> None:
    """Raise (before any communication) if the model's heads do not fit ``hp``."""
    heads, kv_heads = cfg.n_heads, cfg.n_kv_heads
    if heads % hp != 0:
        options = [x for x in range(1, heads + 1) if heads % x == 0]
        raise ValueError(
            f"model has n_heads={heads}, not divisible by hp={hp}; choose hp among {options} "
            f"or a model with a multiple of {hp} heads"
        )
    if hp > kv_heads and hp % kv_heads != 0:
        raise ValueError(
            f"hp={hp} exceeds n_kv_heads={kv_heads} but is not a multiple of it, so KV heads cannot be "
            f"replicated evenly; use hp a multiple of {kv_heads} or a divisor of it"
        )
    if hp <= kv_heads and kv_heads % hp != 0:
        raise ValueError(f"n_kv_heads={kv_heads} is not divisible by hp={hp}; use hp dividing {kv_heads}")


def apply_attention(model: Transformer, state: ParallelState) -> None:
    """Make every layer call :func:`head_context_attention` (causal) on this state."""
    check_model_fits(model.config, state.config.hp)
    attention = partial(head_context_attention, state=state, causal=True)
    for layer in model.layers:
        layer.attention.attention_fn = attention
