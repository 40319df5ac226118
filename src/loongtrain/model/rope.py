"""RoPE inverse frequencies, plain or scaled for a longer context.

The scaled variants follow transformers' ``modeling_rope_utils`` (``linear``, ``llama3``,
``yarn``) operation for operation, so the same config gives the same cos/sin tables
(the tests compare them with transformers' own functions). Frequency ``i`` rotates the
pair of head dimensions ``(2i, 2i+1)`` in this model (see ``apply_rope``).
"""

from __future__ import annotations

import math

import torch

from loongtrain.model.config import RopeScaling


def _base_inv_freq(head_dim: int, theta: float, device: torch.device | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / head_dim
    return 1.0 / (theta**exponents)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old_context = s.original_max_positions
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_attention_factor(s: RopeScaling) -> float:
    """The cos/sin multiplier of yarn: ``attention_factor``, else ``0.1 * ln(factor) + 1``."""
    if s.attention_factor is not None:
        return s.attention_factor
    return 1.0 if s.factor <= 1 else 0.1 * math.log(s.factor) + 1.0


def _yarn(head_dim: int, theta: float, s: RopeScaling, device: torch.device | None) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(s.original_max_positions / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(device=device, dtype=torch.float) / head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp.to(device=device, dtype=torch.float)
    return interpolation * (1 - keep) + extrapolation * keep


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None, device: torch.device | None = None
) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim/2] float32, cos/sin multiplier)`` for base ``theta`` and ``scaling``."""
    if scaling is None:
        return _base_inv_freq(head_dim, theta, device), 1.0
    if scaling.kind == "linear":
        return _base_inv_freq(head_dim, theta, device) / scaling.factor, 1.0
    if scaling.kind == "llama3":
        return _llama3(_base_inv_freq(head_dim, theta, device), scaling), 1.0
    return _yarn(head_dim, theta, scaling, device), yarn_attention_factor(scaling)
