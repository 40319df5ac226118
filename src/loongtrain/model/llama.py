"""A Llama-style decoder: RMSNorm, RoPE from position ids, SwiGLU MLP, MHA or GQA.

Options for the Hugging Face families (``loongtrain.hf``): q/k/v biases (Qwen2), an
RMSNorm over each q/k head before RoPE (Qwen3), a head size other than dim / n_heads,
RoPE scaled for a longer context (linear, llama3, yarn; :mod:`loongtrain.model.rope`),
and per-layer attention kinds (``ModelConfig.layer_kinds``: each layer full or sliding with
its window, with its own RoPE or none; Gemma 3, OLMo 3, SmolLM3), or one sliding window on
every layer (Mistral).

It reads as the plain model: each piece is its formula. ``loongtrain.parallelize`` swaps in
the memory-lean versions (:mod:`loongtrain.model.lean`, :mod:`loongtrain.model.tiled_mlp`),
each tested equal to its formula here.

The model knows nothing of parallelism. Its attention calls
``attention_fn(q, k, v, layout=..., sliding_window=...)`` on ``[B, S, H, d]`` /
``[B, S, G, d]`` tensors with RoPE applied; the default is causal attention over the
local sequence (one device). ``loongtrain.parallelize`` swaps in the distributed
attention. Positions are passed in, so the same module runs on sequence shards: RoPE uses
each token's position (which restarts at 0 in each document of a packed sequence).
``layout`` (a :class:`~loongtrain.attention.layout.SequenceLayout`: the packed
documents of the whole sequence and how it was sharded, or None) and each layer's sliding
window only reach the attention function. The model makes one cos/sin table per RoPE kind
(``ropes``, keyed by base and scaling) and each layer takes its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from loongtrain.attention.layout import SequenceLayout
from loongtrain.attention.local import masked_attention
from loongtrain.model.config import LayerKind, ModelConfig, RopeScaling
from loongtrain.model.loss import lm_loss, token_scores
from loongtrain.model.norm import OffsetRMSNorm, RMSNorm, make_norm
from loongtrain.model.rope import rope_frequencies
from loongtrain.model.vocab import GradientSink, embedding

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


def normed_projections(x: Tensor, norm: RMSNorm | None, wq: nn.Linear, wk: nn.Linear, wv: nn.Linear):
    """The q, k, v projections of ``norm(x)`` (of ``x`` without a norm: post-norm models)."""
    h = x if norm is None else norm(x)
    return wq(h), wk(h), wv(h)


def rope_tables(
    positions: Tensor, head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> tuple[Tensor, Tensor]:
    """cos/sin [*positions.shape, head_dim/2] (float32) for integer ``positions``."""
    inv_freq, multiplier = rope_frequencies(head_dim, theta, scaling, positions.device)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    if multiplier == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * multiplier, angles.sin() * multiplier


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of ``x`` [B, S, H, d] by the angles of cos/sin [B or 1, S, d/2] (in fp32)."""
    x32 = x.float().unflatten(-1, (-1, 2))
    a, b = x32[..., 0], x32[..., 1]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    # no cast where the dtype already matches: torch 2.11 compiles an autograd.Function whose
    # result ends in a no-op ``type_as`` to zero gradients (float32 q/k lost theirs; 2.13 does not)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def normed_mlp(x: Tensor, norm: RMSNorm | None, w1: nn.Linear, w3: nn.Linear, w2: nn.Linear) -> Tensor:
    """SwiGLU of ``norm(x)`` (of ``x`` without a norm): ``w2(silu(w1 h) * w3 h)``."""
    h = x if norm is None else norm(x)
    return w2(F.silu(w1(h)) * w3(h))


def normed_geglu(x: Tensor, norm: nn.Module | None, w1: nn.Linear, w3: nn.Linear, w2: nn.Linear) -> Tensor:
    """GeGLU of ``norm(x)`` with the tanh GELU (Gemma): ``w2(gelu_tanh(w1 h) * w3 h)``."""
    h = x if norm is None else norm(x)
    return w2(F.gelu(w1(h), approximate="tanh") * w3(h))


#: one cos/sin table per RoPE kind of the model, keyed by :func:`rope_key` (what a layer takes)
Ropes = dict[tuple, tuple[Tensor, Tensor]]


