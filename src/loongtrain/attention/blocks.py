"""One ring step: the block kind's attention on (local q) x (visiting kv), forward and
backward, with fp32 accumulation. Shared by the distributed ring and its single-process
replay (benchmarks, schedule tests), so both run the very same block computations.

Shapes: ``q`` [B, Sc, H, d] holds the two zigzag chunks ``[q0 | q1]`` of one context
rank; ``kv`` [2, B, Sc, G, d] stacks k and v of the visiting block ``[kv0 | kv1]``.
"""

from __future__ import annotations

import torch

from loongtrain.attention.kernels import block_backward, block_forward
from loongtrain.attention.merge import merge_into
from loongtrain.attention.schedule import BlockKind

Tensor = torch.Tensor


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for inputs of ``dtype``: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


class OutputAccumulator:
    """Running ``(out, lse)`` of one query shard in :func:`accum_dtype`, merged block by block."""

    def __init__(self) -> None:
        self.out: Tensor | None = None
        self.lse: Tensor | None = None

    def add(self, row_start: int, out_b: Tensor, lse_b: Tensor) -> None:
        if self.out is None:
            if row_start != 0:
                raise RuntimeError("the first merged block must cover every query row")
            # Kernel outputs are fresh tensors: take ownership instead of copying.
            dtype = accum_dtype(out_b.dtype)
            self.out = out_b.to(dtype)
            self.lse = lse_b.to(dtype)
            return
        rows = slice(row_start, None)
        merge_into(self.out[:, rows], self.lse[:, rows], out_b, lse_b)


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
