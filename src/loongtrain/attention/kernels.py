"""Local block attention returning the log-sum-exp, and its backward: the one interface the rest
of the code calls (:func:`block_forward` / :func:`block_backward`, and for packed pieces
:func:`varlen_forward` / :func:`varlen_backward`); the kernels themselves live in
:mod:`loongtrain.attention.backends`, one module each, chosen there.

Layout convention: ``q`` is ``[B, Sq, H, d]``, ``k``/``v`` are ``[B, Sk, G, d]`` with ``H % G == 0``
(query head ``h`` uses key/value head ``h // (H // G)``), ``out`` is ``[B, Sq, H, d]`` in the
input dtype and ``lse`` is ``[B, Sq, H]`` in float32 (float64 for float64 inputs), natural
log, scale included. ``causal`` masks top-left aligned (query ``i`` sees keys ``j <= i``).
``band`` (optional, the sliding-window edges of document / window masks) is a :class:`Band`: a
kernel that takes a window runs it as one, the others with the band's additive float
``[Sq, Sk]`` mask (0 visible, -inf hidden); every row must see at least one key.

The aten ``_scaled_dot_product_*`` and ``_flash_attention_*`` ops are private PyTorch API, and so
are ``flash_attn``'s ``_flash_attn_forward`` / ``_backward``: they are the only kernels that return
the log-sum-exp needed to merge partial results, so they are wrapped in the backends and nowhere
else.
"""

from __future__ import annotations

import functools
import itertools

import torch

from loongtrain.attention.backends import (
    Band,
    BlockBackend,
    CpuFlashBackend,
    CudaSdpaBackend,
    CudnnBackend,
    Fa2Backend,
    FlashAttnBackend,
    VarlenCall,
    Window,
    backend_for,
    repeating_shape,
)
from loongtrain.attention.backends.flash_attn import (
    FLASH_BACKWARD_ARGS,
    FLASH_FORWARD_ARGS,
    flash_attn_incompatibility,
    flash_attn_unavailable,
    parameter_names,
)
from loongtrain.attention.backends.sdpa import EFFICIENT_LSE_ALIGN, efficient_lse
from loongtrain.attention.mask_plan import MAX_BAND_TILE
from loongtrain.attention.varlen_plan import contiguous_span
from loongtrain.attention.workspace import backward_heads_per_call

__all__ = [
    "EFFICIENT_LSE_ALIGN", "FLASH_BACKWARD_ARGS", "FLASH_FORWARD_ARGS", "Band", "BlockBackend", "CpuFlashBackend",
    "CudaSdpaBackend", "CudnnBackend", "Fa2Backend", "FlashAttnBackend", "Packed", "VarlenCall", "Window",
    "backend_for", "band_inputs", "band_tile", "block_backward", "block_forward", "check_supported",
    "dense_backend", "efficient_lse", "flash_attn_incompatibility", "flash_attn_unavailable", "host_to_device",
    "parameter_names", "varlen_backward", "varlen_forward",
]  # fmt: skip

Tensor = torch.Tensor


def check_supported(device: torch.device, dtype: torch.dtype) -> None:
    """Raise a clear error if no kernel handles ``dtype`` on ``device``."""
    backend = backend_for(device, dtype)
    if dtype not in backend.dtypes:
        raise TypeError(
            f"loongtrain: dtype {dtype} is not supported by the {backend.name} attention kernel "
            f"on {device.type}; use one of {[str(d) for d in backend.dtypes]}"
        )


def band_tile(device: torch.device, dtype: torch.dtype) -> int:
    """Rows of a band call in the mask plan for the kernel of ``dtype`` on ``device``: 0 (untiled)
    where it takes the band as its window, else :data:`~loongtrain.attention.mask_plan.MAX_BAND_TILE`
    (a mask per tile)."""
    return 0 if backend_for(device, dtype).takes_window else MAX_BAND_TILE


def band_inputs(
    backend: BlockBackend,
    band: Band | None,
    sq: int,
    sk: int,
    dtype: torch.dtype,
    device: torch.device,
    mask: Tensor | None = None,
) -> tuple[Tensor | None, Window | None]:
    """``(mask, window)`` that ``backend`` takes for ``band``: its window where the backend
    takes one and the band has one, else its mask; with no band, ``mask`` as it is."""
    if band is None:
        return mask, None
    if mask is not None:
        raise ValueError("block attention takes a band or a mask, not both")
    if backend.takes_window:
        window = band.flash_window(sq, sk)
        if window is not None:
            return None, window
    return band.mask(sq, sk, dtype, device), None


