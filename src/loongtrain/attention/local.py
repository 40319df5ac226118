"""Document / sliding-window attention on one device (no process group).

The unsharded model's attention under a packed-document or sliding-window mask: the whole
sequence is one block, cut into the same kernel calls as a context rank's own block in
the ring (:mod:`mask_plan`), so no kernel computes across documents. Every row of the
batch shares the layout's documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongtrain.attention.blocks import OutputAccumulator, accum_dtype, add_kv_grads, backward_calls, forward_calls
from loongtrain.attention.documents import check_sliding_window
from loongtrain.attention.layout import SequenceLayout, sequence_layout

Tensor = torch.Tensor


def _attend(q: Tensor, k: Tensor, v: Tensor, calls, causal: bool, sliding_window, scale: float):
    acc = OutputAccumulator(q)
    forward_calls(q, (k, v), calls, causal, sliding_window, scale, acc)
    return acc.result(q.dtype)


def _attend_backward(dout, q, k, v, out, lse, calls, causal: bool, sliding_window, scale: float):
    dq = torch.zeros(q.shape, dtype=accum_dtype(q.dtype), device=q.device)
    dkv = torch.zeros((2, *k.shape), dtype=accum_dtype(k.dtype), device=k.device)
    grads = backward_calls(dout.contiguous(), q, (k, v), out, lse, calls, causal, sliding_window, scale, dq)
    add_kv_grads(dkv, grads)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _MaskedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, calls, causal, sliding_window, scale):
        out, lse = _attend(q, k, v, calls, causal, sliding_window, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.calls, ctx.causal, ctx.sliding_window, ctx.scale = calls, causal, sliding_window, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = _attend_backward(dout, q, k, v, out, lse, ctx.calls, ctx.causal, ctx.sliding_window, ctx.scale)
        return *grads, None, None, None, None


def _calls(seq_len: int, layout: SequenceLayout | None, sliding_window: int | None, causal: bool):
    """The kernel calls of one device's whole-sequence block and the window they use."""
    sliding_window = check_sliding_window(sliding_window)
    if layout is None:
        layout = sequence_layout(seq_len)
    elif layout.sp != 1 or layout.seq_len != seq_len:
        raise ValueError(
            f"masked_attention runs on one device over the whole sequence of {seq_len} tokens, but the layout is "
            f"for S={layout.seq_len} on hp={layout.hp} x cp={layout.cp}; use sequence_layout(S, None, cu_seqlens)"
        )
    plan = layout.mask_plan(causal, sliding_window)
    return plan.calls(0, 0), plan.sliding_window


@dataclass(frozen=True)
class LocalSplitAttention:
    """:func:`masked_attention` as a forward and a backward the caller runs
    (:class:`~loongtrain.model.head_groups.SplitAttention`): one device, the whole sequence."""

    causal: bool = True
    softmax_scale: float | None = None

    def forward(self, q, k, v, layout=None, sliding_window=None) -> tuple[Tensor, tuple[Tensor, ...]]:
        calls, window = _calls(q.shape[1], layout, sliding_window, self.causal)
        out, lse = _attend(q, k, v, calls, self.causal, window, self._scale(q))
        return out, (out, lse)

    def output(self, saved: tuple[Tensor, ...], layout: SequenceLayout | None = None) -> Tensor:
        return saved[0]

    def backward(self, dout, q, k, v, saved, layout=None, sliding_window=None) -> tuple[Tensor, Tensor, Tensor]:
        calls, window = _calls(q.shape[1], layout, sliding_window, self.causal)
        out, lse = saved
        return _attend_backward(dout, q, k, v, out, lse, calls, self.causal, window, self._scale(q))

    def _scale(self, q: Tensor) -> float:
        return self.softmax_scale if self.softmax_scale is not None else q.shape[-1] ** -0.5


def masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout: SequenceLayout | None = None,
    sliding_window: int | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> Tensor:
    """Attention of ``q`` [B, S, H, d] over ``k``/``v`` [B, S, G, d] within the documents of
    ``layout`` (a one-device layout: ``sequence_layout(S, None, cu_seqlens)``) and a sliding
    window; returns [B, S, H, d]."""
    calls, sliding_window = _calls(q.shape[1], layout, sliding_window, causal)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return _MaskedAttention.apply(q, k, v, calls, causal, sliding_window, scale)
