"""Hugging Face configs <-> ``ModelConfig`` for the supported families.

Import reads ``config.json`` through transformers' own config classes (so defaults and
legacy keys such as ``rope_scaling`` mean what they mean to transformers) and refuses,
with the fix, whatever the loongtrain model would compute differently (partial rotary, other
RoPE types, an output-projection bias, dropout, another activation, softcapping, attention
sinks, chunked attention, a ``layer_types`` entry other than full or sliding attention). A
sliding window on every layer (Mistral's ``sliding_window``, Qwen's ``use_sliding_window`` with
``max_window_layers = 0``) becomes ``ModelConfig.sliding_window``; a window on some layers
(``layer_types``: Qwen's ``max_window_layers``, SmolLM3) or layers without RoPE (SmolLM3's
``no_rope_layers``) become ``ModelConfig.layer_kinds``. Export writes the config back as a
plain dict for those classes.
"""

from __future__ import annotations

import math

from loongtrain.hf.folder import HFFormatError
from loongtrain.model.config import LayerKind, ModelConfig, RopeScaling

# model_type -> what the family adds to Llama
FAMILIES: dict[str, dict] = {
    "llama": {"architecture": "LlamaForCausalLM"},
    "mistral": {"architecture": "MistralForCausalLM"},
    "qwen2": {"architecture": "Qwen2ForCausalLM", "qkv_bias": True},
    "qwen3": {"architecture": "Qwen3ForCausalLM", "qk_norm": True},
    "smollm3": {"architecture": "SmolLM3ForCausalLM"},  # Llama with no_rope_layers (and layer_types)
    # norms after attention and the MLP (none before), q/k norms over the whole projections, a RoPE per layer type
    "olmo3": {"architecture": "Olmo3ForCausalLM", "qk_norm": True, "qk_norm_scope": "projection",
              "norm_placement": "post"},
    # Gemma 3 text: (1 + weight) norms before and after attention and the MLP, GeGLU (tanh GELU), q/k norms per
    # head, query_pre_attn_scalar, the embedding scaled by sqrt(dim), a RoPE per layer type
    "gemma3_text": {"architecture": "Gemma3ForCausalLM", "qk_norm": True, "norm_placement": "sandwich",
                    "norm_offset": True, "activation": "gelu_tanh", "embed_scale": True},
}  # fmt: skip
#: families whose ``rope_parameters`` hold one RoPE per layer type
ROPE_PER_LAYER_TYPE = ("olmo3", "gemma3_text")
#: ``ModelConfig`` fields a family sets, and their values where it does not
FAMILY_FIELDS = {"qkv_bias": False, "qk_norm": False, "qk_norm_scope": "head", "norm_placement": "pre",
                 "norm_offset": False, "activation": "silu", "embed_scale": False}  # fmt: skip
#: transformers' activation names -> ``ModelConfig.activation``
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
#: families whose ``sliding_window`` counts only with ``use_sliding_window``
WINDOW_SWITCHED = ("qwen2", "qwen3", "smollm3")
#: transformers' ``layer_types`` entries the loongtrain model computes
LAYER_TYPES = ("full_attention", "sliding_attention")
#: config keys of computations the loongtrain model does not do, refused when set
UNSUPPORTED_FEATURES = {
    "attn_logit_softcapping": "softcapping of the attention scores",
    "final_logit_softcapping": "softcapping of the logits",
    "attention_chunk_size": "chunked attention",
    "use_sinks": "attention sinks",
    "use_bidirectional_attention": "bidirectional attention",
}


def require_transformers():
    """The ``transformers`` module, or a clear error saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise HFFormatError(
            "Hugging Face import/export needs the `transformers` and `safetensors` packages: "
            "pip install 'loongtrain[hf]'"
        ) from None
    return transformers


def check_model_type(raw: dict, where: str) -> str:
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise HFFormatError(
            f"{where}: model_type {model_type!r} is not supported; supported model types: {sorted(FAMILIES)}"
        )
    return model_type


def load_hf_config(folder: str, raw: dict):
    """transformers' config object for ``folder``'s parsed ``config.json`` ``raw`` (its own
    config class, as ``AutoConfig`` would pick; no file read, no remote code)."""
    model_type = check_model_type(raw, f"{folder}/config.json")
    transformers = require_transformers()
    try:
        return transformers.CONFIG_MAPPING[model_type].from_dict(raw)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds
        raise HFFormatError(f"transformers cannot read {folder}/config.json: {e}") from None


def _yarn_attention_factor(params: dict, factor: float) -> float | None:
    """transformers' yarn attention factor when ``mscale``/``mscale_all_dim`` set it; else None."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:

        def get_mscale(scale: float, m: float) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return None


