"""A Llama-style decoder: RMSNorm, RoPE from position ids, SwiGLU MLP, MHA or GQA.

Options for the Hugging Face families (``loongtrain.hf``): q/k/v biases (Qwen2), an
RMSNorm over each q/k head before RoPE (Qwen3), a head size other than dim / n_heads,
RoPE scaled for a longer context (linear, llama3, yarn; :mod:`loongtrain.model.rope`),
and a sliding window (Mistral).

The model knows nothing of parallelism. Its attention calls
``attention_fn(q, k, v, layout=..., sliding_window=...)`` on ``[B, S, H, d]`` /
``[B, S, G, d]`` tensors with RoPE applied; the default is causal attention over the
local sequence (one device). ``loongtrain.parallelize`` swaps in the distributed
attention. Positions are passed in, so the same module runs on sequence shards: RoPE uses
each token's position (which restarts at 0 in each document of a packed sequence).
``layout`` (a :class:`~loongtrain.attention.layout.SequenceLayout`: the packed
documents of the whole sequence and how it was sharded, or None) and the model's sliding
window only reach the attention function.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from loongtrain.attention.layout import SequenceLayout
from loongtrain.attention.local import masked_attention
from loongtrain.model.config import ModelConfig, RopeScaling
from loongtrain.model.loss import lm_loss, token_scores
from loongtrain.model.norm import (
    RMSNorm,
    cast_like,
    normalize,
    over_tiles,
    rms_norm,
    rms_norm_backward,
    sum_parts,
    tiles,
)
from loongtrain.model.rope import rope_frequencies
from loongtrain.model.tiled_mlp import normed_swiglu

Tensor = torch.Tensor
AttentionFn = Callable[..., Tensor]


def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, layout: SequenceLayout | None = None, sliding_window: int | None = None
) -> Tensor:
    """Causal attention over the local (unsharded) sequence: PyTorch SDPA, or the document /
    sliding-window masked attention when ``layout`` has documents or ``sliding_window`` is set."""
    if (layout is not None and layout.boundaries is not None) or sliding_window is not None:
        return masked_attention(q, k, v, layout=layout, sliding_window=sliding_window)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=k.shape[2] != q.shape[2]
    )
    return out.transpose(1, 2)


class _NormedProjections(torch.autograd.Function):
    """RMSNorm then the q, k, v projections of its output, saving only the norm's input (the
    block input, kept anyway) and its fp32 ``1 / rms``: the normalised input, ``[T, dim]``,
    never exists for the whole sequence. Forward and backward run over tiles of
    :data:`~loongtrain.model.norm.TOKEN_TILE` tokens (backward recomputes the tile's
    normalised input), so the float32 temporaries exist for one tile at a time (weight
    gradients summed in float32 over tiles)."""

    @staticmethod
    def forward(ctx, x, norm_weight, eps, wq, bq, wk, bk, wv, bv):
        def tile(rows: slice) -> tuple[Tensor, ...]:
            h, rstd = rms_norm(x[:, rows], norm_weight, eps)
            return F.linear(h, wq, bq), F.linear(h, wk, bk), F.linear(h, wv, bv), rstd

        q, k, v, rstd = over_tiles(tile, x.shape[1])
        ctx.save_for_backward(x, norm_weight, rstd, wq, wk, wv)
        return q, k, v

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor):
        x, norm_weight, rstd, wq, wk, wv = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_x = torch.empty_like(x)
        sums: list[Tensor | None] = [None] * 7  # norm weight, then (weight, bias) of q, k, v
        for rows in tiles(x.shape[1]):
            xt, rt = x[:, rows], rstd[:, rows]
            h, normed = normalize(xt, rt, norm_weight)
            h = h.flatten(0, -2)
            grads = [g[:, rows].flatten(0, -2) for g in (dq, dk, dv)]
            grad_h = grads[0].mm(wq)
            grad_h.addmm_(grads[1], wk).addmm_(grads[2], wv)  # accumulated in place
            parts: list[Tensor | None] = [None]
            for g, i in zip(grads, (3, 5, 7)):
                parts += [g.t().mm(h) if needs[i] else None, g.sum(0) if needs[i + 1] else None]
            del h
            grad_x[:, rows], parts[0] = rms_norm_backward(grad_h.view_as(xt), xt, norm_weight, rt, needs[1], normed)
            sums = [sum_parts(total, part) for total, part in zip(sums, parts)]
        typed = cast_like(sums, [norm_weight, wq, wq, wk, wk, wv, wv])  # a bias has its weight's dtype
        return grad_x, typed[0], None, *typed[1:]


def rope_tables(
    positions: Tensor, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[Tensor, Tensor]:
    """cos/sin [*positions.shape, head_dim/2] (float32) for integer ``positions``."""
    inv_freq, multiplier = rope_frequencies(head_dim, theta, scaling, positions.device)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    if multiplier == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * multiplier, angles.sin() * multiplier


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of ``x`` [B, S, H, d] by the angles of cos/sin [B or 1, S, d/2] (in fp32)."""
    x32 = x.float().unflatten(-1, (-1, 2))
    a, b = x32[..., 0], x32[..., 1]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    # no cast where the dtype already matches: torch 2.11 compiles an autograd.Function whose
    # result ends in a no-op ``type_as`` to zero gradients (float32 q/k lost theirs; 2.13 does not)
    return out if out.dtype == x.dtype else out.to(x.dtype)