def dense_backend(q: Tensor, k: Tensor, block: int | None = None) -> BlockBackend:
    """The kernel pair of one dense call of ``q``'s rows against ``k``'s, cut from a block of
    ``block`` rows (None: the call is the whole block): the chosen kernel's, except that a kernel
    that builds a graph per new shape (cuDNN) gets only the block's standard shapes
    (:func:`~loongtrain.attention.backends.repeating_shape`) and every other call goes to its
    ``other_shapes`` pair. Decided from the shapes alone, on the host."""
    backend = backend_for(q.device, q.dtype)
    rows, cols = q.shape[1], k.shape[1]
    if backend.other_shapes is not None and not repeating_shape(rows, cols, rows if block is None else block):
        return backend.other_shapes
    return backend


def block_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    scale: float,
    band: Band | None = None,
    mask: Tensor | None = None,
    block: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of a query block against a key/value block: ``(out, lse)``; under a sliding-
    window ``band`` or an arbitrary additive ``mask`` [Sq, Sk] (one of them). ``block``: the rows
    of the block the call is cut from (None: the call is the whole block), for
    :func:`dense_backend`."""
    backend = dense_backend(q, k, block)
    mask, window = band_inputs(backend, band, q.shape[1], k.shape[1], q.dtype, q.device, mask)
    return backend.forward(q, k, v, causal, scale, mask, window)


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
    band: Band | None = None,
    mask: Tensor | None = None,
    stacked: bool = False,
    block: int | None = None,
) -> tuple[Tensor, ...]:
    """Gradients ``(dq, dk, dv)`` of one block given the *final* ``out`` and ``lse`` rows;
    with ``stacked``, ``(dq, dkv)``: dk and dv as one ``[2, *k.shape]`` tensor; ``block`` as for
    :func:`block_forward` (the same kernel pair runs both).

    With ``out``/``lse`` of the full (merged) attention, the block's probabilities are
    the global ones, so summing the returned gradients over blocks gives the exact
    gradient of the whole attention. A block of many rows runs over groups of heads
    (:func:`~loongtrain.attention.workspace.backward_heads_per_call`), which bounds the
    kernel's own workspace; heads are independent, so the gradients are the same. Over head
    groups each call's dk/dv go straight into their place in the stacked tensor (one call
    returns them apart, and stacking copies them).
    """
    backend = dense_backend(q, k, block)
    b, rows, heads, _ = q.shape
    groups = k.shape[2]
    mask, window = band_inputs(backend, band, rows, k.shape[1], q.dtype, q.device, mask)
    per_call = backward_heads_per_call(b * rows, heads, groups)

    def call(qh: slice, kh: slice) -> tuple[Tensor, Tensor, Tensor]:
        return backend.backward(dout[..., qh, :], q[..., qh, :], k[..., kh, :], v[..., kh, :], out[..., qh, :],
                                lse[..., qh], causal, scale, mask, window)  # fmt: skip

    return over_head_groups(call, q, k, per_call, stacked)


def over_head_groups(call, q: Tensor, k: Tensor, per_call: int, stacked: bool) -> tuple[Tensor, ...]:
    """A backward over groups of ``per_call`` query heads (heads on dim -2 of ``q`` and ``k``):
    ``call(query heads, key/value heads)`` gives one group's ``(dq, dk, dv)``. Returns ``(dq, dk, dv)``,
    or with ``stacked`` ``(dq, dkv)`` (dk and dv as one ``[2, *k.shape]`` tensor)."""
    heads, groups = q.shape[-2], k.shape[-2]
    if per_call == heads:
        dq, dk, dv = call(slice(None), slice(None))
        return (dq, torch.stack((dk, dv))) if stacked else (dq, dk, dv)
    dq, dkv = torch.empty_like(q), k.new_empty((2, *k.shape))
    dk, dv = dkv[0], dkv[1]
    ratio = heads // groups
    if per_call >= ratio:  # whole key/value groups a call
        kv_per_call = per_call // ratio
        for g in range(0, groups, kv_per_call):
            qh, kh = slice(g * ratio, (g + kv_per_call) * ratio), slice(g, g + kv_per_call)
            dq[..., qh, :], dk[..., kh, :], dv[..., kh, :] = call(qh, kh)
    else:
        for g in range(groups):  # part of one group a call: its dk/dv summed in fp32, as the kernel's GQA sum does
            kh = slice(g, g + 1)
            sums = torch.zeros((2, *dk[..., kh, :].shape), dtype=torch.promote_types(k.dtype, torch.float32),
                               device=k.device)  # fmt: skip
            for h in range(g * ratio, (g + 1) * ratio, per_call):
                qh = slice(h, h + per_call)
                dq[..., qh, :], dk_part, dv_part = call(qh, kh)
                sums[0] += dk_part
                sums[1] += dv_part
            dk[..., kh, :], dv[..., kh, :] = sums[0], sums[1]
    return (dq, dkv) if stacked else (dq, dk, dv)


# -- packed pieces: one variable-length call ----------------------------------------------


class Packed:
    """Where a variable-length call's packed rows come from in a block (batch 1): each side a
    contiguous ``span`` (a view, no copy) or an ``index`` (a gather), with the int32 offsets.

    Made on the host and sent with at most two copies that do not block it (:func:`host_to_device`):
    both sides' offsets in one int32 tensor, both sides' indices in one int64 tensor."""

    def __init__(self, call: VarlenCall, device: torch.device) -> None:
        rows = [(p.row0, p.row1) for p in call.pieces]
        cols = [(p.col0, p.col1) for p in call.pieces]
        self.row_span, self.col_span = contiguous_span(rows), contiguous_span(cols)
        q_lens, k_lens = [b - a for a, b in rows], [b - a for a, b in cols]
        offsets = [0, *itertools.accumulate(q_lens), 0, *itertools.accumulate(k_lens)]
        cu = host_to_device(torch.tensor(offsets, dtype=torch.int32), device)
        self.cu_q, self.cu_k = cu[: len(rows) + 1], cu[len(rows) + 1 :]
        self.max_q, self.max_k = max(q_lens), max(k_lens)
        gathers = [r for r, span in ((rows, self.row_span), (cols, self.col_span)) if span is None]
        index = host_to_device(torch.cat([_index(r) for r in gathers]), device) if gathers else None
        n_rows = sum(q_lens) if self.row_span is None else 0
        self.row_index = None if self.row_span else index[:n_rows]
        self.col_index = None if self.col_span else index[n_rows:]

    def rows(self, x: Tensor) -> Tensor:
        """The packed query-side rows of ``x`` [1, S, ...] -> [T, ...]."""
        return _take(x, self.row_span, self.row_index)

    def cols(self, x: Tensor) -> Tensor:
        """The packed key-side rows of ``x`` [1, S, ...] -> [T, ...]."""
        return _take(x, self.col_span, self.col_index)


def _index(ranges: list[tuple[int, int]]) -> Tensor:
    return torch.cat([torch.arange(a, b) for a, b in ranges])


def pins_for(device: torch.device) -> bool:
    """Whether host tensors bound for ``device`` go through pinned memory: ``device`` is this
    process's accelerator (CUDA here); never without one."""
    if device.type in ("cpu", "meta") or not torch.accelerator.is_available():
        return False
    return torch.accelerator.current_accelerator().type == device.type


