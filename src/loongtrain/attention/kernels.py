"""Local block attention returning the log-sum-exp, and its backward.

Every distributed scheme is built from these two functions. Layout convention:
``q`` is ``[B, Sq, H, d]``, ``k``/``v`` are ``[B, Sk, G, d]`` with ``H % G == 0`` (query
head ``h`` uses key/value head ``h // (H // G)``), ``out`` is ``[B, Sq, H, d]`` in the
input dtype and ``lse`` is ``[B, Sq, H]`` in float32 (float64 for float64 inputs), natural
log, scale included.
``causal`` masks top-left aligned (query ``i`` sees keys ``j <= i``). ``mask`` (optional,
for partial blocks of document / sliding-window masks) is an additive float ``[Sq, Sk]`` tensor
(0 visible, -inf hidden); every row must see at least one key.

This module is the only place that picks a kernel by device; the rest of the code calls
:func:`block_forward` / :func:`block_backward`. Kernels used:

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``); GQA native.
- CUDA, fp16/bf16: the ``flash_attn`` package (>= 2.7) when installed, else
  ``aten._scaled_dot_product_flash_attention``; GQA native.
- CUDA, fp32, and any masked call: ``aten._scaled_dot_product_efficient_attention`` with
  key/value heads expanded to the query heads (that kernel has no GQA), gradients summed
  back; a mask goes in as its additive bias.

The aten ``_scaled_dot_product_*`` ops are private PyTorch API; they are the only
kernels that return the log-sum-exp needed to merge partial results, so they are
wrapped here and nowhere else.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Protocol

import torch

from loongtrain.attention.workspace import backward_heads_per_call

Tensor = torch.Tensor


class BlockBackend(Protocol):
    """A kernel pair for one device family."""

    name: str
    dtypes: tuple[torch.dtype, ...]

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]: ...

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
        mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]: ...


def _bhsd(x: Tensor) -> Tensor:
    """[B, S, H, d] -> [B, H, S, d] view (kernels take this layout)."""
    return x.transpose(1, 2)


class CpuFlashBackend:
    """``aten._scaled_dot_product_flash_attention_for_cpu``: fp32 lse for every dtype."""

    name = "cpu-flash"
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

    def forward(self, q, k, v, causal, scale, mask=None):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, attn_mask=mask, scale=scale
        )
        return out.transpose(1, 2), lse.transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout),
            _bhsd(q),
            _bhsd(k),
            _bhsd(v),
            _bhsd(out),
            lse.transpose(1, 2),
            0.0,
            causal,
            attn_mask=mask,
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _expand_kv(x: Tensor, heads: int) -> Tensor:
    """[B, S, G, d] -> [B, S, heads, d], each key/value head repeated heads // G times."""
    groups = x.shape[2]
    if groups == heads:
        return x
    return x.repeat_interleave(heads // groups, dim=2)


def _sum_kv_grad(dx: Tensor, groups: int) -> Tensor:
    """Inverse of :func:`_expand_kv` for gradients: sum the replicas of each head."""
    b, s, heads, d = dx.shape
    if heads == groups:
        return dx
    return (
        dx.view(b, s, groups, heads // groups, d)
        .sum(dim=3, dtype=torch.promote_types(dx.dtype, torch.float32))
        .to(dx.dtype)
    )


def _aligned_bias(mask: Tensor, batch: int, heads: int, dtype: torch.dtype) -> Tensor:
    """[Sq, Sk] additive mask -> a [B, H, Sq, Sk] view whose rows start 16-element aligned
    (what the memory-efficient kernel needs for its bias)."""
    sq, sk = mask.shape
    padded = mask.new_zeros((sq, -(-sk // 16) * 16), dtype=dtype)
    padded[:, :sk] = mask
    return padded[:, :sk].expand(batch, heads, sq, sk)


class CudaSdpaBackend:
    """PyTorch's CUDA SDPA aten kernels: flash for fp16/bf16, efficient for fp32 and masks."""

    name = "cuda-sdpa"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)

    @staticmethod
    def _use_flash(q: Tensor, mask: Tensor | None) -> bool:
        return mask is None and q.dtype in (torch.float16, torch.bfloat16)

    def forward(self, q, k, v, causal, scale, mask=None):
        sq = q.shape[1]
        if self._use_flash(q, mask):
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, False, scale=scale
            )
            out, lse = res[0], res[1]
        else:
            b, _, heads, _ = q.shape
            bias = None if mask is None else _aligned_bias(mask, b, heads, q.dtype)
            out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
                _bhsd(q),
                _bhsd(_expand_kv(k, heads)),
                _bhsd(_expand_kv(v, heads)),
                bias,
                True,
                0.0,
                causal,
                scale=scale,
            )
        return out.transpose(1, 2), lse[..., :sq].transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None):
        sq, sk = q.shape[1], k.shape[1]
        lse_bhs = lse.transpose(1, 2).contiguous()
        if self._use_flash(q, mask):
            empty = torch.empty(0, device=q.device, dtype=torch.int64)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                _bhsd(dout),
                _bhsd(q),
                _bhsd(k),
                _bhsd(v),
                _bhsd(out),
                lse_bhs,
                empty,
                empty,
                sq,
                sk,
                0.0,
                causal,
                empty,
                empty,
                scale=scale,
            )
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        b, _, heads, _ = q.shape
        groups = k.shape[2]
        bias = None if mask is None else _aligned_bias(mask, b, heads, q.dtype)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            _bhsd(dout),
            _bhsd(q),
            _bhsd(_expand_kv(k, heads)),
            _bhsd(_expand_kv(v, heads)),
            bias,
            _bhsd(out),
            lse_bhs,
            seed,
            seed,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return (
            dq.transpose(1, 2),
            _sum_kv_grad(dk.transpose(1, 2), groups),
            _sum_kv_grad(dv.transpose(1, 2), groups),
        )


