"""Wire the model's attention to 2D head-context attention."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from functools import partial

from loongtrain.attention import head_context_attention
from loongtrain.attention.head_context import HeadContextSplit, state_of_layout
from loongtrain.attention.layout import SequenceLayout
from loongtrain.model.config import ModelConfig
from loongtrain.model.head_groups import head_group_attention
from loongtrain.model.llama import Transformer
from loongtrain.parallel import ParallelState
from loongtrain.parallel.layout import check_head_groups as check_groups
from loongtrain.parallel.layout import check_head_split


def check_model_fits(cfg: ModelConfig, hp: int) -> None:
    """Raise (before any communication) if the model's heads do not split over ``hp``."""
    try:
        check_head_split(cfg.n_heads, cfg.n_kv_heads, hp)
    except ValueError as e:
        raise ValueError(f"the model (n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads}) does not fit: {e}") from None


def _on_the_layouts_state(q, k, v, *, states: dict, default: ParallelState, layout: SequenceLayout | None = None,
                          sliding_window: int | None = None):  # fmt: skip
    state = state_of_layout(layout, states, default)
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
        attention = partial(_on_the_layouts_state, states=_by_split(state, alternatives), default=state)
    else:
        attention = partial(head_context_attention, state=state, causal=True)
    for layer in model.layers:
        layer.attention.attention_fn = attention


def _by_split(state: ParallelState, alternatives: Sequence[ParallelState]) -> dict:
    return {(s.hp, s.cp, s.config.balance): s for s in (*alternatives, state)}


def check_head_groups(cfg: ModelConfig, groups: int, hps: Sequence[int]) -> None:
    """Raise (before any communication) unless ``groups`` head groups split the model's heads and
    each group's heads split over every ``hp`` of ``hps``."""
    if groups > 1 and not cfg.pre_norm_blocks:
        raise ValueError(
            f"memory.head_groups={groups} runs the pre-norm attention with per-head q/k norms a group of heads at a "
            f"time; this model (norm_placement={cfg.norm_placement!r}, qk_norm_scope={cfg.qk_norm_scope!r}) has "
            "another: set memory.head_groups = 1"
        )
    for hp in hps:
        try:
            check_groups(cfg.n_heads, cfg.n_kv_heads, groups, hp)
        except ValueError as e:
            raise ValueError(f"memory.{e}") from None


def apply_head_groups(
    model: Transformer,
    groups: int,
    state: ParallelState,
    alternatives: Sequence[ParallelState] = (),
    recomputed: Collection[int] = (),
) -> None:
    """Run every layer's attention over ``groups`` groups of heads, one at a time in forward and
    backward (:mod:`loongtrain.model.head_groups`), on the 2D attention of ``state`` (and of
    ``alternatives``, as :func:`apply_attention`). ``groups == 1``: nothing changes.
    ``recomputed``: the layers that full checkpointing recomputes; their attention keeps no
    output and its backward runs each group's attention forward again."""
    check_head_groups(model.config, groups, [s.hp for s in (state, *alternatives)])
    if groups == 1:
        return
    split = HeadContextSplit(state, _by_split(state, alternatives) if alternatives else None)
    for index, layer in enumerate(model.layers):
        keep = index not in recomputed
        layer.attention.over_head_groups = partial(head_group_attention, groups=groups, attention=split, keep=keep)