def rope_from_hf(params: dict, max_positions: int, where: str) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from a standardised transformers ``rope_parameters`` dict."""
    kind = params.get("rope_type", "default")
    theta = float(params["rope_theta"])
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise HFFormatError(f"{where}: partial_rotary_factor={params['partial_rotary_factor']} is not supported")
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3", float(params["factor"]), int(params["original_max_position_embeddings"]),
            low_freq_factor=float(params["low_freq_factor"]), high_freq_factor=float(params["high_freq_factor"]),
        )  # fmt: skip
    if kind == "yarn":
        original = int(params["original_max_position_embeddings"])
        factor = params.get("factor")
        factor = float(factor) if factor is not None else max_positions / original
        return theta, RopeScaling(
            "yarn", factor, original, beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1), attention_factor=_yarn_attention_factor(params, factor),
            truncate=bool(params.get("truncate", True)),
        )  # fmt: skip
    raise HFFormatError(
        f"{where}: rope_type {kind!r} is not supported; supported: default, linear, llama3, yarn "
        "(override it with model.rope_scaling)"
    )


def model_config_from_hf(hf) -> ModelConfig:
    """The ``ModelConfig`` of a transformers config of a supported family; raises HFFormatError."""
    where = f"config.json (model_type {hf.model_type!r})"
    family = FAMILIES[hf.model_type]

    def refuse(what: str, fix: str) -> None:
        raise HFFormatError(f"{where}: {what} is not supported by the loongtrain model; {fix}")

    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    if ACTIVATIONS.get(act) != family.get("activation", "silu"):
        refuse(f"hidden_act={act!r}", f"{hf.model_type} computes {family.get('activation', 'silu')}")
    if getattr(hf, "mlp_bias", False):
        refuse("mlp_bias=true", "only bias-free MLPs are")
    if getattr(hf, "attention_bias", False):
        refuse("attention_bias=true (biases on every projection, o_proj included)", "only q/k/v biases (Qwen2) are")
    if getattr(hf, "attention_dropout", 0.0):
        refuse(f"attention_dropout={hf.attention_dropout}", "set it to 0.0 in config.json")
    for key, what in UNSUPPORTED_FEATURES.items():
        if getattr(hf, key, None):
            refuse(f"{key}={getattr(hf, key)!r} ({what})", f"set {key} to null in config.json or use another model")
    max_positions = int(getattr(hf, "max_position_embeddings", 0) or 0)
    window, kinds = layer_kinds_from_hf(hf, max_positions, refuse)
    params = dict(hf.rope_parameters)
    if hf.model_type in ROPE_PER_LAYER_TYPE:  # the full layers' RoPE is the model's; the sliding ones' their own
        theta, scaling = rope_from_hf(dict(params["full_attention"]), max_positions, where)
        local = rope_from_hf(dict(params["sliding_attention"]), max_positions, where)
        if local != (theta, scaling):
            kinds = kinds or tuple(LayerKind(window) for _ in range(hf.num_hidden_layers))
            kinds = tuple(LayerKind(k.sliding_window, k.rope, *local) if k.sliding_window else k for k in kinds)
            window = 0
    else:
        theta, scaling = rope_from_hf(params, max_positions, where)
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    try:
        return ModelConfig(
            vocab_size=hf.vocab_size, dim=hf.hidden_size, n_layers=hf.num_hidden_layers, n_heads=heads,
            n_kv_heads=hf.num_key_value_heads or heads, ffn_dim=hf.intermediate_size, norm_eps=float(hf.rms_norm_eps),
            rope_theta=theta, tie_embeddings=bool(hf.tie_word_embeddings),
            head_dim_override=0 if head_dim * heads == hf.hidden_size else head_dim,
            rope_scaling=scaling, max_positions=max_positions, sliding_window=window, layer_kinds=kinds,
            attention_scalar=float(getattr(hf, "query_pre_attn_scalar", 0) or 0),
            **{key: family.get(key, default) for key, default in FAMILY_FIELDS.items()},
        )  # fmt: skip
    except ValueError as e:
        raise HFFormatError(f"{where}: {e}") from None


def layer_kinds_from_hf(hf, max_positions: int, refuse) -> tuple[int, tuple[LayerKind, ...]]:
    """``(sliding_window, layer_kinds)`` of a transformers config: one window on every layer
    (``layer_kinds`` empty) or each layer's kind from ``layer_types`` and ``no_rope_layers``."""
    window = getattr(hf, "sliding_window", None)
    if hf.model_type in WINDOW_SWITCHED and not getattr(hf, "use_sliding_window", False):
        window = None  # transformers ignores the value unless use_sliding_window is set
    n = hf.num_hidden_layers
    layer_types = list(getattr(hf, "layer_types", None) or [])
    unknown = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if unknown:
        refuse(f"layer_types entries {unknown}", f"loongtrain computes {list(LAYER_TYPES)}")
    if layer_types and len(layer_types) != n:
        refuse(f"{len(layer_types)} layer_types for {n} layers", "give one entry per layer")
    if window is not None and max_positions and window > max_positions:
        refuse(
            f"sliding_window={window} larger than max_position_embeddings={max_positions}",
            "lower sliding_window (a window longer than the positions is full attention: set it to null)",
        )
    windows = [int(window or 0) if t == "sliding_attention" else 0 for t in layer_types] or [int(window or 0)] * n
    ropes = [bool(r) for r in getattr(hf, "no_rope_layers", None) or [1] * n]
    if len(ropes) != n:
        refuse(f"{len(ropes)} no_rope_layers entries for {n} layers", "give one entry per layer")
    if len(set(windows)) == 1 and all(ropes):
        return windows[0], ()
    return 0, tuple(LayerKind(w, rope=r) for w, r in zip(windows, ropes))


