"""loongtrain's 2D head-context attention as a transformers attention implementation.

``register_attention(state)`` adds a function to transformers' ``AttentionInterface``;
``model.set_attn_implementation(name)`` then makes a Llama / Mistral / Qwen2 / Qwen3
model call it in every layer. transformers hands it ``query`` [B, H, S/sp, d] and
``key``/``value`` [B, G, S/sp, d] (RoPE already applied from the ``position_ids`` the
model was given) and expects ``([B, S/sp, H, d], attention weights or None)``.

The model must see this rank's shard of the sequence: ``input_ids``, ``position_ids``
(the positions RoPE needs) and the labels all cut with :func:`loongtrain.shard_sequence`.
Attention is causal over the global positions, so no attention mask is built or accepted
(a name transformers has no mask function for gets ``attention_mask=None``); pack
documents instead of padding: pass the *global* boundaries as ``cu_seq_lens_q`` (the
keyword transformers forwards to attention functions, as for FlashAttention's varlen
path) with position ids restarting per document, and shard with the layout of the same
boundaries (``shard_sequence(x, state, layout=sequence_layout(S, state, cu))``; the
attention makes the same layout, from the same cache). A model's sliding window (Mistral)
is applied.
"""

from __future__ import annotations

import torch

from loongtrain.attention import head_context_attention
from loongtrain.attention.layout import layout_of_op
from loongtrain.hf.families import require_transformers
from loongtrain.parallel import ParallelState


def make_attention(state: ParallelState):
    """The transformers attention function running :func:`head_context_attention` on ``state``."""
    seen, seen_key, seen_layout = None, None, None  # the last boundaries tensor, (its version, length), layout

    def layout_of(cu, seq_len: int):
        """Every layer of a forward gets the same boundaries tensor (on the GPU, where reading it
        waits for the device): its layout is found once per tensor (and in-place change), not
        once per layer."""
        nonlocal seen, seen_key, seen_layout
        if cu is None:
            return None
        key = (getattr(cu, "_version", None), seq_len)
        if cu is not seen or key != seen_key:
            seen, seen_key = cu, key
            seen_layout = layout_of_op(state.config, seq_len, torch.as_tensor(cu).cpu())
        return seen_layout

    def loongtrain_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        if attention_mask is not None:
            raise ValueError(
                "loongtrain attention: an attention mask is not supported (attention is causal over the global "
                "positions of the zigzag shards); pass no attention_mask and pack documents instead of padding"
            )
        if dropout:
            raise ValueError(f"loongtrain attention: attention dropout={dropout} is not supported; set it to 0")
        if kwargs.get("softcap") is not None:
            raise ValueError(f"loongtrain attention: softcap={kwargs['softcap']} is not supported")
        sliding_window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        cu = kwargs.get("cu_seq_lens_q")
        layout = layout_of(cu, query.shape[2] * state.sp)
        out = head_context_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), state,
            causal=getattr(module, "is_causal", True), softmax_scale=scaling,
            layout=layout, sliding_window=sliding_window or None,
        )  # fmt: skip
        return out, None

    return loongtrain_attention


def register_attention(state: ParallelState, name: str = "loongtrain") -> str:
    """Register 2D head-context attention on ``state`` under ``name`` in transformers'
    ``AttentionInterface``; returns ``name`` for ``model.set_attn_implementation(name)``."""
    transformers = require_transformers()
    transformers.AttentionInterface.register(name, make_attention(state))
    return name
