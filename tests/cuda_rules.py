"""What PyTorch's CUDA attention kernels check of their arguments, checked on the meta device.

Neither the CPU kernels nor the aten ops' meta implementations check these; the CUDA kernels
do, and a call that breaks one fails only on a GPU (found by the first GPU run, 2026-12-04):

- ``_scaled_dot_product_flash_attention_backward``: ``cum_seq_q`` / ``cum_seq_k`` are None for
  dense inputs (a defined tensor selects the variable-length kernel, which wants int32
  offsets: "cu_seqlens_q must have dtype int32"); where given they are int32.
- ``_flash_attention_forward`` / ``_backward``: no offsets for dense ``[B, S, H, d]`` inputs; for
  packed ``[T, H, d]`` ones int32 offsets, and the backward's lse ``[H, T]``.
- ``_scaled_dot_product_efficient_attention_backward``: the log-sum-exp's head and batch strides
  are multiples of 16 elements ("LSE is not correctly aligned (strideH)"; the forward returns it
  padded to 32), and ``out`` is laid out ``[B, S, H, d]`` contiguously (the kernel reads it with
  the fixed row stride ``H * d``: a head-split view gives wrong gradients with no error).

:class:`CudaArgumentRules` records every aten attention call made under it and raises on a
broken rule; tests run the CUDA backend on meta tensors under it.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def _bshd_contiguous(x: torch.Tensor) -> bool:
    """Whether ``x`` ([B, H, S, d] as the kernels take it) is a view of contiguous [B, S, H, d]."""
    return x.transpose(1, 2).is_contiguous()


def _offsets_ok(*offsets) -> str | None:
    for name, t in offsets:
        if t is not None and t.dtype != torch.int32:
            return f"{name} must have dtype int32, got {t.dtype}"
    return None


def check_call(func, args, kwargs) -> str | None:
    """Why the CUDA kernel of ``func`` would refuse (or silently misread) these arguments, or None."""
    if func is aten._scaled_dot_product_flash_attention_backward.default:
        cum_q, cum_k = args[6], args[7]
        if cum_q is not None or cum_k is not None:
            return (
                "dense flash backward given cum_seq_q/cum_seq_k tensors (selects the variable-length "
                f"kernel): {cum_q!r}, {cum_k!r}; pass None"
            )
    if func in (aten._flash_attention_forward.default, aten._flash_attention_backward.default):
        forward = func is aten._flash_attention_forward.default
        q = args[0] if forward else args[1]
        cum_q, cum_k = (args[3], args[4]) if forward else (args[6], args[7])
        if q.dim() == 4 and (cum_q is not None or cum_k is not None):
            return "dense (4-D) inputs given cum_seq_q/cum_seq_k: pass None"
        if q.dim() == 3:
            if cum_q is None or cum_k is None:
                return "packed (3-D) inputs need cum_seq_q and cum_seq_k"
            if not forward and tuple(args[5].shape) != (q.shape[1], q.shape[0]):
                return f"packed lse must be [H, total_q] = {(q.shape[1], q.shape[0])}, got {tuple(args[5].shape)}"
        return _offsets_ok(("cum_seq_q", cum_q), ("cum_seq_k", cum_k))
    if func is aten._scaled_dot_product_efficient_attention_backward.default:
        q, out, lse = args[1], args[5], args[6]
        batch, heads = q.shape[0], q.shape[1]
        if heads > 1 and lse.stride(1) % 16:
            return f"LSE is not correctly aligned (strideH): lse {tuple(lse.shape)} strides {lse.stride()}"
        if batch > 1 and lse.stride(0) % 16:
            return f"LSE is not correctly aligned (strideB): lse {tuple(lse.shape)} strides {lse.stride()}"
        if not _bshd_contiguous(out):
            shape, strides = tuple(out.shape), out.stride()
            return f"out must be contiguous [B, S, H, d] (fixed row stride): shape {shape}, strides {strides}"
    return None


class CudaArgumentRules(TorchDispatchMode):
    """Raise on an aten attention call that a CUDA kernel would refuse; ``calls`` lists the
    attention ops called."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__)
        if "attention" in name:
            self.calls.append(name)
            why = check_call(func, args, kwargs)
            if why is not None:
                raise AssertionError(f"{name}: {why}")
        return func(*args, **kwargs)
