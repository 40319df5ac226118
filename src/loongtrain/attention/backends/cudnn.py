"""cuDNN's fused attention (``aten._scaled_dot_product_cudnn_attention`` + ``_backward``) for dense
fp16/bf16 blocks: on Hopper 1.65x faster than FlashAttention-2 at 32K and 128K (one H200,
2026-12-04). GQA native; the log-sum-exp comes back fp32 ``[B, H, Sq, 1]``.

cuDNN's causal mask is top-left aligned (FlashAttention's bottom-right): only square diagonal
blocks are given ``causal``, which is what the mask plan makes. Windows (sliding-window bands),
packed documents and shapes cuDNN does not take (head dim over 128 or not a multiple of 8) run on
PyTorch's FlashAttention-2 (:mod:`~loongtrain.attention.backends.flash`).

cuDNN builds and caches an execution graph per new shape, 260-400 ms per build, forward and
backward each (sglang#4650, flashinfer#2545), and PyTorch's dispatcher refuses it for one-row
queries (pytorch#138531). So it is given only the shapes that come back every layer and every
step: a block's standard zigzag shapes (:func:`repeating_shape`, decided from host integers);
every other dense call (a packed document's piece, a decoded token against its cache) goes to
:attr:`CudnnBackend.other_shapes`, FlashAttention-2, which builds nothing per shape.
"""

from __future__ import annotations

import torch

from loongtrain.attention.backends.base import bhsd
from loongtrain.attention.backends.flash import Fa2Backend

aten = torch.ops.aten


def cudnn_takes(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether cuDNN's SDPA kernel takes blocks of ``dtype`` and ``head_dim`` (half precision; head
    dim a multiple of 8, at most 128)."""
    return dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 128


def repeating_shape(rows: int, cols: int, block: int) -> bool:
    """Whether a dense call of ``rows`` queries x ``cols`` keys cut from a block of ``block`` rows
    has one of the block's standard zigzag shapes, the ones every layer and step repeat: the whole
    block (the diagonal, or one sequence on one device), the whole block against the first key
    half, or the second query half against the whole block. At least two query rows."""
    half = block // 2
    return rows > 1 and (rows, cols) in ((block, block), (block, half), (half, block))


class CudnnBackend:
    """cuDNN for the dense blocks of standard shapes; FlashAttention-2 for windows, packed pieces and
    other shapes (``other_shapes``: what :func:`~loongtrain.attention.kernels.block_forward` sends
    the dense calls :func:`repeating_shape` refuses to)."""

    name = "cudnn"
    dtypes = (torch.float16, torch.bfloat16)
    takes_window = True

    def __init__(self) -> None:
        self._flash = Fa2Backend()
        self.varlen = self._flash.varlen
        self.other_shapes = self._flash
        # the philox (seed, offset) the forward last returned on each device, handed to the backward
        # as autograd does (read only with dropout, which is 0 here)
        self._rng: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, q, k, v, causal, scale, mask=None, window=None):
        if window is not None or mask is not None or not cudnn_takes(q.dtype, q.shape[-1]):
            return self._flash.forward(q, k, v, causal, scale, mask, window)
        b, sq, h, _ = q.shape
        res = aten._scaled_dot_product_cudnn_attention(bhsd(q), bhsd(k), bhsd(v), None, True, 0.0, causal, False,
                                                       scale=scale)  # fmt: skip
        self._rng[q.device] = (res[6], res[7])
        return res[0].transpose(1, 2), res[1].reshape(b, h, sq).transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None, window=None):
        if window is not None or mask is not None or not cudnn_takes(q.dtype, q.shape[-1]):
            return self._flash.backward(dout, q, k, v, out, lse, causal, scale, mask, window)
        sq, sk = q.shape[1], k.shape[1]
        if dout.stride() != out.stride():  # cuDNN reads dO in O's layout
            dout, out = dout.contiguous(), out.contiguous()
        seed, offset = self._rng.get(q.device) or _rng_like_forward(q.device)
        stats = lse.transpose(1, 2).unsqueeze(-1).contiguous()  # [B, H, Sq, 1], as the forward returns it
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            bhsd(dout), bhsd(q), bhsd(k), bhsd(v), bhsd(out), stats, seed, offset, None, None, None, sq, sk, 0.0,
            causal, scale=scale,
        )  # fmt: skip
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _rng_like_forward(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's philox ``(seed, offset)`` shaped as its forward returns them (``int64`` ``[]``), for a
    backward before any forward on ``device``."""
    return torch.zeros((), dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device)