def rope_key(kind: LayerKind) -> tuple | None:
    """The key of a (resolved) layer kind's cos/sin table in :data:`Ropes`; None: no RoPE."""
    return (kind.rope_theta, kind.rope_scaling) if kind.rope else None


def rope_tables_of(cfg: ModelConfig, positions: Tensor) -> Ropes:
    """The cos/sin tables of every RoPE kind of ``cfg``'s layers for ``positions``."""
    keys = {rope_key(k) for k in cfg.kinds} - {None}
    return {key: rope_tables(positions, cfg.head_dim, *key) for key in keys}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: LayerKind | None = None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        kind = kind if kind is not None else cfg.layer_kind(0)
        self.sliding_window = kind.sliding_window or None
        # Qwen3: RMSNorm over each head of q and k (weights shared by the heads); OLMo: over the
        # whole q and k projections (qk_norm_scope "projection")
        self.qk_norm_heads = cfg.qk_norm_scope == "head"
        q_width = cfg.head_dim if self.qk_norm_heads else cfg.n_heads * cfg.head_dim
        k_width = cfg.head_dim if self.qk_norm_heads else cfg.n_kv_heads * cfg.head_dim
        self.q_norm = make_norm(q_width, cfg.norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        self.k_norm = make_norm(k_width, cfg.norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        # Gemma's query_pre_attn_scalar: q scaled so that the kernel's head_dim ** -0.5 gives scalar ** -0.5
        # None where it is 1 (no scalar, or Gemma 3's equal to head_dim): no elementwise pass over q
        scalar = cfg.attention_scalar
        self.q_scale = (cfg.head_dim / scalar) ** 0.5 if scalar and scalar != cfg.head_dim else None
        # swapped by loongtrain.apply: the distributed attention; the norm and projections as
        # one function that keeps only x, and RoPE over token tiles (loongtrain.model.lean)
        self.attention_fn: AttentionFn = sdpa_attention
        self.projections: Callable[..., tuple[Tensor, Tensor, Tensor]] = normed_projections
        self.rope: Callable[[Tensor, Tensor, Tensor], Tensor] = apply_rope
        # swapped by loongtrain.apply for memory.head_groups: this forward over groups of heads,
        # one at a time in forward and backward (loongtrain.model.head_groups)
        self.over_head_groups: Callable[..., Tensor] | None = None

    def forward(
        self,
        x: Tensor,
        norm: RMSNorm | None,
        cos: Tensor | None,
        sin: Tensor | None,
        layout: SequenceLayout | None = None,
    ) -> Tensor:
        """Attention of ``norm(x)`` (``x`` without a norm) for ``x`` [B, S, dim]; RoPE by
        ``cos``/``sin`` (None: a NoPE layer)."""
        if self.over_head_groups is not None:
            return self.over_head_groups(self, x, norm, cos, sin, layout)
        b, s, _ = x.shape
        q, k, v = self.projections(x, norm, self.wq, self.wk, self.wv)
        if self.q_norm is not None and not self.qk_norm_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, self.n_heads, self.head_dim)
        k = k.view(b, s, self.n_kv_heads, self.head_dim)
        v = v.view(b, s, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.qk_norm_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        if self.q_scale is not None:
            q = q * self.q_scale
        out = self.attention_fn(q, k, v, layout=layout, sliding_window=self.sliding_window)
        return self.wo(out.reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU of the normed input: w2(silu(w1 h) * w3 h), h = norm(x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        # swapped by loongtrain.apply for memory.mlp_tile: over sequence tiles (model.tiled_mlp)
        self.mlp: Callable[..., Tensor] = normed_mlp if cfg.activation == "silu" else normed_geglu

    def forward(self, x: Tensor, norm: RMSNorm | None) -> Tensor:
        return self.mlp(x, norm, self.w1, self.w3, self.w2)


class TransformerBlock(nn.Module):
    """One layer of its kind (``cfg.layer_kind(index)``): its window and its RoPE table; its
    norms before attention and the MLP (``norm_placement`` "pre") or on their outputs ("post")."""

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        kind = cfg.layer_kind(index)
        self.rope_key = rope_key(kind)
        pre, post = cfg.norm_placement in ("pre", "sandwich"), cfg.norm_placement in ("post", "sandwich")
        dim, eps, offset = cfg.dim, cfg.norm_eps, cfg.norm_offset
        self.attention_norm = make_norm(dim, eps, offset) if pre else None
        self.attention = Attention(cfg, kind)
        self.post_attention_norm = make_norm(dim, eps, offset) if post else None
        self.ffn_norm = make_norm(dim, eps, offset) if pre else None
        self.feed_forward = FeedForward(cfg)
        self.post_ffn_norm = make_norm(dim, eps, offset) if post else None

    def forward(self, x: Tensor, ropes: Ropes, layout: SequenceLayout | None = None) -> Tensor:
        cos, sin = ropes[self.rope_key] if self.rope_key is not None else (None, None)
        a = self.attention(x, self.attention_norm, cos, sin, layout)
        h = x + (a if self.post_attention_norm is None else self.post_attention_norm(a))
        m = self.feed_forward(h, self.ffn_norm)
        return h + (m if self.post_ffn_norm is None else self.post_ffn_norm(m))


def lm_head(
    h: Tensor,
    weight: Tensor,
    labels: Tensor | None,
    reduction: str,
    chunk: int,
    sink: GradientSink | None,
    norm: RMSNorm | None = None,
    groups: Tensor | None = None,
    n_groups: int = 0,
) -> Tensor | tuple[Tensor, ...]:
    """The output layer: logits ``h W^T`` without ``labels``; with them the loss
    (:func:`~loongtrain.model.loss.lm_loss`, ``reduction="sum"``; with ``groups`` also the
    loss summed per group, ``[n_groups]``) or per-token scores (``"none"``), ``chunk`` tokens
    of logits at a time. ``norm``: the final norm, applied here first (the training loss
    applies it chunk by chunk)."""
    if norm is not None and (labels is None or reduction != "sum" or isinstance(norm, OffsetRMSNorm)):
        h, norm = norm(h), None  # (Gemma's final norm: its own formula, not the chunked loss's)
    if labels is None:
        return F.linear(h, weight)
    if reduction == "none":
        return token_scores(h, weight, labels, chunk)
    if reduction != "sum":
        raise ValueError(f"reduction={reduction!r}: use 'sum' (training) or 'none' (per-token scores)")
    return lm_loss(h, weight, labels, chunk, sink, norm, groups, n_groups)


class Embedding(nn.Embedding):
    """The token embedding; ``sink`` (set by ``loongtrain.parallelize`` under ZeRO) takes its
    weight's float32 gradient instead of autograd (:mod:`loongtrain.model.vocab`)."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__(vocab_size, dim)
        self.sink: GradientSink | None = None

    def forward(self, tokens: Tensor) -> Tensor:
        return embedding(tokens, self.weight, self.sink)

    def lookup(self, tokens: Tensor) -> Tensor:
        """:meth:`forward`, or where the sink holds the whole float32 master matrix on this
        device, its rows read from it and cast to the compute dtype: not through the module,
        whose sharding layer would gather a copy of the matrix."""
        master = None if self.sink is None else self.sink.master()
        if master is None:
            return self(tokens)
        return embedding(tokens, master, self.sink, self.sink.compute_dtype)


class OutputLayer(nn.Linear):
    """The output matrix [vocab, dim]: :func:`lm_head` of its weight (a module of its own, so
    ZeRO can gather it only around the loss); ``sink`` as :class:`Embedding`'s."""

    def __init__(self, dim: int, vocab_size: int) -> None:
        super().__init__(dim, vocab_size, bias=False)
        self.sink: GradientSink | None = None

    def forward(
        self,
        h: Tensor,
        labels: Tensor | None = None,
        reduction: str = "sum",
        chunk: int = 0,
        norm: RMSNorm | None = None,
        groups: Tensor | None = None,
        n_groups: int = 0,
    ) -> Tensor | tuple[Tensor, ...]:
        return lm_head(h, self.weight, labels, reduction, chunk, self.sink, norm, groups, n_groups)

    def head(
        self,
        h: Tensor,
        labels: Tensor | None = None,
        reduction: str = "sum",
        chunk: int = 0,
        norm: RMSNorm | None = None,
        groups: Tensor | None = None,
        n_groups: int = 0,
    ) -> Tensor | tuple[Tensor, ...]:
        """:meth:`forward`, or for the chunked loss where the sink holds the whole float32
        master matrix on this device, the loss reading it a vocabulary slice at a time: not
        through the module, whose sharding layer would gather a copy of the matrix."""
        master = None if self.sink is None or labels is None or chunk <= 0 else self.sink.master()
        if master is None:
            return self(h, labels, reduction, chunk, norm, groups=groups, n_groups=n_groups)
        return lm_head(h, master, labels, reduction, chunk, self.sink, norm, groups, n_groups)


class Transformer(nn.Module):
    """Decoder-only LM: ``forward(tokens [B, S], positions [B, S] or [S], layout=None) -> logits [B, S, V]``.

    ``layout``: the :class:`~loongtrain.attention.layout.SequenceLayout` of the whole
    sequence (its packed documents, and how the tokens were sharded when the model runs on
    shards), or None for one causal sequence. With ``labels`` [B, S] the model returns the
    loss instead of the logits, ``loss_chunk`` tokens of logits at a time
    (:mod:`loongtrain.model.loss`): ``reduction="sum"`` gives ``(summed loss, correct
    predictions)``, ``"none"`` per-token ``(loss, correct)`` without gradients (evaluation).
    With ``groups`` (int64 like ``labels``, in ``[0, n_groups)``: e.g. ``Microbatch.sources``)
    the sum also gives the float32 loss summed per group ``[n_groups]`` (detached), third.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = make_norm(cfg.dim, cfg.norm_eps, cfg.norm_offset)
        self.output = None if cfg.tie_embeddings else OutputLayer(cfg.dim, cfg.vocab_size)
        self.loss_chunk = 0  # tokens of logits at a time in the loss (0: all at once)

    def residual_stream(self, tokens: Tensor, positions: Tensor, layout: SequenceLayout | None = None) -> Tensor:
        """The last block's output [B, S, dim] (before the final norm)."""
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        ropes = rope_tables_of(self.config, positions)
        h = self.tok_embeddings.lookup(tokens)
        if self.config.embed_scale:  # Gemma: sqrt(dim), rounded to the embedding's dtype
            h = h * torch.tensor(self.config.dim**0.5, dtype=h.dtype)
        return self.run_layers(h, ropes, layout)

    def run_layers(self, h: Tensor, ropes: Ropes, layout: SequenceLayout | None) -> Tensor:
        """The blocks in turn, each with its RoPE table from ``ropes`` (``loongtrain.apply``
        runs spans of them in one checkpoint for ``memory.activation_checkpoint_span``)."""
        for layer in self.layers:
            h = layer(h, ropes, layout)
        return h

    def hidden_states(self, tokens: Tensor, positions: Tensor, layout: SequenceLayout | None = None) -> Tensor:
        """The final norm's output [B, S, dim]: what the output layer turns into logits."""
        return self.norm(self.residual_stream(tokens, positions, layout))

    @property
    def output_weight(self) -> Tensor:
        """The output layer's weight [vocab, dim] (the embedding's when tied)."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor,
        layout: SequenceLayout | None = None,
        labels: Tensor | None = None,
        reduction: str = "sum",
        groups: Tensor | None = None,
        n_groups: int = 0,
    ) -> Tensor | tuple[Tensor, ...]:
        # the output layer applies the final norm (the chunked training loss: chunk by chunk)
        x = self.residual_stream(tokens, positions, layout)
        if self.output is None:  # tied: the embedding's matrix (and its gradient sink)
            embedding = self.tok_embeddings
            return lm_head(
                x, embedding.weight, labels, reduction, self.loss_chunk, embedding.sink, self.norm, groups, n_groups
            )
        return self.output.head(x, labels, reduction, self.loss_chunk, self.norm, groups, n_groups)


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_value(cfg: ModelConfig, name: str, shape: torch.Size, seed: int, device: torch.device) -> Tensor:
    """The full initial value of parameter ``name``: a function of (seed, name) only.

    Norm weights are ones, biases zeros; the residual-branch outputs (``wo``, ``w2``) use a std scaled
    by ``1/sqrt(2 * n_layers)``; everything else ``N(0, init_std)``. Independent of how
    the model is sharded, so every layout starts from the same weights.
    """
    if name.endswith("norm.weight"):  # (1 + weight) norms start at 0
        return (torch.zeros if cfg.norm_offset else torch.ones)(shape, device=device)
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
