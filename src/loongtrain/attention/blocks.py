"""One ring step: the attention of (local q) x (visiting kv), forward and backward, with
fp32 accumulation. Shared by the distributed ring and its single-process replay
(benchmarks, schedule tests), so both run the very same block computations.

Shapes: ``q`` [B, Sc, H, d] holds one context rank's content; ``kv`` [2, B, Sc, G, d]
stacks k and v of the visiting block. Two kinds of block work:

- a :class:`BlockKind` of the plain causal/full zigzag ring (``q = [q0 | q1]``, ``kv =
  [kv0 | kv1]``): one kernel per block;
- a tuple of :class:`~loongtrain.attention.mask_plan.Call` s for document / sliding-window masks:
  one kernel per call on contiguous row and column ranges (masked only for ``band``).
"""

from __future__ import annotations

import torch

from loongtrain.attention.kernels import Band, block_backward, block_forward
from loongtrain.attention.mask_plan import BAND, CAUSAL, Call
from loongtrain.attention.merge import merge_into
from loongtrain.attention.schedule import BlockKind

Tensor = torch.Tensor


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for inputs of ``dtype``: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


class OutputAccumulator:
    """Running ``(out, lse)`` of one query shard in :func:`accum_dtype`, merged block by block.

    Rows that no block has reached yet hold ``out = 0`` and ``lse = -inf``, which the merge
    treats as "nothing seen" (the first real block replaces them exactly).
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
                dtype = accum_dtype(out_b.dtype)
                self.out = out_b.to(dtype)
                self.lse = lse_b.to(dtype)
                return
            if self._q is None:
                raise RuntimeError("the first merged block must cover every query row")
            dtype = accum_dtype(self._q.dtype)
            self.out = torch.zeros(self._q.shape, dtype=dtype, device=self._q.device)
            self.lse = torch.full(self._q.shape[:3], float("-inf"), dtype=dtype, device=self._q.device)
        merge_into(self.out[:, rows], self.lse[:, rows], out_b, lse_b)

    def result(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(out in dtype, lse)``; rows that saw nothing (only possible for an empty mask) are 0."""
        return self.out.to(dtype), self.lse


def forward_block(q: Tensor, kv: Tensor, kind: BlockKind, scale: float, acc: OutputAccumulator) -> None:
    """Compute the block of ``kind`` and merge it into ``acc``."""
    half = q.shape[1] // 2
    k, v = kv[0], kv[1]
    if kind is BlockKind.DIAGONAL:
        out, lse = block_forward(q, k, v, causal=True, scale=scale)
        acc.add(0, out, lse)
    elif kind is BlockKind.FULL:
        out, lse = block_forward(q, k, v, causal=False, scale=scale)
        acc.add(0, out, lse)
    elif kind is BlockKind.KV_FIRST_HALF:
        out, lse = block_forward(q, k[:, :half], v[:, :half], causal=False, scale=scale)
        acc.add(0, out, lse)
    else:  # Q_SECOND_HALF
        out, lse = block_forward(q[:, half:], k, v, causal=False, scale=scale)
        acc.add(half, out, lse)


def backward_block(
    dout: Tensor,
    q: Tensor,
    kv: Tensor,
    out: Tensor,
    lse: Tensor,
    kind: BlockKind,
    scale: float,
    dq_acc: Tensor,
) -> tuple[slice, Tensor, Tensor]:
    """Gradients of one block: adds dq into ``dq_acc`` (fp32), returns ``(kv_rows, dk, dv)``.

    ``out``/``lse`` are the final (fully merged) results of the local query rows.
    """
    half = q.shape[1] // 2
    k, v = kv[0], kv[1]
    if kind is BlockKind.Q_SECOND_HALF:
        rows = slice(half, None)
        dq, dk, dv = block_backward(
            dout[:, rows], q[:, rows], k, v, out[:, rows], lse[:, rows], causal=False, scale=scale
        )
        dq_acc[:, rows] += dq
        return slice(None), dk, dv
    if kind is BlockKind.KV_FIRST_HALF:
        dq, dk, dv = block_backward(dout, q, k[:, :half], v[:, :half], out, lse, causal=False, scale=scale)
        dq_acc += dq
        return slice(0, half), dk, dv
    causal = kind is BlockKind.DIAGONAL
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
    dq_acc += dq
    return slice(None), dk, dv


def add_kv_grad(dkv_acc: Tensor, kv_rows: slice, dk: Tensor, dv: Tensor) -> None:
    """Add a block's ``dk``/``dv`` into the fp32 ``dkv_acc`` [2, B, Sc, G, d]."""
    dkv_acc[0, :, kv_rows] += dk
    dkv_acc[1, :, kv_rows] += dv


def call_band(call: Call, causal: bool, sliding_window: int | None) -> Band | None:
    """The :class:`~loongtrain.attention.kernels.Band` of a ``band`` call (None for the others):
    visible where ``j <= i`` (causal) and ``|i - j| < sliding_window``."""
    if call.kind != BAND:
        return None
    return Band(call.q_start - call.k_start, sliding_window, causal)


def _call_inputs(call: Call, causal: bool, sliding_window: int | None):
    return slice(call.row0, call.row1), slice(call.col0, call.col1), call_band(call, causal, sliding_window)


def forward_calls(
    q: Tensor, kv: Tensor, calls: tuple[Call, ...], causal: bool, sliding_window: int | None, scale: float, acc
) -> None:
    """Run the calls of one masked block and merge them into ``acc``."""
    k, v = kv[0], kv[1]
    for call in calls:
        rows, cols, band = _call_inputs(call, causal, sliding_window)
        out, lse = block_forward(q[:, rows], k[:, cols], v[:, cols], causal=call.kind == CAUSAL, scale=scale, band=band)
        acc.add(call.row0, out, lse, call.row1)


KvGrads = list[tuple[slice, Tensor, Tensor]]  # (key/value rows, dk, dv) to add into the block's gradient


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
    for call in calls:
        rows, cols, band = _call_inputs(call, causal, sliding_window)
        dq, dk, dv = block_backward(
            dout[:, rows], q[:, rows], k[:, cols], v[:, cols], out[:, rows], lse[:, rows],
            causal=call.kind == CAUSAL, scale=scale, band=band,
        )  # fmt: skip
        dq_acc[:, rows] += dq
        grads.append((cols, dk, dv))
    return grads


BlockWork = BlockKind | tuple[Call, ...]


def forward_work(
    q: Tensor,
    kv: Tensor,
    work: BlockWork,
    causal: bool,
    sliding_window: int | None,
    scale: float,
    acc: OutputAccumulator,
) -> bool:
    """Run one block's work (a zigzag :class:`BlockKind` or masked calls); False if there was none."""
    if isinstance(work, BlockKind):
        forward_block(q, kv, work, scale, acc)
        return True
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
    if isinstance(work, BlockKind):
        return [backward_block(dout, q, kv, out, lse, work, scale, dq_acc)]
    if not work:
        return []
    return backward_calls(dout, q, kv, out, lse, work, causal, sliding_window, scale, dq_acc)


def add_kv_grads(dkv_acc: Tensor, grads: KvGrads) -> None:
    """Add the pieces returned by :func:`backward_work` into ``dkv_acc`` [2, B, Sc, G, d]."""
    for rows, dk, dv in grads:
        add_kv_grad(dkv_acc, rows, dk, dv)
