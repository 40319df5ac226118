"""The ``flash_attn`` package (FlashAttention 2.7 or newer) where it is installed: fp16/bf16 on
CUDA, a band as its window, an arbitrary mask on PyTorch's SDPA.

Its public functions run their own backward from their own output, so the private
``_flash_attn_forward`` / ``_backward`` (the only ones that return the log-sum-exp needed to merge
partial results) are called here and nowhere else, by keyword, checked against the installed
version's signature.
"""

from __future__ import annotations

import inspect

import torch

from loongtrain.attention.backends.sdpa import CudaSdpaBackend


class FlashAttnBackend:
    """The ``flash_attn`` package (2.7 or newer): fp16/bf16 on CUDA, head dim % 8 == 0; a band
    as its window, an arbitrary mask on PyTorch's SDPA."""

    name = "flash-attn"
    dtypes = (torch.float16, torch.bfloat16)
    takes_window = True
    varlen = None
    other_shapes = None

    def __init__(self, module) -> None:
        self._fa = module
        self._masked = CudaSdpaBackend()  # flash_attn takes no arbitrary mask

    def forward(self, q, k, v, causal, scale, mask=None, window=None):
        if mask is not None:
            return self._masked.forward(q, k, v, causal, scale, mask)
        left, right = window if window is not None else (-1, -1)
        res = self._fa._flash_attn_forward(
            q.contiguous(), k.contiguous(), v.contiguous(), dropout_p=0.0, softmax_scale=scale, causal=causal,
            window_size_left=left, window_size_right=right, softcap=0.0, alibi_slopes=None, return_softmax=False,
        )  # fmt: skip
        return res[0], res[1].transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None, window=None):
        if mask is not None:
            return self._masked.backward(dout, q, k, v, out, lse, causal, scale, mask)
        left, right = window if window is not None else (-1, -1)
        q, k, v, out, dout = (x.contiguous() for x in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fa._flash_attn_backward(
            dout, q, k, v, out, lse.transpose(1, 2).contiguous(), dq, dk, dv, dropout_p=0.0, softmax_scale=scale,
            causal=causal, window_size_left=left, window_size_right=right, softcap=0.0, alibi_slopes=None,
            deterministic=False, rng_state=None,
        )  # fmt: skip
        return dq, dk, dv


#: The keyword arguments the calls above pass (flash_attn 2.7 and 2.8 take these names).
FLASH_FORWARD_ARGS = frozenset({"dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right",
                                "softcap", "alibi_slopes", "return_softmax"})  # fmt: skip
FLASH_BACKWARD_ARGS = frozenset({"dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right",
                                 "softcap", "alibi_slopes", "deterministic", "rng_state"})  # fmt: skip


def parameter_names(fn) -> frozenset[str]:
    """Parameter names of ``fn``; of the Python function a ``torch.library.custom_op`` wraps
    (flash_attn 2.7+ registers its kernels as custom ops, whose own ``__call__`` takes
    ``*args, **kwargs``)."""
    fn = getattr(fn, "_init_fn", fn)
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


def flash_attn_incompatibility(module) -> str | None:
    """Why the ``flash_attn`` interface ``module`` cannot be called as above, or None."""
    for fn_name, needed in (("_flash_attn_forward", FLASH_FORWARD_ARGS), ("_flash_attn_backward", FLASH_BACKWARD_ARGS)):
        fn = getattr(module, fn_name, None)
        if fn is None:
            return f"flash_attn has no {fn_name}"
        missing = needed - parameter_names(fn)
        if missing:
            return f"flash_attn's {fn_name} takes no {', '.join(sorted(missing))} (2.7 or newer needed)"
    return None


def flash_attn_unavailable() -> str | None:
    """Why ``flash_attn`` is not used (not importable, or a version these calls do not fit), or None."""
    try:
        from flash_attn import flash_attn_interface as fa
    except ModuleNotFoundError:
        return "flash_attn>=2.7 is not installed (pip install flash-attn to use it)"
    except Exception as e:  # installed but broken (e.g. built for another torch)
        return f"flash_attn does not import ({type(e).__name__}: {e})"
    return flash_attn_incompatibility(fa)


def load_flash_attn():
    """The flash_attn interface module if a compatible version is installed, else None."""
    if flash_attn_unavailable() is not None:
        return None
    from flash_attn import flash_attn_interface as fa

    return fa
