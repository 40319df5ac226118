"""One ring step: the attention of (local q) x (visiting kv), forward and backward, with
fp32 accumulation. Shared by the distributed ring and its single-process replay
(benchmarks, schedule tests), so both run the very same block computations.

Shapes: ``q`` [B, Sc, H, d] holds one context rank's content; ``kv`` [2, B, Sc, G, d]
stacks k and v of the visiting block. A block's work is a tuple of
:class:`~loongtrain.attention.mask_plan.Call` s from the layout's :class:`MaskPlan`: one kernel
per call on contiguous row and column ranges (masked only for ``band``). The plain causal ring
is the plan of one zigzag document, whose calls are the zigzag's one kernel per block (the
diagonal's causal square, the first key half, or the second query half). Where the kernel has a
variable-length form (CUDA) and a block has several calls or a band (packed documents, sliding
windows), the calls run as a few variable-length calls instead
(:func:`~loongtrain.attention.varlen_plan.varlen_calls`): as many launches for 1 document as for 100.
"""

from __future__ import annotations

import torch

from loongtrain.attention.kernels import (
    Band,
    Packed,
    backend_for,
    block_backward,
    block_forward,
    varlen_backward,
    varlen_forward,
)
from loongtrain.attention.mask_plan import BAND, CAUSAL, Call
from loongtrain.attention.merge import merge_into
from loongtrain.attention.varlen_plan import varlen_calls

Tensor = torch.Tensor


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for inputs of ``dtype``: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


class OutputAccumulator:
    """Running ``(out, lse)`` of one query shard in :func:`accum_dtype`, merged block by block.

    Rows that no block has reached yet hold ``out = 0`` and ``lse = -inf``, which the merge
    treats as "nothing seen" (the first real block replaces them exactly). A first block that
    covers every row is kept as the kernel returned it, in its own dtype, until a second block
    merges into it: a shard of one call (one device, one causal block) never round-trips its
    output through float32.
    """

    def __init__(self, q: Tensor | None = None) -> None:
        self.out: Tensor | None = None
        self.lse: Tensor | None = None
        self._q = q

    def add(self, row_start: int, out_b: Tensor, lse_b: Tensor, row_stop: int | None = None) -> None:
        rows = slice(row_start, row_stop)
        if self.out is None:
            covers_all = row_start == 0 and (self._q is None or out_b.shape[1] == self._q.shape[1])
            if covers_all:  # kernel outputs are fresh tensors: take ownership instead of copying
                self.out = out_b
                self.lse = lse_b.to(accum_dtype(out_b.dtype))
                return
            self._allocate()
        self._accumulating()
        merge_into(self.out[:, rows], self.lse[:, rows], out_b, lse_b)

    def _accumulating(self) -> None:
        """The output in :func:`accum_dtype` before a merge (a first block kept in its own dtype)."""
        dtype = accum_dtype(self.out.dtype)
        if self.out.dtype != dtype:
            self.out = self.out.to(dtype)

    def _allocate(self) -> None:
        """Rows that nothing has reached: ``out = 0``, ``lse = -inf``."""
        if self._q is None:
            raise RuntimeError("the first merged block must cover every query row")
        dtype = accum_dtype(self._q.dtype)
        self.out = torch.zeros(self._q.shape, dtype=dtype, device=self._q.device)
        self.lse = torch.full(self._q.shape[:3], float("-inf"), dtype=dtype, device=self._q.device)

    def add_packed(self, p: Packed, out_b: Tensor, lse_b: Tensor) -> None:
        """Merge a variable-length call's packed ``out_b`` [T, H, d] / ``lse_b`` [T, H] into its rows."""
        if p.row_span is not None:
            self.add(p.row_span[0], out_b.unsqueeze(0), lse_b.unsqueeze(0), p.row_span[1])
            return
        if self.out is None:
            self._allocate()
        self._accumulating()
        index = p.row_index
        out, lse = self.out[0].index_select(0, index), self.lse[0].index_select(0, index)
        merge_into(out, lse, out_b, lse_b)
        self.out[0].index_copy_(0, index, out)
        self.lse[0].index_copy_(0, index, lse)

    def result(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(out in dtype, lse)``; rows that saw nothing (only possible for an empty mask) are 0. A
        shard of one block's output comes back as the kernel returned it (no copy)."""
        return self.out.to(dtype), self.lse


def call_band(call: Call, causal: bool, sliding_window: int | None) -> Band | None:
    """The :class:`~loongtrain.attention.kernels.Band` of a ``band`` call (None for the others):
    visible where ``j <= i`` (causal) and ``|i - j| < sliding_window``."""
    if call.kind != BAND:
        return None
    return Band(call.q_start - call.k_start, sliding_window, causal)


def _call_inputs(call: Call, causal: bool, sliding_window: int | None):
    return slice(call.row0, call.row1), slice(call.col0, call.col1), call_band(call, causal, sliding_window)


def runs_varlen(q: Tensor, calls: tuple[Call, ...]) -> bool:
    """Whether a block's ``calls`` run as variable-length calls: the kernel has that form, the
    batch is one packed row, and there is more than one call or a band."""
    if q.shape[0] != 1 or not (len(calls) > 1 or any(c.kind == BAND for c in calls)):
        return False
    return backend_for(q.device, q.dtype).varlen is not None


def forward_calls(
    q: Tensor, kv: Tensor, calls: tuple[Call, ...], causal: bool, sliding_window: int | None, scale: float, acc
) -> None:
    """Run the calls of one masked block and merge them into ``acc``."""
    k, v = kv[0], kv[1]
    if runs_varlen(q, calls):
        for call in varlen_calls(calls, causal, sliding_window):
            acc.add_packed(*varlen_forward(q, k, v, call, scale))
        return
    for call in calls:
        rows, cols, band = _call_inputs(call, causal, sliding_window)
        out, lse = block_forward(q[:, rows], k[:, cols], v[:, cols], causal=call.kind == CAUSAL, scale=scale, band=band,
                                 block=q.shape[1])  # fmt: skip
        acc.add(call.row0, out, lse, call.row1)


KvGrads = list[tuple[slice | Tensor, Tensor, Tensor]]  # (key/value rows or their index, dk, dv) to add


def backward_calls(
    dout: Tensor,
    q: Tensor,
    kv: Tensor,
    out: Tensor,
    lse: Tensor,
    calls: tuple[Call, ...],
    causal: bool,
    sliding_window: int | None,
    scale: float,
    dq_acc: Tensor,
) -> KvGrads:
    """Gradients of one masked block: adds dq into ``dq_acc`` (fp32), returns the dk/dv pieces."""
    k, v = kv[0], kv[1]
    grads: KvGrads = []
    if runs_varlen(q, calls):
        for call in varlen_calls(calls, causal, sliding_window):
            p, dq, dk, dv = varlen_backward(dout, q, k, v, out, lse, call, scale)
            if p.row_span is not None:
                dq_acc[0, p.row_span[0] : p.row_span[1]] += dq
            else:
                dq_acc[0].index_add_(0, p.row_index, dq.to(dq_acc.dtype))
            span = p.col_span
            grads.append((slice(*span) if span is not None else p.col_index, dk.unsqueeze(0), dv.unsqueeze(0)))
        return grads
    for call in calls:
        rows, cols, band = _call_inputs(call, causal, sliding_window)
        dq, dk, dv = block_backward(
            dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows], lse[:, rows],
            causal=call.kind == CAUSAL, scale=scale, band=band, block=q.shape[1],
        )  # fmt: skip
        dq_acc[:, rows] += dq
        grads.append((cols, dk, dv))
    return grads


