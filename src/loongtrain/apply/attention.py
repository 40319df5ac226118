"""Wire the model's attention to 2D head-context attention."""

from __future__ import annotations

from functools import partial

from loongtrain.attention import head_context_attention
from loongtrain.model.config import ModelConfig
from loongtrain.model.llama import Transformer
from loongtrain.parallel import ParallelState
from loongtrain.parallel.layout import check_head_split


def check_model_fits(cfg: ModelConfig, hp: int) -> None:
    """Raise (before any communication) if the model's heads do not split over ``hp``."""
    try:
        check_head_split(cfg.n_heads, cfg.n_kv_heads, hp)
    except ValueError as e:
        raise ValueError(f"the model (n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads}) does not fit: {e}") from None


def apply_attention(model: Transformer, state: ParallelState) -> None:
    """Make every layer call :func:`head_context_attention` (causal) on this state.

    The model passes each batch's :class:`~loongtrain.attention.layout.SequenceLayout`
    (its documents, cut with the state's ``config.balance``) and its sliding window through.
    """
    check_model_fits(model.config, state.hp)
    attention = partial(head_context_attention, state=state, causal=True)
    for layer in model.layers:
        layer.attention.attention_fn = attention