def host_to_device(x: Tensor, device: torch.device) -> Tensor:
    """``x``, a new host tensor, on ``device`` without blocking the host: copied from pinned memory
    with ``non_blocking=True`` where ``device`` is the accelerator (the caching host allocator keeps
    the pinned block until the copy is done); ``x`` itself on the CPU."""
    if device.type == "cpu":
        return x
    if pins_for(device):
        x = x.pin_memory()
    return x.to(device, non_blocking=True)


def _take(x: Tensor, span: tuple[int, int] | None, index: Tensor | None) -> Tensor:
    if span is not None:
        return x[0, span[0] : span[1]]
    return x[0].index_select(0, index)


@functools.lru_cache(maxsize=1024)
def packed(call: VarlenCall, device: torch.device) -> Packed:
    """The packing of ``call`` on ``device`` (cached: the same plan calls come back every layer)."""
    return Packed(call, device)


def varlen_forward(q: Tensor, k: Tensor, v: Tensor, call: VarlenCall, scale: float) -> tuple[Packed, Tensor, Tensor]:
    """One variable-length call over ``call``'s pieces of a block (batch 1): ``(packing, out [T, H, d],
    lse [T, H])``."""
    backend = backend_for(q.device, q.dtype)
    p = packed(call, q.device)
    out, lse = backend.varlen.forward(p.rows(q), p.cols(k), p.cols(v), p.cu_q, p.cu_k, p.max_q, p.max_k, call.causal,
                                      scale, call.window)  # fmt: skip
    return p, out, lse.transpose(0, 1)


def varlen_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, call: VarlenCall, scale: float
) -> tuple[Packed, Tensor, Tensor, Tensor]:
    """Gradients of one variable-length call given the block's final ``out`` and ``lse`` rows:
    ``(packing, dq [Tq, H, d], dk [Tk, G, d], dv [Tk, G, d])``; over groups of heads as
    :func:`block_backward`."""
    backend = backend_for(q.device, q.dtype)
    p = packed(call, q.device)
    pq, pk, pv, pout, pdout = p.rows(q), p.cols(k), p.cols(v), p.rows(out), p.rows(dout)
    plse = p.rows(lse)  # [Tq, H]
    per_call = backward_heads_per_call(pq.shape[0], pq.shape[1], pk.shape[1])

    def one(qh: slice, kh: slice) -> tuple[Tensor, Tensor, Tensor]:
        return backend.varlen.backward(
            pdout[:, qh], pq[:, qh], pk[:, kh], pv[:, kh], pout[:, qh], plse[:, qh].transpose(0, 1), p.cu_q, p.cu_k,
            p.max_q, p.max_k, call.causal, scale, call.window,
        )  # fmt: skip

    dq, dk, dv = over_head_groups(one, pq, pk, per_call, stacked=False)
    return p, dq, dk, dv