class FlashAttnBackend:
    """The ``flash_attn`` package (2.7 or newer): fp16/bf16 on CUDA, head dim % 8 == 0."""

    name = "flash-attn"
    dtypes = (torch.float16, torch.bfloat16)

    def __init__(self, module) -> None:
        self._fa = module
        self._masked = CudaSdpaBackend()  # flash_attn takes no arbitrary mask

    def forward(self, q, k, v, causal, scale, mask=None):
        if mask is not None:
            return self._masked.forward(q, k, v, causal, scale, mask)
        out, lse, _, _ = self._fa._flash_attn_forward(
            q.contiguous(), k.contiguous(), v.contiguous(), 0.0, scale, causal, -1, -1, 0.0, None, False
        )
        return out, lse.transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None):
        if mask is not None:
            return self._masked.backward(dout, q, k, v, out, lse, causal, scale, mask)
        q, k, v, out, dout = (x.contiguous() for x in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fa._flash_attn_backward(
            dout,
            q,
            k,
            v,
            out,
            lse.transpose(1, 2).contiguous(),
            dq,
            dk,
            dv,
            0.0,
            scale,
            causal,
            -1,
            -1,
            0.0,
            None,
            False,
            None,
        )
        return dq, dk, dv


def _load_flash_attn():
    """Return the flash_attn interface module if a compatible version is installed."""
    try:
        from flash_attn import flash_attn_interface as fa
    except Exception:
        return None
    params = inspect.signature(fa._flash_attn_forward).parameters
    return fa if "window_size_left" in params else None


@functools.cache
def _backend_for(device_type: str, dtype: torch.dtype) -> BlockBackend:
    choice = os.environ.get("LOONGTRAIN_ATTENTION_BACKEND", "auto")
    if device_type == "cpu":
        return CpuFlashBackend()
    if device_type == "cuda":
        if choice in ("auto", "flash-attn") and dtype in FlashAttnBackend.dtypes:
            fa = _load_flash_attn()
            if fa is not None:
                return FlashAttnBackend(fa)
            if choice == "flash-attn":
                raise RuntimeError(
                    "LOONGTRAIN_ATTENTION_BACKEND=flash-attn but flash_attn>=2.7 is not importable; "
                    "install it or unset the variable to use PyTorch's SDPA kernels"
                )
        return CudaSdpaBackend()
    raise NotImplementedError(
        f"loongtrain: no block-attention kernel for device type {device_type!r}; supported: cpu, cuda"
    )


def backend_for(device: torch.device, dtype: torch.dtype) -> BlockBackend:
    """The kernel pair used for tensors of ``dtype`` on ``device``."""
    return _backend_for(device.type, dtype)


def check_supported(device: torch.device, dtype: torch.dtype) -> None:
    """Raise a clear error if no kernel handles ``dtype`` on ``device``."""
    backend = backend_for(device, dtype)
    if dtype not in backend.dtypes:
        raise TypeError(
            f"loongtrain: dtype {dtype} is not supported by the {backend.name} attention kernel "
            f"on {device.type}; use one of {[str(d) for d in backend.dtypes]}"
        )


def block_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Attention of a query block against a key/value block: ``(out, lse)``."""
    return backend_for(q.device, q.dtype).forward(q, k, v, causal, scale, mask)


def block_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool,
    scale: float,
    mask: Tensor | None = None,
    stacked: bool = False,
) -> tuple[Tensor, ...]:
    """Gradients ``(dq, dk, dv)`` of one block given the *final* ``out`` and ``lse`` rows;
    with ``stacked``, ``(dq, dkv)``: dk and dv as one ``[2, *k.shape]`` tensor.

    With ``out``/``lse`` of the full (merged) attention, the block's probabilities are
    the global ones, so summing the returned gradients over blocks gives the exact
    gradient of the whole attention. A block of many rows runs over groups of heads
    (:func:`~loongtrain.attention.workspace.backward_heads_per_call`), which bounds the
    kernel's own workspace; heads are independent, so the gradients are the same. Over head
    groups each call's dk/dv go straight into their place in the stacked tensor (one call
    returns them apart, and stacking copies them).
    """
    backend = backend_for(q.device, q.dtype)
    b, rows, heads, _ = q.shape
    groups = k.shape[2]
    per_call = backward_heads_per_call(b * rows, heads, groups)
    if per_call == heads:
        dq, dk, dv = backend.backward(dout, q, k, v, out, lse, causal, scale, mask)
        return (dq, torch.stack((dk, dv))) if stacked else (dq, dk, dv)

    def call(qh: slice, kh: slice) -> tuple[Tensor, Tensor, Tensor]:
        return backend.backward(dout[:, :, qh], q[:, :, qh], k[:, :, kh], v[:, :, kh], out[:, :, qh], lse[:, :, qh],
                                causal, scale, mask)  # fmt: skip

    dq, dkv = torch.empty_like(q), k.new_empty((2, *k.shape))
    dk, dv = dkv[0], dkv[1]
    ratio = heads // groups
    if per_call >= ratio:  # whole key/value groups a call
        kv_per_call = per_call // ratio
        for g in range(0, groups, kv_per_call):
            qh, kh = slice(g * ratio, (g + kv_per_call) * ratio), slice(g, g + kv_per_call)
            dq[:, :, qh], dk[:, :, kh], dv[:, :, kh] = call(qh, kh)
    else:
        for g in range(groups):  # part of one group a call: its dk/dv summed in fp32, as the kernel's GQA sum does
            kh = slice(g, g + 1)
            sums = torch.zeros((2, *dk[:, :, kh].shape), dtype=torch.promote_types(k.dtype, torch.float32),
                               device=k.device)  # fmt: skip
            for h in range(g * ratio, (g + 1) * ratio, per_call):
                qh = slice(h, h + per_call)
                dq[:, :, qh], dk_part, dv_part = call(qh, kh)
                sums[0] += dk_part
                sums[1] += dv_part
            dk[:, :, kh], dv[:, :, kh] = sums[0], sums[1]
    return (dq, dkv) if stacked else (dq, dk, dv)
