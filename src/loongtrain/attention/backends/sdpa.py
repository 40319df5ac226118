"""PyTorch's SDPA aten kernels on CUDA: the flash kernel (``_scaled_dot_product_flash_attention``)
for unmasked fp16/bf16 calls, the memory-efficient kernel for fp32 and for every masked call (the
band's mask as its additive bias; key/value heads expanded to the query heads: it has no GQA).

Called as PyTorch's own context parallelism calls them
(``torch/distributed/tensor/experimental/_context_parallel/_attention.py``): the CUDA kernels
check what the CPU kernels and the meta device do not (``tests/cuda_rules.py`` lists them), and
each backward gets the philox seed and offset its forward returned (what autograd passes back; read
only with dropout, which is 0 here).
"""

from __future__ import annotations

import torch

from loongtrain.attention.backends.base import Tensor, bhsd

#: Rows of the log-sum-exp the memory-efficient kernel's forward returns are padded to a multiple
#: of this (``kAlignLSE``); its backward checks that the lse's head and batch strides are aligned.
EFFICIENT_LSE_ALIGN = 32


def expand_kv(x: Tensor, heads: int) -> Tensor:
    """[B, S, G, d] -> [B, S, heads, d], each key/value head repeated heads // G times."""
    groups = x.shape[2]
    if groups == heads:
        return x
    return x.repeat_interleave(heads // groups, dim=2)


def sum_kv_grad(dx: Tensor, groups: int) -> Tensor:
    """Inverse of :func:`expand_kv` for gradients: sum the replicas of each head."""
    b, s, heads, d = dx.shape
    if heads == groups:
        return dx
    return (
        dx.view(b, s, groups, heads // groups, d)
        .sum(dim=3, dtype=torch.promote_types(dx.dtype, torch.float32))
        .to(dx.dtype)
    )


def aligned_bias(mask: Tensor, batch: int, heads: int, dtype: torch.dtype) -> Tensor:
    """[Sq, Sk] additive mask -> a [B, H, Sq, Sk] view whose rows start 16-element aligned
    (what the memory-efficient kernel needs for its bias)."""
    sq, sk = mask.shape
    padded = mask.new_zeros((sq, -(-sk // 16) * 16), dtype=dtype)
    padded[:, :sk] = mask
    return padded[:, :sk].expand(batch, heads, sq, sk)


def efficient_lse(lse: Tensor) -> Tensor:
    """``lse`` [B, Sq, H] as the memory-efficient backward takes it: ``[B, H, Sq']`` with ``Sq'`` the
    next multiple of :data:`EFFICIENT_LSE_ALIGN` (the padding is never read), as its forward
    returns it."""
    b, sq, heads = lse.shape
    padded = lse.new_zeros((b, heads, -(-sq // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN))
    padded[..., :sq] = lse.transpose(1, 2)
    return padded


def flash_rng_like_forward(device: torch.device) -> tuple[Tensor, Tensor]:
    """A philox ``(seed, offset)`` pair shaped as the flash forward returns it on CUDA (``uint64``
    ``[2]`` and ``[]``: torch's meta registration of ``_scaled_dot_product_flash_attention``), for a
    backward that runs before any forward on ``device``; read only with dropout, which is 0 here."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.zeros((), dtype=torch.uint64, device=device)


def efficient_rng_like_forward(device: torch.device) -> tuple[Tensor, Tensor]:
    """The memory-efficient kernel's philox ``(seed, offset)`` shaped as its forward returns them
    (``int64`` ``[]`` each), for a backward before any forward; read only with dropout."""
    return torch.zeros((), dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device)


class CudaSdpaBackend:
    """PyTorch's CUDA SDPA aten kernels: flash for fp16/bf16, efficient for fp32 and masks."""

    name = "sdpa"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    takes_window = False
    varlen = None
    other_shapes = None

    def __init__(self) -> None:
        # the philox (seed, offset) each kernel's forward last returned on each device (key: the device,
        # or (device, "efficient")): its backward gets them back, as autograd and PyTorch's context
        # parallelism hand a forward's outputs to its backward
        self._rng: dict[object, tuple[Tensor, Tensor]] = {}

    @staticmethod
    def _use_flash(q: Tensor, mask: Tensor | None) -> bool:
        return mask is None and q.dtype in (torch.float16, torch.bfloat16)

    def forward(self, q, k, v, causal, scale, mask=None, window=None):
        sq = q.shape[1]
        if self._use_flash(q, mask):
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                bhsd(q), bhsd(k), bhsd(v), 0.0, causal, False, scale=scale
            )
            out, lse = res[0], res[1]
            self._rng[q.device] = (res[6], res[7])
        else:
            b, _, heads, _ = q.shape
            bias = None if mask is None else aligned_bias(mask, b, heads, q.dtype)
            out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
                bhsd(q), bhsd(expand_kv(k, heads)), bhsd(expand_kv(v, heads)), bias, True, 0.0, causal, scale=scale
            )
            self._rng[(q.device, "efficient")] = (seed, offset)
        return out.transpose(1, 2), lse[..., :sq].transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None, window=None):
        sq, sk = q.shape[1], k.shape[1]
        if self._use_flash(q, mask):
            # dense inputs: cum_seq_q/k None, as the forward returns them for dense inputs and as
            # PyTorch's own context parallelism hands them back (a defined tensor there selects the
            # variable-length kernel, which wants int32 offsets); philox seed and offset as the forward
            # returned them
            seed, offset = self._rng.get(q.device) or flash_rng_like_forward(q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                bhsd(dout), bhsd(q), bhsd(k), bhsd(v), bhsd(out), lse.transpose(1, 2).contiguous(),
                None, None, sq, sk, 0.0, causal, seed, offset, scale=scale,
            )  # fmt: skip
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        b, _, heads, _ = q.shape
        groups = k.shape[2]
        bias = None if mask is None else aligned_bias(mask, b, heads, q.dtype)
        seed, offset = self._rng.get((q.device, "efficient")) or efficient_rng_like_forward(q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            bhsd(dout.contiguous()), bhsd(q), bhsd(expand_kv(k, heads)), bhsd(expand_kv(v, heads)), bias,
            bhsd(out.contiguous()),  # the kernel reads out with a fixed row stride (heads x head dim)
            efficient_lse(lse), seed, offset, 0.0, [True, True, True, False], causal, scale=scale,
        )  # fmt: skip
        return dq.transpose(1, 2), sum_kv_grad(dk.transpose(1, 2), groups), sum_kv_grad(dv.transpose(1, 2), groups)
