"""Model shapes: ``ModelConfig`` and the named presets."""

from __future__ import annotations

import functools
from dataclasses import MISSING, dataclass, fields, replace

from loongtrain.options import option

#: vocabulary rows per product where the chunked loss (:mod:`loongtrain.model.loss`) makes a
#: product a vocabulary slice at a time: a low-precision chunk's ``dL/dW`` added to the float32
#: accumulator, and every product with a float32 master matrix read in the compute dtype (one
#: ``[rows, dim]`` cast at a time); the planner's memory model counts one slice. 0: sized by
#: :data:`VOCAB_SLICE_BYTES` (:func:`vocab_slice_rows`; tests set a count to run many slices)
VOCAB_SLICE = 0
#: the bound on one vocabulary slice's temporaries: its ``[rows, dim]`` product or cast in the
#: compute dtype beside its float32 sum
VOCAB_SLICE_BYTES = 512 * 2**20
#: slices are whole multiples of this many rows (but the last), at least one
VOCAB_SLICE_MULTIPLE = 1024


def vocab_slice_rows(vocab: int, dim: int, dtype_bytes: int) -> int:
    """Vocabulary rows per slice: :data:`VOCAB_SLICE` if set, else the most whole
    :data:`VOCAB_SLICE_MULTIPLE` s whose ``(4 + dtype_bytes) * dim`` bytes a row fit
    :data:`VOCAB_SLICE_BYTES` (the whole vocabulary where it fits: one product, few launches)."""
    if VOCAB_SLICE:
        return min(VOCAB_SLICE, vocab)
    fit = VOCAB_SLICE_BYTES // ((4 + dtype_bytes) * dim) // VOCAB_SLICE_MULTIPLE * VOCAB_SLICE_MULTIPLE
    return min(vocab, max(VOCAB_SLICE_MULTIPLE, fit))


#: the bound on one token tile's temporaries (bytes) where the norms, RoPE and the q/k/v
#: projections run over tiles of the sequence (:mod:`loongtrain.model.norm`)
TILE_BYTES = 512 * 2**20
#: one tile's temporaries per token and per element of the tiled rows' width (bf16), measured
#: with ``AllocatorPeak``: the q/k/v projections alone 13.4, a norm 12.0, RoPE 9.9 (forward and
#: backward), and 15.5 in a layer's backward (the slope of one-device peaks, 16K to 32K tokens,
#: ``tests/test_planner_memory.py``); priced at 16 (16K-token tiles at width 2048)
TILE_TEMP_BYTES = 16
#: tiles are whole multiples of this many tokens, at least one
TILE_MULTIPLE = 1024


