"""Peak memory per device of a training step. Pure.

Counts what this implementation keeps (``model/llama.py`` under ``parallelize``):

- model states: fp32 parameters, fp32 gradients and two fp32 AdamW moments (16 bytes per
  parameter), divided by the ZeRO shard degree; plus the gathered bf16 copies of two
  layers (prefetch) and of the root parameters, and one layer's unsharded fp32 gradient;
- saved activations per layer, by checkpoint mode (per token of the rank's shard):
  ``none`` everything autograd saves (norm inputs in fp32, projection inputs, the
  attention op's q/kv/out/lse, the SwiGLU intermediates); ``full`` the block input;
  ``sc++`` the block input plus the attention output and lse and, when ``hp > 1``, the
  head-scattered q/k/v and the gathered output; plus, for ``full``/``sc++``, one layer's
  recomputed activations during its backward;
- attention buffers of the ring (KV blocks in flight, fp32 dK/dV partials and dq, the
  all-to-all send/receive buffers); and the logits with their fp32 softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

from loongtrain.model.config import ModelConfig
from loongtrain.planner.cost import Candidate, Workload, replicated_kv_heads
from loongtrain.planner.zero import shard_degree


def layer_activation_bytes(m: ModelConfig, hp: int, mode: str, e: int) -> float:
    """Bytes one layer keeps for backward, per token of the rank's shard (before the all-to-all)."""
    d, hd, h, f = m.dim, m.head_dim, m.n_heads, m.ffn_dim
    gr = replicated_kv_heads(m, hp)
    attn_io = e * (h + 2 * gr) * hd + e * h * hd + 4 * h  # q, kv, out, lse of the ring op
    gathered_out = e * h * hd if hp > 1 else 0  # head_gather's output (the wo input)
    if mode == "none":
        norms = 2 * (4 + e) * d  # fp32 copy of the input, normalised bf16 (weight grad)
        proj_inputs = 2 * e * d  # input of q/k/v and of w1/w3
        swiglu = 4 * e * f  # w1 out, silu out, w3 out, product (w2 input)
        return norms + proj_inputs + attn_io + gathered_out + swiglu
    if mode == "full":
        return e * d
    if mode == "sc++":
        kept = e * h * hd + 4 * h  # ring output and lse
        if hp > 1:
            kept += e * (h + 2 * gr) * hd + gathered_out  # head_scatter outputs, head_gather output
        return e * d + kept
    raise ValueError(f"unknown checkpoint mode {mode!r}")


def attention_buffer_bytes(m: ModelConfig, hp: int, cp: int, e: int, accum: int = 4) -> float:
    """Transient attention memory per token of the rank's shard (backward, the larger pass)."""
    hd, h = m.head_dim, m.n_heads
    gr = replicated_kv_heads(m, hp)
    a2a = 2 * e * (h + 2 * gr) * hd if hp > 1 else 0  # packed send + receive
    kernel = e * (h + 2 * gr) * hd  # one block's dq, dk, dv
    dq = accum * h * hd
    ring = 3 * 2 * gr * hd * e + 4 * 2 * gr * hd * accum if cp > 1 else 0  # KV blocks, dK/dV partials
    return a2a + kernel + dq + ring


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes per device by component."""

    states: float
    gathered: float
    activations: float
    recompute: float
    attention: float
    logits: float

    @property
    def total(self) -> float:
        return self.states + self.gathered + self.activations + self.recompute + self.attention + self.logits


def memory_bytes(w: Workload, layout: Candidate) -> MemoryBreakdown:
    """Peak memory of one device for ``layout`` running ``w`` (micro-batch ``w.micro_batch``)."""
    m, e = w.model, w.dtype_bytes
    tokens = w.micro_batch * w.seq_len / layout.sp
    p_layer = m.layer_params()
    p_root = m.num_params() - m.n_layers * p_layer
    states = 16.0 * m.num_params() / shard_degree(layout)
    gathered = 2 * p_layer * e + p_layer * 4 + p_root * (e + 4)
    per_layer = layer_activation_bytes(m, layout.hp, layout.checkpoint, e)
    activations = m.n_layers * per_layer * tokens + (4 + 2 * e) * m.dim * tokens  # + final norm
    recompute = 0.0 if layout.checkpoint == "none" else layer_activation_bytes(m, layout.hp, "none", e) * tokens
    attention = attention_buffer_bytes(m, layout.hp, layout.cp, e, w.accum_bytes) * tokens
    logits = (e + 8) * m.vocab_size * tokens
    return MemoryBreakdown(states, gathered, activations, recompute, attention, logits)