class _Rope(torch.autograd.Function):
    """:func:`_rotate` over tiles of :data:`~loongtrain.model.norm.TOKEN_TILE` tokens (its
    float32 temporaries, several times the size of ``x``, exist for one tile at a time);
    saves only cos/sin. A rotation's gradient is the inverse rotation: the same function
    with ``-sin``."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return over_tiles(lambda rows: (_rotate(x[:, rows], cos[:, rows], sin[:, rows]),), x.shape[1])[0]

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        (grad_x,) = over_tiles(lambda rows: (_rotate(grad[:, rows], cos[:, rows], -sin[:, rows]),), grad.shape[1])
        return grad_x, None, None


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of ``x`` [B, S, H, d]; cos/sin are [B or 1, S, d/2]."""
    return _Rope.apply(x, cos, sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.sliding_window = cfg.sliding_window or None
        # Qwen3: RMSNorm over each head of q and k (weights shared by the heads)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.attention_fn: AttentionFn = sdpa_attention

    def forward(
        self, x: Tensor, norm: RMSNorm, cos: Tensor, sin: Tensor, layout: SequenceLayout | None = None
    ) -> Tensor:
        """Attention of ``norm(x)`` for ``x`` [B, S, dim]; the norm and the q/k/v projections keep
        only ``x`` for backward (:class:`_NormedProjections`)."""
        b, s, _ = x.shape
        q, k, v = _NormedProjections.apply(
            x, norm.weight, norm.eps, self.wq.weight, self.wq.bias, self.wk.weight, self.wk.bias,
            self.wv.weight, self.wv.bias,
        )  # fmt: skip
        q = q.view(b, s, self.n_heads, self.head_dim)
        k = k.view(b, s, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(b, s, self.n_kv_heads, self.head_dim)
        out = self.attention_fn(q, k, v, layout=layout, sliding_window=self.sliding_window)
        return self.wo(out.reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU of the normed input: w2(silu(w1 h) * w3 h), h = norm(x); over sequence tiles of
    ``tile`` tokens when set (0: off), the norm inside each tile (:mod:`loongtrain.model.tiled_mlp`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.tile = 0

    def forward(self, x: Tensor, norm: RMSNorm) -> Tensor:
        return normed_swiglu(x, norm, self.w1.weight, self.w3.weight, self.w2.weight, self.tile)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout: SequenceLayout | None = None) -> Tensor:
        h = x + self.attention(x, self.attention_norm, cos, sin, layout)
        return h + self.feed_forward(h, self.ffn_norm)


class Transformer(nn.Module):
    """Decoder-only LM: ``forward(tokens [B, S], positions [B, S] or [S], layout=None) -> logits [B, S, V]``.

    ``layout``: the :class:`~loongtrain.attention.layout.SequenceLayout` of the whole
    sequence (its packed documents, and how the tokens were sharded when the model runs on
    shards), or None for one causal sequence. With ``labels`` [B, S] the model returns the
    loss instead of the logits, ``loss_chunk`` tokens of logits at a time
    (:mod:`loongtrain.model.loss`): ``reduction="sum"`` gives ``(summed loss, correct
    predictions)``, ``"none"`` per-token ``(loss, correct)`` without gradients (evaluation).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.loss_chunk = 0  # tokens of logits at a time in the loss (0: all at once)

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        layout: SequenceLayout | None = None,
        labels: Tensor | None = None,
        reduction: str = "sum",
    ) -> Tensor | tuple[Tensor, Tensor]:
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta, self.config.rope_scaling)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, layout)
        h = self.norm(h)
        weight = self.tok_embeddings.weight if self.output is None else self.output.weight
        if labels is None:
            return F.linear(h, weight)
        if reduction == "none":
            return token_scores(h, weight, labels, self.loss_chunk)
        if reduction != "sum":
            raise ValueError(f"reduction={reduction!r}: use 'sum' (training) or 'none' (per-token scores)")
        return lm_loss(h, weight, labels, self.loss_chunk)


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_value(cfg: ModelConfig, name: str, shape: torch.Size, seed: int, device: torch.device) -> Tensor:
    """The full initial value of parameter ``name``: a function of (seed, name) only.

    Norm weights are ones, biases zeros; the residual-branch outputs (``wo``, ``w2``) use a std scaled
    by ``1/sqrt(2 * n_layers)``; everything else ``N(0, init_std)``. Independent of how
    the model is sharded, so every layout starts from the same weights.
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    if name.endswith(".bias"):
        return torch.zeros(shape, device=device)
    std = cfg.init_std
    if name.endswith(("wo.weight", "w2.weight")):
        std = std / (2 * cfg.n_layers) ** 0.5
    gen = torch.Generator(device=device).manual_seed(_param_seed(seed, name))
    return torch.randn(shape, generator=gen, device=device) * std


def build_model(cfg: ModelConfig) -> Transformer:
    """The model on the meta device (no memory); materialise with :func:`materialize`."""
    with torch.device("meta"):
        return Transformer(cfg)