def family_of(cfg: ModelConfig) -> str:
    """The HF model_type that computes what ``cfg`` computes (for export without a source)."""
    if cfg.qkv_bias and cfg.qk_norm:
        raise HFFormatError("no supported Hugging Face family has both q/k/v biases and q/k norms")
    if cfg.norm_placement == "post":
        return "olmo3"
    if cfg.norm_placement == "sandwich":
        return "gemma3_text"
    if cfg.layer_kinds and not (cfg.qkv_bias or cfg.qk_norm):
        return "smollm3"  # Llama with layer_types and no_rope_layers
    return "qwen2" if cfg.qkv_bias else "qwen3" if cfg.qk_norm else "mistral" if cfg.sliding_window else "llama"


def rope_to_hf(cfg: ModelConfig, theta: float = 0.0, scaling: RopeScaling | None | str = "model") -> dict:
    """transformers' ``rope_parameters`` for ``cfg``'s RoPE (or for base ``theta`` with ``scaling``)."""
    s = cfg.rope_scaling if scaling == "model" else scaling
    theta = theta or cfg.rope_theta
    if s is None:
        return {"rope_type": "default", "rope_theta": theta}
    params = {"rope_type": s.kind, "rope_theta": theta, "factor": s.factor}
    if s.kind == "llama3":
        params.update(
            original_max_position_embeddings=s.original_max_positions,
            low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
        )  # fmt: skip
    elif s.kind == "yarn":
        params.update(
            original_max_position_embeddings=s.original_max_positions, beta_fast=s.beta_fast,
            beta_slow=s.beta_slow, truncate=s.truncate,
        )  # fmt: skip
        if s.attention_factor is not None:
            params["attention_factor"] = s.attention_factor
    return params


def export_family(cfg: ModelConfig, source_type: str) -> tuple[str, str | None]:
    """The model_type an export writes for a model imported as ``source_type``, and why it
    differs from the source's (None: it does not)."""
    if source_type == "llama" and cfg.sliding_window:
        return "mistral", (
            f"the run trained with a sliding window of {cfg.sliding_window} tokens and Llama's config has no sliding "
            "window (Mistral is Llama with one)"
        )
    if source_type in ("llama", "mistral") and cfg.layer_kinds:
        return "smollm3", (
            f"the run trained with layer kinds ({', '.join(k.name for k in cfg.kinds)}) and {source_type}'s config "
            "has none (SmolLM3 is Llama with layer_types and no_rope_layers)"
        )
    return source_type, None


