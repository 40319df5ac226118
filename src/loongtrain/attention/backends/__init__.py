"""Block-attention backends, one module each, and the one place that chooses among them.

=============  ==========================================================================
``cpu``        ``aten._scaled_dot_product_flash_attention_for_cpu``: every dtype; bands as masks
``cudnn``      cuDNN's fused attention for the dense fp16/bf16 blocks of standard shapes (it builds
               a graph per new shape); windows, packed documents and other shapes on ``flash``
``flash``      PyTorch's FlashAttention-2 (``aten._flash_attention_*``): fp16/bf16, bands as
               its window, packed documents in one variable-length call per block
``sdpa``       PyTorch's SDPA ops: the flash kernel for unmasked fp16/bf16 calls, the
               memory-efficient kernel (with the band's mask as its bias) for the rest; the only
               CUDA kernel for fp32, which every name uses for fp32
``flash-attn`` the ``flash_attn`` package (2.7+) where installed
=============  ==========================================================================

``auto`` (the default) takes, on CUDA: ``flash-attn`` where installed; else ``cudnn`` on Hopper
and Blackwell with cuDNN 9.15 or newer (where PyTorch itself prefers it; measured on one H200,
2026-12-04: 28.8 ms against FlashAttention-2's 47.4 ms for a 32K causal forward + backward);
else ``flash`` on Ampere or newer; else ``sdpa``. It depends on the device alone, so every rank
of a homogeneous cluster chooses the same. ``[attention] kernel`` (the
``LOONGTRAIN_ATTENTION_BACKEND`` environment variable outside the trainer) names one;
:func:`kernel_unavailable` says why one cannot run on a device.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from loongtrain.attention.backends.base import Band, BlockBackend, Piece, VarlenCall, VarlenKernel, Window
from loongtrain.attention.backends.cpu import CpuFlashBackend
from loongtrain.attention.backends.cudnn import CudnnBackend, repeating_shape
from loongtrain.attention.backends.flash import Fa2Backend
from loongtrain.attention.backends.flash_attn import FlashAttnBackend, flash_attn_unavailable, load_flash_attn
from loongtrain.attention.backends.sdpa import CudaSdpaBackend
from loongtrain.options import ATTENTION_KERNELS

__all__ = [
    "KERNELS", "Band", "BlockBackend", "CpuFlashBackend", "CudaSdpaBackend", "CudnnBackend", "Fa2Backend",
    "FlashAttnBackend", "Piece", "VarlenCall", "VarlenKernel", "Window", "auto_kernel", "backend_for",
    "chosen_kernel", "kernel_unavailable", "repeating_shape", "set_attention_kernel",
]  # fmt: skip

#: The names ``[attention] kernel`` takes.
KERNELS = ATTENTION_KERNELS
ENV = "LOONGTRAIN_ATTENTION_BACKEND"
#: cuDNN version from which PyTorch prefers its SDPA kernel on SM90 / SM100 (``check_prefer_cudnn_attention``)
CUDNN_PREFERRED = 91500


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _unknown(name: str) -> str | None:
    return None if name in KERNELS else f"attention kernel {name!r} is unknown; choose one of {list(KERNELS)}"


def kernel_unavailable(name: str, device: torch.device) -> str | None:
    """Why kernel ``name`` cannot run on ``device`` (a sentence naming the fix), or None."""
    if name not in KERNELS or name == "auto":
        return _unknown(name)
    if device.type == "cpu":
        return None if name == "cpu" else f"attention kernel {name!r} runs on CUDA, not on the CPU; use auto or cpu"
    if device.type != "cuda":
        return f"no attention kernel for device type {device.type!r}; supported: cpu, cuda"
    if name == "cpu":
        return "attention kernel 'cpu' runs on the CPU; use auto (or cudnn, flash, sdpa) on CUDA"
    major, minor = _capability(device)
    if name in ("cudnn", "flash") and major < 8:
        return (
            f"attention kernel {name!r} needs compute capability 8.0 or newer, this GPU has {major}.{minor}; use sdpa"
        )
    if name == "cudnn" and not torch.backends.cudnn.is_available():
        return "attention kernel 'cudnn': this torch has no cuDNN; use flash or sdpa"
    if name == "flash-attn":
        why = flash_attn_unavailable()
        return None if why is None else f"attention kernel 'flash-attn': {why}"
    return None


def auto_kernel(device: torch.device) -> str:
    """What ``auto`` takes on ``device`` (see the module docstring): by the device's capability, the
    first choice confirmed by one small forward and backward on it (a kernel that refuses falls
    back, with a warning, to the next)."""
    if device.type != "cuda":
        return "cpu"
    if flash_attn_unavailable() is None:
        return "flash-attn"
    major, _ = _capability(device)
    cudnn = torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= CUDNN_PREFERRED
    if major in (9, 10) and cudnn and _runs("cudnn", device):
        return "cudnn"
    return "flash" if major >= 8 and _runs("flash", device) else "sdpa"


def _runs(name: str, device: torch.device) -> bool:
    """Whether kernel ``name`` runs one small causal GQA block forward and backward on ``device``."""
    backend = {"cudnn": CudnnBackend, "flash": Fa2Backend}[name]()
    try:
        gen = torch.Generator(device).manual_seed(0)
        q = torch.randn(1, 256, 4, 128, generator=gen, device=device, dtype=torch.bfloat16)
        kv = torch.randn(2, 1, 256, 2, 128, generator=gen, device=device, dtype=torch.bfloat16)
        out, lse = backend.forward(q, kv[0], kv[1], True, 0.1)
        grads = backend.backward(out, q, kv[0], kv[1], out, lse, True, 0.1)
        torch.cuda.synchronize(device)
        if not all(bool(torch.isfinite(g).all()) for g in (out, *grads)):
            raise RuntimeError("non-finite result")
        return True
    except RuntimeError as exc:
        warnings.warn(f"loongtrain: attention kernel {name!r} does not run here ({exc}); auto takes the next one",
                      stacklevel=2)  # fmt: skip
        return False


_CHOICE: list[str] = []  # set_attention_kernel's name; else the environment's; else auto


def set_attention_kernel(name: str, device: torch.device | None = None) -> None:
    """Use kernel ``name`` in this process from now on; with ``device``, refuse one that cannot run
    there (ValueError naming the fix)."""
    why = kernel_unavailable(name, device) if device is not None else _unknown(name)
    if why is not None:
        raise ValueError(why)
    _CHOICE[:] = [name]


def _named() -> str:
    return _CHOICE[0] if _CHOICE else os.environ.get(ENV, "auto")


def chosen_kernel(device: torch.device) -> str:
    """The kernel name in use on ``device`` (``auto`` resolved)."""
    return _resolved(_named(), device.type, device.index)


@functools.cache
def _resolved(name: str, device_type: str, index: int | None) -> str:
    if device_type != "cuda":
        return "cpu"
    return auto_kernel(torch.device(device_type, index)) if name == "auto" else name


@functools.cache
def _backend(name: str, device_type: str, dtype: torch.dtype) -> BlockBackend:
    if device_type == "cpu":
        return CpuFlashBackend()
    if device_type != "cuda":
        raise NotImplementedError(
            f"loongtrain: no block-attention kernel for device type {device_type!r}; supported: cpu, cuda"
        )
    if dtype not in (torch.float16, torch.bfloat16) or name == "sdpa":
        return CudaSdpaBackend()  # the only CUDA kernel for fp32
    if name == "cudnn":
        return CudnnBackend()
    if name == "flash":
        return Fa2Backend()
    if name == "flash-attn":
        fa = load_flash_attn()
        if fa is None:
            raise RuntimeError(f"{ENV}/[attention] kernel=flash-attn, but {flash_attn_unavailable()}; use auto")
        return FlashAttnBackend(fa)
    raise ValueError(f"attention kernel {name!r} cannot run on CUDA; choose one of {list(KERNELS[:-1])}")


def backend_for(device: torch.device, dtype: torch.dtype) -> BlockBackend:
    """The kernel pair used for tensors of ``dtype`` on ``device``."""
    if device.type == "cpu":
        return _backend("cpu", "cpu", dtype)
    return _backend(chosen_kernel(device), device.type, dtype)
