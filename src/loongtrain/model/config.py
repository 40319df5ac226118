"""Model shapes: ``ModelConfig`` and the named presets."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig: {name}={value!r} must be a positive integer")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"ModelConfig: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"ModelConfig: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads} (GQA)"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig: head_dim={self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def layer_matmul_params(self) -> int:
        """Weights of one layer's matmuls: the q, k, v, o projections and the SwiGLU MLP."""
        d, q, kv = self.dim, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return d * q + 2 * d * kv + q * d + 3 * d * self.ffn_dim

    def layer_params(self) -> int:
        """All parameters of one layer (its matmuls and its two RMSNorm weights)."""
        return self.layer_matmul_params() + 2 * self.dim

    def num_params(self) -> int:
        """Parameter count (embeddings included; the output matrix once if tied)."""
        embed = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * self.layer_params() + embed + self.dim

    def flops_per_token(self, seq_len: int, *, causal: bool = True) -> float:
        """Model FLOPs of one training token in a sequence of ``seq_len`` (forward + backward
        = 3x forward; recomputation not counted). The one definition of model FLOPs: the
        trainer's MFU and the planner's predicted MFU both use it.

        Per layer and token the forward does ``2 * layer_matmul_params()`` in the
        projections and MLP and ``2 * 2 * H * head_dim * ctx`` in attention (scores and the
        weighted sum), where ``ctx`` is the number of keys a query sees: ``(S + 1) / 2`` on
        average under a causal mask, ``S`` without one. Plus ``2 * dim * vocab`` for the
        output layer.
        """
        ctx = (seq_len + 1) / 2 if causal else seq_len
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
}


def model_config(name: str, **overrides) -> ModelConfig:
    """The preset ``name`` with fields replaced by ``overrides``."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) {unknown}; known fields: {sorted(known)}")
    return replace(PRESETS[name], **overrides)