def layer_kinds_to_hf(cfg: ModelConfig, model_type: str) -> dict:
    """The config keys of ``cfg``'s layer kinds for ``model_type``: ``layer_types`` and one
    ``sliding_window`` (and SmolLM3's ``no_rope_layers``); raises what the family cannot state."""
    kinds = cfg.kinds
    windows = sorted({k.sliding_window for k in kinds} - {0})
    if len(windows) > 1:
        raise HFFormatError(f"the model's layers have several windows {windows}; {model_type} states one")
    own = {(k.rope_theta, k.rope_scaling) for k in kinds if k.rope} - {(cfg.rope_theta, cfg.rope_scaling)}
    by_type = model_type in ROPE_PER_LAYER_TYPE
    own_layers = [k for k in kinds if k.rope and (k.rope_theta, k.rope_scaling) in own]
    if own and not (by_type and len(own) == 1 and all(k.sliding_window for k in own_layers)):
        raise HFFormatError(f"the model's layers have RoPE bases of their own; {model_type} states one")
    nope = [i for i, k in enumerate(kinds) if not k.rope]
    if nope and model_type != "smollm3":
        raise HFFormatError(f"layers {nope} apply no RoPE; {model_type} has no such layers (export as smollm3)")
    out = {
        "sliding_window": windows[0] if windows else None,
        "layer_types": ["sliding_attention" if k.sliding_window else "full_attention" for k in kinds],
    }
    if model_type in WINDOW_SWITCHED:
        out["use_sliding_window"] = bool(windows)
    if model_type == "smollm3":
        out["no_rope_layers"] = [int(k.rope) for k in kinds]
    if by_type:
        (theta, scaling), full = (own.pop() if own else (cfg.rope_theta, cfg.rope_scaling)), rope_to_hf(cfg)
        out["rope_parameters"] = {"full_attention": full, "sliding_attention": rope_to_hf(cfg, theta, scaling)}
    return out


# keys of a source config.json that the export rewrites from the trained model's config
_REWRITTEN = ("rope_scaling", "rope_theta", "torch_dtype", "partial_rotary_factor")


def hf_config_dict(cfg: ModelConfig, source: dict | None, dtype: str, max_positions: int) -> dict:
    """The config.json content for ``cfg``: the source's keys (token ids, ...) with every
    shape and RoPE field taken from ``cfg``."""
    if source is not None:
        model_type, _ = export_family(cfg, check_model_type(source, "the run's source config.json"))
        out = {k: v for k, v in source.items() if k not in _REWRITTEN}
        out["model_type"] = model_type
    else:
        model_type = family_of(cfg)
        out = {"model_type": model_type}
    family = FAMILIES[model_type]
    mine = {key: getattr(cfg, key) for key in FAMILY_FIELDS}
    theirs = {key: family.get(key, default) for key, default in FAMILY_FIELDS.items()}
    if mine != theirs:
        differ = {key: mine[key] for key in mine if mine[key] != theirs[key]}
        raise HFFormatError(f"the model ({differ}) is not a {model_type} model")
    out.update(
        architectures=[family["architecture"]], vocab_size=cfg.vocab_size, hidden_size=cfg.dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        intermediate_size=cfg.ffn_dim, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, max_position_embeddings=max_positions,
        rope_parameters=rope_to_hf(cfg), hidden_act="silu", dtype=dtype,
    )  # fmt: skip
    if model_type == "gemma3_text":
        del out["hidden_act"]
        scalar = cfg.attention_scalar or cfg.head_dim
        scalar = int(scalar) if scalar % 1 == 0 else scalar  # transformers' config takes an int
        out.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar)
    if cfg.head_dim_override or "head_dim" in out or model_type == "qwen3":  # Qwen3's default is not dim/heads
        out["head_dim"] = cfg.head_dim
    if model_type in ("qwen2", "qwen3", "mistral", "smollm3"):
        out["sliding_window"] = cfg.sliding_window or None
        out.pop("layer_types", None)
        out.pop("no_rope_layers", None)
    if model_type in WINDOW_SWITCHED:
        out["use_sliding_window"] = bool(cfg.sliding_window)
    if model_type in ("qwen2", "qwen3"):
        out["max_window_layers"] = 0  # the window (if any) on every layer, unless layer_types says otherwise
    if model_type in ROPE_PER_LAYER_TYPE:
        out["rope_parameters"] = {"full_attention": rope_to_hf(cfg), "sliding_attention": rope_to_hf(cfg)}
        out["sliding_window"] = cfg.sliding_window or None
        out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in cfg.windows]
    if cfg.layer_kinds:
        out.update(layer_kinds_to_hf(cfg, model_type))
    elif model_type == "smollm3":
        out["no_rope_layers"] = [1] * cfg.n_layers
    return out
