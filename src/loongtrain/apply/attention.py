"""Wire the model's attention to 2D head-context attention."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from loongtrain.attention import head_context_attention
from loongtrain.attention.layout import SequenceLayout
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


def _on_the_layouts_state(q, k, v, *, states: dict, default: ParallelState, layout: SequenceLayout | None = None,
                          sliding_window: int | None = None):  # fmt: skip
    state = default if layout is None else states.get((layout.hp, layout.cp, layout.balance), default)
    return head_context_attention(q, k, v, state, causal=True, layout=layout, sliding_window=sliding_window)


def apply_attention(model: Transformer, state: ParallelState, alternatives: Sequence[ParallelState] = ()) -> None:
    """Make every layer call :func:`head_context_attention` (causal) on this state.

    The model passes each batch's :class:`~loongtrain.attention.layout.SequenceLayout`
    (its documents, cut with the state's ``config.balance``) and its sliding window through.
    ``alternatives``: states of other hp x cp splits (or balances) of the same ranks (a layout
    per microbatch, :mod:`loongtrain.attention.choose`); a layout made for one of them runs on it.
    """
    for s in (state, *alternatives):
        check_model_fits(model.config, s.hp)
        if s.layout.sp_group(s.rank) != state.layout.sp_group(state.rank):
            raise ValueError(
                f"apply_attention: an alternative layout (hp={s.hp}, cp={s.cp}) must split the same "
                f"sequence-parallel group as the state (hp={state.hp}, cp={state.cp}, dp={state.dp})"
            )
    if alternatives:
        states = {(s.hp, s.cp, s.config.balance): s for s in (*alternatives, state)}
        attention = partial(_on_the_layouts_state, states=states, default=state)
    else:
        attention = partial(head_context_attention, state=state, causal=True)
    for layer in model.layers:
        layer.attention.attention_fn = attention
