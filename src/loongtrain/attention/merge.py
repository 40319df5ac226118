"""Numerically stable merge of partial attention results (fp32 accumulators)."""

from __future__ import annotations

import torch


def merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Merge block result ``(out_b, lse_b)`` into ``(out_acc, lse_acc)`` in place.

    ``out_acc`` [..., S, H, d] and ``lse_acc`` [..., S, H] are float32 or float64 (views are fine);
    ``out_b`` may be lower precision. With ``w = sigmoid(lse_b - lse_acc)``:
    ``out_acc <- out_acc + w * (out_b - out_acc)`` and
    ``lse_acc <- logaddexp(lse_acc, lse_b)``; both are stable for any lse gap (no
    ``exp`` of a large number), unlike the naive ``exp(lse_a) * out_a + ...`` form.
    """
    weight = torch.sigmoid(lse_b - lse_acc).unsqueeze(-1)
    out_acc.lerp_(out_b.to(out_acc.dtype), weight)
    torch.logaddexp(lse_acc, lse_b, out=lse_acc)