def token_tile(width: int) -> int:
    """Tokens per tile of rows ``width`` wide: the most whole :data:`TILE_MULTIPLE` s whose
    temporaries fit :data:`TILE_BYTES` (at least one multiple)."""
    if width < 1:
        raise ValueError(f"token_tile: width={width} must be positive (the elements of one token's row)")
    fit = TILE_BYTES // (TILE_TEMP_BYTES * width)
    return max(TILE_MULTIPLE, fit // TILE_MULTIPLE * TILE_MULTIPLE)


ROPE_SCALINGS: tuple[str, ...] = ("linear", "llama3", "yarn")
NORM_PLACEMENTS: tuple[str, ...] = ("pre", "post", "sandwich")
ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling for a longer context, as transformers' ``rope_parameters`` define it.

    ``linear``: every frequency divided by ``factor``. ``llama3``: low frequencies divided
    by ``factor``, high ones kept, a smooth ramp between (``low_freq_factor``,
    ``high_freq_factor``). ``yarn``: a ramp between interpolated and original frequencies
    over the dimensions set by ``beta_fast``/``beta_slow``, and cos/sin multiplied by
    ``attention_factor`` (``None``: ``0.1 * ln(factor) + 1``).
    """

    kind: str = option(MISSING, "linear, llama3 or yarn", choices=ROPE_SCALINGS)
    factor: float = option(MISSING, "context growth factor (e.g. 4 for 4x)")
    original_max_positions: int = option(
        0, "llama3/yarn: pretraining context length (0: the imported model's max_position_embeddings)",
        bound="non_negative",
    )  # fmt: skip
    low_freq_factor: float = option(1.0, "llama3: low_freq_factor")
    high_freq_factor: float = option(4.0, "llama3: high_freq_factor")
    beta_fast: float = option(32.0, "yarn: beta_fast")
    beta_slow: float = option(1.0, "yarn: beta_slow")
    attention_factor: float | None = option(
        None, "yarn: cos/sin multiplier (0 in a config, None here: 0.1 * ln(factor) + 1)", bound="positive",
        none_as=0.0,
    )  # fmt: skip
    truncate: bool = option(True, "yarn: round the ramp's ends to whole dimensions (transformers' truncate)")

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"RopeScaling: kind={self.kind!r}; choose one of {list(ROPE_SCALINGS)}")
        if not self.factor >= 1.0:
            raise ValueError(f"RopeScaling: factor={self.factor} must be >= 1 (the context grows by this factor)")
        if self.kind != "linear" and self.original_max_positions < 1:
            raise ValueError(
                f"RopeScaling: {self.kind} needs original_max_positions (the pretraining context length), "
                f"got {self.original_max_positions}"
            )
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"RopeScaling: high_freq_factor={self.high_freq_factor} must exceed low_freq_factor="
                f"{self.low_freq_factor} (llama3 scaling interpolates between them)"
            )
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(f"RopeScaling: attention_factor={self.attention_factor} must be positive")


def causal_keys_per_query(seq_len: int, window: int = 0) -> float:
    """Keys a query sees on average in one causal sequence of ``seq_len`` tokens under a sliding
    ``window`` (0: none): ``(S + 1) / 2``, or ``w`` once the sequence is much longer than ``w``."""
    if not window or window >= seq_len:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


@dataclass(frozen=True)
class LayerKind:
    """One layer's attention: full causal or a sliding window, and its RoPE (transformers'
    ``layer_types`` and ``no_rope_layers``; Gemma 3's two RoPE bases).

    ``rope_theta`` 0: the model's base and scaling (which ``extend_context`` changes);
    ``rope_theta`` > 0: this kind's own base with its own ``rope_scaling`` (None: plain).
    """

    sliding_window: int = 0  # token i sees j only if i - j < sliding_window; 0: full causal attention
    rope: bool = True  # False: the layer applies no RoPE (a NoPE layer)
    rope_theta: float = 0.0  # > 0: this kind's own RoPE base; 0: the model's
    rope_scaling: RopeScaling | None = None  # with rope_theta > 0: this kind's own scaling

    def __post_init__(self) -> None:
        w = self.sliding_window
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"LayerKind: sliding_window={w!r} must be 0 (full attention) or positive")
        if not self.rope_theta >= 0:
            raise ValueError(f"LayerKind: rope_theta={self.rope_theta} must be 0 (the model's) or positive")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"LayerKind: rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
        if self.rope_scaling is not None and self.rope_theta == 0:
            raise ValueError("LayerKind: rope_scaling needs this kind's own rope_theta (0 takes the model's RoPE)")

    @property
    def name(self) -> str:
        """A short label: ``full``, ``sliding 512``, with ``nope`` or the kind's own RoPE base."""
        label = f"sliding {self.sliding_window}" if self.sliding_window else "full"
        if not self.rope:
            return f"{label} nope"
        return f"{label} rope {self.rope_theta:g}" if self.rope_theta else label


def layer_kind_of(value) -> LayerKind:
    """A :class:`LayerKind` from itself or its dict (a checkpoint's ``model_shape``, JSON)."""
    if isinstance(value, LayerKind):
        return value
    if not isinstance(value, dict):
        raise TypeError(f"a layer kind must be a LayerKind or a dict of its fields, got {value!r}")
    scaling = value.get("rope_scaling")
    return LayerKind(**{**value, "rope_scaling": RopeScaling(**scaling) if isinstance(scaling, dict) else scaling})


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 176
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    init_std: float = 0.02
    head_dim_override: int = 0  # per-head size when it is not dim // n_heads (e.g. Qwen3); 0: dim // n_heads
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    rope_scaling: RopeScaling | None = None  # context extension of RoPE (None: plain RoPE)
    max_positions: int = 0  # context length the model is meant for (HF max_position_embeddings); 0: unset
    sliding_window: int = 0  # token i sees j only if i - j < sliding_window (Mistral style); 0: no window
    # one LayerKind per layer (its window and RoPE); empty: every layer full (or ``sliding_window``)
    # with the model's RoPE
    layer_kinds: tuple[LayerKind, ...] = ()
    # where a block's norms are: "pre" (before attention and the MLP: Llama), "post" (after
    # them, on their outputs before the residual add, none before: OLMo 2/3) or "sandwich" (both: Gemma 3)
    norm_placement: str = "pre"
    # q/k norm (qk_norm) over each head ("head": Qwen3) or over the whole projection ("projection": OLMo)
    qk_norm_scope: str = "head"
    # Gemma: every RMSNorm scales by (1 + weight) in float32 (weights start at 0)
    norm_offset: bool = False
    # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU with the tanh GELU: Gemma)
    activation: str = "silu"
    # scores scaled by attention_scalar ** -0.5 (Gemma's query_pre_attn_scalar); 0: head_dim ** -0.5
    attention_scalar: float = 0.0
    # the embedding's output multiplied by sqrt(dim) in its dtype (Gemma)
    embed_scale: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig: {name}={value!r} must be a positive integer")
        if isinstance(self.head_dim_override, bool) or self.head_dim_override < 0:
            raise ValueError(f"ModelConfig: head_dim_override={self.head_dim_override!r} must be 0 or positive")
        if self.head_dim_override == 0 and self.dim % self.n_heads != 0:
            raise ValueError(f"ModelConfig: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"ModelConfig: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads} (GQA)"
            )
        if self.max_positions < 0:
            raise ValueError(f"ModelConfig: max_positions={self.max_positions} must not be negative")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"ModelConfig: rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
        if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) or self.sliding_window < 0:
            raise ValueError(f"ModelConfig: sliding_window={self.sliding_window!r} must be 0 (none) or positive")
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig: head_dim={self.head_dim} must be even for RoPE")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"ModelConfig: norm_placement={self.norm_placement!r}; choose one of {NORM_PLACEMENTS}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"ModelConfig: activation={self.activation!r}; choose one of {ACTIVATIONS}")
        if not self.attention_scalar >= 0:
            raise ValueError(f"ModelConfig: attention_scalar={self.attention_scalar} must be 0 (head_dim) or positive")
        if self.qk_norm_scope not in ("head", "projection"):
            raise ValueError(f"ModelConfig: qk_norm_scope={self.qk_norm_scope!r}; choose 'head' or 'projection'")
        if self.layer_kinds:
            if not isinstance(self.layer_kinds, tuple):
                object.__setattr__(self, "layer_kinds", tuple(self.layer_kinds))
            object.__setattr__(self, "layer_kinds", tuple(layer_kind_of(k) for k in self.layer_kinds))
            if len(self.layer_kinds) != self.n_layers:
                raise ValueError(
                    f"ModelConfig: {len(self.layer_kinds)} layer_kinds for n_layers={self.n_layers}; give one per layer"
                )
            if self.sliding_window:
                raise ValueError(
                    f"ModelConfig: sliding_window={self.sliding_window} and layer_kinds both set; give each layer's "
                    "window in its LayerKind (sliding_window is the one window of every layer)"
                )
        longest = max((k.sliding_window for k in self.layer_kinds), default=0)
        if self.max_positions and longest > self.max_positions:
            raise ValueError(
                f"ModelConfig: a sliding window of {longest} tokens is larger than the model's positions "
                f"(max_positions={self.max_positions}); no token could reach its end"
            )

    def layer_kind(self, index: int) -> LayerKind:
        """Layer ``index``'s kind, resolved: its window (``sliding_window`` when no kinds are
        given), and its RoPE base and scaling (the model's unless the kind has its own)."""
        return self.kinds[index]

    @functools.cached_property
    def kinds(self) -> tuple[LayerKind, ...]:
        """Every layer's resolved :meth:`layer_kind`."""
        given = self.layer_kinds or (LayerKind(self.sliding_window),) * self.n_layers
        return tuple(
            k if k.rope_theta else replace(k, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling) for k in given
        )

    @property
    def pre_norm_blocks(self) -> bool:
        """Whether the blocks are Llama's (norms before attention and the MLP, q/k norms per head):
        what the attention over head groups and the tiled MLP compute (``memory.head_groups``,
        ``memory.mlp_tile``)."""
        llama = self.norm_placement == "pre" and not self.norm_offset and self.activation == "silu"
        return llama and not self.attention_scalar and (not self.qk_norm or self.qk_norm_scope == "head")

    def with_window(self, window: int) -> ModelConfig:
        """This model with sliding window ``window``: on every layer, or with layer kinds on
        each sliding layer (the full layers stay full)."""
        if not self.layer_kinds:
            return replace(self, sliding_window=window)
        kinds = tuple(replace(k, sliding_window=window) if k.sliding_window else k for k in self.layer_kinds)
        return replace(self, layer_kinds=kinds)

    def with_layer_pattern(self, layer_types: str = "", nope_every: int = 0) -> ModelConfig:
        """This model with each layer's kind set from a pattern: ``layer_types`` a comma-separated
        list of ``full`` / ``sliding`` repeated over the layers (the sliding layers take the
        model's window), and every ``nope_every``-th layer without RoPE (SmolLM3, Llama 4: 4).
        "" and 0 keep the model's kinds. Raises ValueError naming a bad entry."""
        n, window = self.n_layers, max(self.windows, default=0)
        kinds = list(self.kinds)
        if layer_types:
            names = [t.strip() for t in layer_types.split(",")]
            unknown = sorted({t for t in names if t not in ("full", "sliding")})
            if unknown:
                raise ValueError(f"model.layer_types entries {unknown}: each is full or sliding (comma-separated)")
            if "sliding" in names and not window:
                raise ValueError(
                    "model.layer_types has sliding layers but the model no window: set model.sliding_window"
                )
            kinds = [LayerKind(window if names[i % len(names)] == "sliding" else 0) for i in range(n)]
        if nope_every:
            kinds = [replace(k, rope=False) if (i + 1) % nope_every == 0 else k for i, k in enumerate(kinds)]
        return replace(self, sliding_window=0, layer_kinds=tuple(kinds))

    @property
    def windows(self) -> tuple[int, ...]:
        """Each layer's sliding window (0: full attention)."""
        return tuple(k.sliding_window for k in self.kinds)

    @property
    def uniform(self) -> bool:
        """Whether every layer has the same window and RoPE (one kind)."""
        return len(set(self.kinds)) == 1

    @functools.cached_property  # the fields are frozen; the planner reads it hundreds of thousands of times
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.n_heads

    def qkv_params(self) -> int:
        """Weights of one layer's q, k and v projections."""
        return self.dim * (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    def layer_matmul_params(self) -> int:
        """Weights of one layer's matmuls: the q, k, v, o projections and the SwiGLU MLP."""
        return self._counts[0]

    def layer_params(self) -> int:
        """All parameters of one layer: its matmuls, its two RMSNorm weights, and the q/k/v
        biases (``qkv_bias``) and per-head q/k norms (``qk_norm``) when the model has them."""
        return self._counts[1]

    @functools.cached_property
    def _counts(self) -> tuple[int, int]:
        """``(layer_matmul_params, layer_params)``, counted once (the fields are frozen)."""
        d, q = self.dim, self.n_heads * self.head_dim
        kv = self.n_kv_heads * self.head_dim
        matmuls = self.qkv_params() + q * d + 3 * d * self.ffn_dim
        qk_norm = (q + kv) if self.qk_norm_scope == "projection" else 2 * self.head_dim
        extras = (q + 2 * kv) * self.qkv_bias + qk_norm * self.qk_norm
        norms = (4 if self.norm_placement == "sandwich" else 2) * self.dim
        return matmuls, matmuls + norms + extras

    def num_params(self) -> int:
        """Parameter count (embeddings included; the output matrix once if tied)."""
        embed = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * self.layer_params() + embed + self.dim

    def flops_per_token(self, seq_len: int, *, causal: bool = True, keys_per_query: float | None = None) -> float:
        """Model FLOPs of one training token in a sequence of ``seq_len`` (forward + backward
        = 3x forward; recomputation not counted). The one definition of model FLOPs: the
        trainer's MFU and the planner's predicted MFU both use it.

        Per layer and token the forward does ``2 * layer_matmul_params()`` in the
        projections and MLP and ``2 * 2 * H * head_dim * ctx`` in attention (scores and the
        weighted sum), where ``ctx`` is the number of keys a query sees: ``(S + 1) / 2`` on
        average under a causal mask, ``S`` without one, or ``keys_per_query`` when given (the
        mean over a batch's tokens under its document masks and sliding window: what the
        kernels actually compute). Plus ``2 * dim * vocab`` for the output layer.
        """
        if keys_per_query is not None:
            ctx = keys_per_query
        elif causal:  # each layer's own window (layer kinds): S * w, not S^2 / 2, for a sliding layer
            ctx = sum(causal_keys_per_query(seq_len, w) for w in self.windows) / self.n_layers
        else:
            ctx = seq_len
        attention = 4 * self.n_heads * self.head_dim * ctx
        forward = self.n_layers * (2 * self.layer_matmul_params() + attention) + 2 * self.dim * self.vocab_size
        return 3.0 * forward


PRESETS: dict[str, ModelConfig] = {
    # tiny: trains in seconds on CPU, GQA with 2 query heads per KV head
    "debug": ModelConfig(),
    # LLaMA-2-7B shape, multi-head attention
    "7b-mha": ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008),
    # LLaMA-2-7B shape with 8 KV heads
    "7b-gqa": ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=11008),
    # LLaMA-2-13B shape
    "13b": ModelConfig(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824),
    # Llama-3-8B shape
    "llama3-8b": ModelConfig(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, rope_theta=500000.0
    ),
    # OLMo 3 7B (allenai/Olmo-3-1025-7B's config): norms after attention and the MLP, q/k norms over the
    # projections, three sliding layers (window 4096) for each full one
    "olmo3-7b": ModelConfig(
        vocab_size=100278,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        ffn_dim=11008,
        norm_eps=1e-6,
        rope_theta=500000.0,
        max_positions=65536,
        qk_norm=True,
        qk_norm_scope="projection",
        norm_placement="post",
        layer_kinds=tuple(LayerKind(0 if (i + 1) % 4 == 0 else 4096) for i in range(32)),
    ),
    # Gemma 3 4B (text; google/gemma-3-4b-pt's text config): (1 + weight) norms before and after attention
    # and the MLP, GeGLU, q/k norms, head_dim 256, five sliding layers (window 1024, RoPE base 10K) for each
    # full one (base 1M, linear x8), tied embeddings scaled by sqrt(dim)
    "gemma3-4b": ModelConfig(
        vocab_size=262208,
        dim=2560,
        n_layers=34,
        n_heads=8,
        n_kv_heads=4,
        ffn_dim=10240,
        norm_eps=1e-6,
        head_dim_override=256,
        rope_theta=1e6,
        rope_scaling=RopeScaling("linear", 8.0),
        max_positions=131072,
        tie_embeddings=True,
        qk_norm=True,
        norm_placement="sandwich",
        norm_offset=True,
        activation="gelu_tanh",
        attention_scalar=256.0,
        embed_scale=True,
        layer_kinds=tuple(LayerKind(0) if (i + 1) % 6 == 0 else LayerKind(1024, rope_theta=10000.0) for i in range(34)),
    ),
}


