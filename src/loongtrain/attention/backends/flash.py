"""PyTorch's own FlashAttention-2 on CUDA, through ``aten._flash_attention_forward`` /
``_backward`` (what ``F.scaled_dot_product_attention``'s flash backend and
``torch.nn.attention.varlen.varlen_attn`` call): fp16/bf16, GQA native, ``[B, S, H, d]`` inputs
as they are, a sliding-window band as the kernel's window (no mask tensor), and the
variable-length form: packed ``[T, H, d]`` pieces with int32 offsets on the device, one call
for every document of a block.

Called as ``varlen_attn`` calls them (torch 2.11 and 2.13 alike): no offsets for dense inputs
(None, what the forward returns for them), int32 offsets for packed ones, and for the backward
the ``rng_state`` / ``unused`` pair it passes without dropout.
"""

from __future__ import annotations

import torch

from loongtrain.attention.backends.base import Tensor, Window

aten = torch.ops.aten


def _rng_pair(device: torch.device) -> tuple[Tensor, Tensor]:
    """The flash backward's ``rng_state`` and ``unused`` without dropout (never read)."""
    return torch.zeros((2,), dtype=torch.uint64, device=device), torch.empty(0, device=device)


def _window(window: Window | None) -> tuple[int | None, int | None]:
    return (None, None) if window is None else window


class Fa2Varlen:
    """The variable-length kernel pair (:class:`~loongtrain.attention.backends.base.VarlenKernel`)."""

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window):
        left, right = _window(window)
        res = aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
            window_size_left=left, window_size_right=right,
        )  # fmt: skip
        return res[0], res[1]

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window):
        left, right = _window(window)
        rng_state, unused = _rng_pair(q.device)
        dq, dk, dv = aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal,
            rng_state, unused, scale=scale, window_size_left=left, window_size_right=right,
        )  # fmt: skip
        return dq, dk, dv


class Fa2Backend:
    """PyTorch's FlashAttention-2: dense calls (a band as the kernel's window) and packed pieces."""

    name = "flash"
    dtypes = (torch.float16, torch.bfloat16)
    takes_window = True
    varlen = Fa2Varlen()
    other_shapes = None

    def forward(self, q, k, v, causal, scale, mask=None, window=None):
        if mask is not None:
            raise ValueError("the flash backend takes a band as its window, not a mask")
        sq, sk = q.shape[1], k.shape[1]
        left, right = _window(window)
        res = aten._flash_attention_forward(
            q, k, v, None, None, sq, sk, 0.0, causal, False, scale=scale, window_size_left=left,
            window_size_right=right,
        )  # fmt: skip
        return res[0], res[1].transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None, window=None):
        if mask is not None:
            raise ValueError("the flash backend takes a band as its window, not a mask")
        sq, sk = q.shape[1], k.shape[1]
        left, right = _window(window)
        rng_state, unused = _rng_pair(q.device)
        dq, dk, dv = aten._flash_attention_backward(
            dout, q, k, v, out, lse.transpose(1, 2).contiguous(), None, None, sq, sk, 0.0, causal, rng_state,
            unused, scale=scale, window_size_left=left, window_size_right=right,
        )  # fmt: skip
        return dq, dk, dv
