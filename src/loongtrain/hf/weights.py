"""Parameter names and layouts: loongtrain <-> Hugging Face (Llama, Mistral, Qwen2, Qwen3, SmolLM3, OLMo 3).

One difference is not a rename. loongtrain's RoPE rotates the interleaved pairs
``(x[2i], x[2i+1])`` of a head; transformers' ``rotate_half`` pairs ``x[i]`` with
``x[i + d/2]``. Both use frequency ``i`` for pair ``i``, so a query/key head is the same
after reordering its ``d`` output rows: loongtrain row ``2i + a`` is HF row ``a*d/2 + i``
(``a`` in {0, 1}). q/k projection rows (and their biases and the Qwen3 q/k norm weights)
are permuted that way on import and back on export; scores ``q . k`` are unchanged
because q and k get the same permutation, and v / o are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongtrain.model.config import ModelConfig


@dataclass(frozen=True)
class TensorMap:
    """Where a loongtrain parameter lives in an HF checkpoint."""

    hf_name: str
    rope_heads: int = 0  # >0: rows are ``rope_heads`` RoPE heads to be reordered (see module doc)


def rope_row_order(heads: int, head_dim: int) -> torch.Tensor:
    """Index ``p`` with ``loongtrain_rows = hf_rows[p]`` for ``heads`` heads of ``head_dim``."""
    half = head_dim // 2
    within = torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).flatten()  # 0, h, 1, h+1, ...
    return (torch.arange(heads).unsqueeze(1) * head_dim + within).flatten()


def inverse_order(order: torch.Tensor) -> torch.Tensor:
    """``q`` with ``x[order][q] == x``."""
    return torch.argsort(order)


def parameter_map(cfg: ModelConfig) -> dict[str, TensorMap]:
    """Every loongtrain parameter name of ``cfg``'s model -> its HF tensor."""
    out = {
        "tok_embeddings.weight": TensorMap("model.embed_tokens.weight"),
        "norm.weight": TensorMap("model.norm.weight"),
    }
    if not cfg.tie_embeddings:
        out["output.weight"] = TensorMap("lm_head.weight")
    for i in range(cfg.n_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        if cfg.norm_placement == "pre":
            out[ours + "attention_norm.weight"] = TensorMap(hf + "input_layernorm.weight")
            out[ours + "ffn_norm.weight"] = TensorMap(hf + "post_attention_layernorm.weight")
        elif cfg.norm_placement == "sandwich":  # Gemma 3: both
            out[ours + "attention_norm.weight"] = TensorMap(hf + "input_layernorm.weight")
            out[ours + "post_attention_norm.weight"] = TensorMap(hf + "post_attention_layernorm.weight")
            out[ours + "ffn_norm.weight"] = TensorMap(hf + "pre_feedforward_layernorm.weight")
            out[ours + "post_ffn_norm.weight"] = TensorMap(hf + "post_feedforward_layernorm.weight")
        else:  # OLMo 2/3: the norms of the attention's and the MLP's outputs
            out[ours + "post_attention_norm.weight"] = TensorMap(hf + "post_attention_layernorm.weight")
            out[ours + "post_ffn_norm.weight"] = TensorMap(hf + "post_feedforward_layernorm.weight")
        for name, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
            out[f"{ours}feed_forward.{name}.weight"] = TensorMap(f"{hf}mlp.{proj}.weight")
        kinds = ["weight", "bias"] if cfg.qkv_bias else ["weight"]
        for name, proj, heads in (("wq", "q_proj", cfg.n_heads), ("wk", "k_proj", cfg.n_kv_heads), ("wv", "v_proj", 0)):
            for kind in kinds:
                out[f"{ours}attention.{name}.{kind}"] = TensorMap(f"{hf}self_attn.{proj}.{kind}", heads)
        out[ours + "attention.wo.weight"] = TensorMap(hf + "self_attn.o_proj.weight")
        if cfg.qk_norm:  # over each head (rows of one head) or the whole projection (rows of every head)
            q_heads, k_heads = (1, 1) if cfg.qk_norm_scope == "head" else (cfg.n_heads, cfg.n_kv_heads)
            out[ours + "attention.q_norm.weight"] = TensorMap(hf + "self_attn.q_norm.weight", q_heads)
            out[ours + "attention.k_norm.weight"] = TensorMap(hf + "self_attn.k_norm.weight", k_heads)
    return out


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> the shape ``cfg`` implies (the model on the meta device decides)."""
    from loongtrain.model.llama import build_model

    model = build_model(cfg)
    mapping = parameter_map(cfg)
    return {mapping[name].hf_name: tuple(p.shape) for name, p in model.named_parameters()}


# tensors some checkpoints carry that hold no weights (recomputed by the model)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def to_hf_tensor(cfg: ModelConfig, target: TensorMap, tensor: torch.Tensor) -> torch.Tensor:
    """A loongtrain parameter's full tensor as the HF checkpoint holds it (``target.hf_name``):
    q/k rows back in HF's RoPE order."""
    if target.rope_heads:
        return tensor[inverse_order(rope_row_order(target.rope_heads, cfg.head_dim))]
    return tensor


def to_hf_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """loongtrain parameters (full tensors by loongtrain name) as the HF checkpoint's tensors, by HF name."""
    mapping = parameter_map(cfg)
    return {mapping[name].hf_name: to_hf_tensor(cfg, mapping[name], tensor) for name, tensor in tensors.items()}