BlockWork = tuple[Call, ...]


def forward_work(
    q: Tensor,
    kv: Tensor,
    work: BlockWork,
    causal: bool,
    sliding_window: int | None,
    scale: float,
    acc: OutputAccumulator,
) -> bool:
    """Run one block's calls and merge them into ``acc``; False if there were none."""
    if not work:  # nothing visible (the block may not even have come this far: ``kv`` None)
        return False
    forward_calls(q, kv, work, causal, sliding_window, scale, acc)
    return True


def backward_work(
    dout: Tensor,
    q: Tensor,
    kv: Tensor,
    out: Tensor,
    lse: Tensor,
    work: BlockWork,
    causal: bool,
    sliding_window: int | None,
    scale: float,
    dq_acc: Tensor,
) -> KvGrads:
    """Gradients of one block's work: dq into ``dq_acc``; returns the dk/dv pieces (empty: no work)."""
    if not work:
        return []
    return backward_calls(dout, q, kv, out, lse, work, causal, sliding_window, scale, dq_acc)


def add_kv_grads(dkv_acc: Tensor, grads: KvGrads) -> None:
    """Add the pieces returned by :func:`backward_work` into ``dkv_acc`` [2, B, Sc, G, d]."""
    for rows, dk, dv in grads:
        if isinstance(rows, slice):
            dkv_acc[0, :, rows] += dk
            dkv_acc[1, :, rows] += dv
        else:  # a gather's index (its rows may repeat): added row by row
            dkv_acc[0].index_add_(1, rows, dk.to(dkv_acc.dtype))
            dkv_acc[1].index_add_(1, rows, dv.to(dkv_acc.dtype))


def whole_block(work: BlockWork, rows: int) -> bool | None:
    """For work that is one unmasked call over every row and column of a ``rows``-row block:
    whether that call is causal; else None."""
    if len(work) != 1:
        return None
    (call,) = work
    if (call.row0, call.row1, call.col0, call.col1) != (0, rows, 0, rows) or call.kind == BAND:
        return None
    return call.kind == CAUSAL