def config_of_shape(shape: dict) -> ModelConfig:
    """The :class:`ModelConfig` of its fields as a dict (``dataclasses.asdict`` or its JSON: a
    checkpoint's ``model_shape``), its RoPE scaling and layer kinds made again."""
    scaling = shape.get("rope_scaling")
    kinds = tuple(layer_kind_of(k) for k in shape.get("layer_kinds") or ())
    return ModelConfig(**{**shape, "rope_scaling": RopeScaling(**scaling) if scaling else None, "layer_kinds": kinds})


def model_config(name: str, **overrides) -> ModelConfig:
    """The preset ``name`` with fields replaced by ``overrides``."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) {unknown}; known fields: {sorted(known)}")
    window = overrides.pop("sliding_window", None)
    cfg = replace(PRESETS[name], **overrides)
    return cfg if window is None else cfg.with_window(window)


def extend_context(
    cfg: ModelConfig, *, rope_theta: float = 0.0, scaling: str = "keep", max_positions: int = 0, **rope
) -> ModelConfig:
    """``cfg`` with its RoPE changed for a longer context (the ``[model]`` rope keys).

    ``rope_theta`` > 0 replaces the base. ``scaling``: ``keep`` (``cfg``'s), ``none``, or a
    :class:`RopeScaling` kind (``linear`` / ``llama3`` / ``yarn``) made with the other
    RopeScaling fields in ``rope`` (``factor`` and what the kind reads);
    ``original_max_positions`` 0 or absent means ``cfg.max_positions`` (the context the model
    was trained for). ``max_positions`` > 0 sets the new context length, else it becomes
    original x factor when scaling changes.
    """
    theta = rope_theta or cfg.rope_theta
    if scaling == "keep":
        return replace(cfg, rope_theta=theta, max_positions=max_positions or cfg.max_positions)
    if scaling == "none":
        return replace(cfg, rope_theta=theta, rope_scaling=None, max_positions=max_positions or cfg.max_positions)
    original = rope.pop("original_max_positions", 0) or cfg.max_positions
    if scaling != "linear" and original < 1:
        raise ValueError(
            f"rope scaling {scaling!r} needs the pretraining context length: set model.rope_original_max_positions"
        )
    factor = float(rope.pop("factor", 1.0))
    scaled = RopeScaling(scaling, factor, original if scaling != "linear" else 0, **rope)
    return replace(cfg, rope_theta=theta, rope_scaling=scaled, max_positions=max_positions or int(original * factor))
