"""The CPU kernel: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), fp32 lse
for every dtype, GQA native, an additive mask for bands (it takes no window)."""

from __future__ import annotations

import torch

from loongtrain.attention.backends.base import bhsd


class CpuFlashBackend:
    """``aten._scaled_dot_product_flash_attention_for_cpu``: fp32 lse for every dtype."""

    name = "cpu-flash"
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    takes_window = False
    varlen = None
    other_shapes = None

    def forward(self, q, k, v, causal, scale, mask=None, window=None):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            bhsd(q), bhsd(k), bhsd(v), 0.0, causal, attn_mask=mask, scale=scale
        )
        return out.transpose(1, 2), lse.transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None, window=None):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            bhsd(dout), bhsd(q), bhsd(k), bhsd(v), bhsd(out), lse.transpose(1, 2), 0.0, causal,
            attn_mask=mask, scale=scale,
        )  # fmt: skip
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
