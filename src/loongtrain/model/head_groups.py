"""The attention layer over groups of heads, end to end (UPipe's idea: Untied Ulysses, arXiv
2602.21196; here in any hp x cp layout).

Heads are independent from the q/k/v projections to the output projection's input, so the
layer is a sum over head groups: ``wo(out) = sum_g wo[:, g](out_g)``. :func:`head_group_attention`
runs the norm's q/k/v projections (of the group's rows of ``wq``/``wk``/``wv``), the q/k norms,
RoPE, the attention and the output projection one group at a time, in forward and in
backward, so only one group's q, k, v, dout, dq, dk, dv (and the attention's buffers: the
ring's float32 partials, the all-to-alls, the kernel's workspace) exist at once. It saves the
block input, the norm's float32 ``1 / rms`` and what the attention's backward needs (its
output and log-sum-exp per group; or, ``keep=False``, nothing: backward runs each group's
attention forward again); backward recomputes each group's projections (a q/k/v-projection
forward more per layer) and adds each group's input gradient into one ``[T, dim]`` buffer.

The attention is a :class:`SplitAttention`: a forward that returns what its backward needs,
and that backward, called by hand (``loongtrain.parallelize`` wires the 2D head-context
attention's; :class:`~loongtrain.attention.local.LocalSplitAttention` is one device's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from loongtrain.attention.layout import SequenceLayout
from loongtrain.model.lean import projections_backward
from loongtrain.model.llama import Attention, apply_rope
from loongtrain.model.norm import (
    RMSNorm,
    inverse_rms,
    normalize,
    over_tiles,
    rms_norm,
    rms_norm_backward,
    row_width,
    tiles,
)
from loongtrain.parallel.layout import head_group_slices

Tensor = torch.Tensor


class SplitAttention(Protocol):
    """Attention as a forward and a backward the caller runs (no autograd in between)."""

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, layout: SequenceLayout | None, sliding_window: int | None
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """``(out [B, S, H, d], saved)``: the output and what :meth:`backward` needs besides q, k, v."""
        ...

    def output(self, saved: tuple[Tensor, ...], layout: SequenceLayout | None) -> Tensor:
        """The output again from ``saved`` (for the output projection's weight gradient)."""
        ...

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        saved: tuple[Tensor, ...],
        layout: SequenceLayout | None,
        sliding_window: int | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` for the output gradient ``dout``."""
        ...


@dataclass(frozen=True)
class _Spec:
    """What the function needs besides tensors."""

    attention: SplitAttention
    slices: list[tuple[slice, slice]]
    head_dim: int
    eps: float
    qk_eps: float
    layout: SequenceLayout | None
    sliding_window: int | None
    keep: bool  # save each group's attention output for backward (False: backward runs it again)

    def rows(self, heads: slice) -> slice:
        return slice(heads.start * self.head_dim, heads.stop * self.head_dim)


def _part(w: Tensor | None, rows: slice) -> Tensor | None:
    return None if w is None else w[rows]


def _group_qkv(spec: _Spec, g: int, x, rstd, norm_w, wq, bq, wk, bk, wv, bv):
    """The group's q, k (before their norms and RoPE) and v, [B, S, heads, d], over token tiles."""
    qh, kh = spec.slices[g]
    qr, kr = spec.rows(qh), spec.rows(kh)

    def tile(rows: slice) -> tuple[Tensor, ...]:
        h, _ = normalize(x[:, rows], rstd[:, rows], norm_w)
        return tuple(F.linear(h, w[r], _part(b, r)) for w, b, r in ((wq, bq, qr), (wk, bk, kr), (wv, bv, kr)))

    q, k, v = over_tiles(tile, x.shape[1], width=row_width(x))
    b, s, d = x.shape[0], x.shape[1], spec.head_dim
    return q.view(b, s, -1, d), k.view(b, s, -1, d), v.view(b, s, -1, d)


def _rope(t: Tensor, cos: Tensor | None, sin: Tensor | None, inverse: bool = False) -> Tensor:
    """RoPE over token tiles (``inverse``: the rotation back, its gradient); None: a NoPE layer."""
    if cos is None:
        return t
    sin = -sin if inverse else sin
    return over_tiles(
        lambda rows: (apply_rope(t[:, rows], cos[:, rows], sin[:, rows]),), t.shape[1], width=row_width(t)
    )[0]


def _normed(t: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    if weight is None:
        return t
    return over_tiles(lambda rows: (rms_norm(t[:, rows], weight, eps)[0],), t.shape[1], width=row_width(t))[0]


def _unnormed(grad: Tensor, t: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor | None]:
    """Backward of :func:`_normed` (the q/k norm over each head): ``(grad_t, float32 weight grad)``."""
    if weight is None:
        return grad, None
    out, total = torch.empty_like(t), None
    for rows in tiles(t.shape[1], width=row_width(t)):
        tt = t[:, rows]
        out[:, rows], part = rms_norm_backward(grad[:, rows], tt, weight, inverse_rms(tt, eps), True)
        total = part.float() if total is None else total + part.float()
    return out, total


class _HeadGroups(torch.autograd.Function):
    @staticmethod
    def forward(ctx, spec: _Spec, x, cos, sin, norm_w, wq, bq, wk, bk, wv, bv, wo, qn_w, kn_w):
        (rstd,) = over_tiles(lambda rows: (inverse_rms(x[:, rows], spec.eps),), x.shape[1], width=row_width(x))
        y, saved = None, []
        for g in range(len(spec.slices)):
            q, k, v = _group_qkv(spec, g, x, rstd, norm_w, wq, bq, wk, bk, wv, bv)
            q = _rope(_normed(q, qn_w, spec.qk_eps), cos, sin)
            k = _rope(_normed(k, kn_w, spec.qk_eps), cos, sin)
            out, kept = spec.attention.forward(q, k, v, spec.layout, spec.sliding_window)
            del q, k, v
            part = F.linear(out.flatten(2), wo[:, spec.rows(spec.slices[g][0])])
            del out
            y = part if y is None else y.add_(part)
            saved.append(kept if spec.keep else ())
        ctx.spec, ctx.kept_sizes = spec, [len(kept) for kept in saved]
        ctx.save_for_backward(x, cos, sin, rstd, norm_w, wq, bq, wk, bk, wv, bv, wo, qn_w, kn_w,
                              *[t for kept in saved for t in kept])  # fmt: skip
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        spec: _Spec = ctx.spec
        x, cos, sin, rstd, norm_w, wq, bq, wk, bk, wv, bv, wo, qn_w, kn_w, *flat = ctx.saved_tensors
        kept, start = [], 0
        for size in ctx.kept_sizes:
            kept.append(tuple(flat[start : start + size]))
            start += size
        del flat
        needs = ctx.needs_input_grad
        f32 = dict(dtype=torch.float32, device=x.device)
        grad_x = torch.zeros_like(x)
        grads = {"norm": None, "wo": torch.zeros(wo.shape, **f32), "qn": None, "kn": None}
        for name, w in (("wq", wq), ("bq", bq), ("wk", wk), ("bk", bk), ("wv", wv), ("bv", bv)):
            grads[name] = None if w is None else torch.zeros(w.shape, **f32)
        dy2 = dy.flatten(0, 1)
        for g in range(len(spec.slices)):
            qh, kh = spec.slices[g]
            qr, kr = spec.rows(qh), spec.rows(kh)
            q0, k0, v = _group_qkv(spec, g, x, rstd, norm_w, wq, bq, wk, bk, wv, bv)
            q = _rope(_normed(q0, qn_w, spec.qk_eps), cos, sin)
            k = _rope(_normed(k0, kn_w, spec.qk_eps), cos, sin)
            if spec.keep:
                out = spec.attention.output(kept[g], spec.layout)
            else:  # the group's attention again
                out, kept[g] = spec.attention.forward(q, k, v, spec.layout, spec.sliding_window)
            grads["wo"][:, qr] = dy2.t().mm(out.flatten(0, 1).flatten(1)).float()
            del out
            dout = F.linear(dy, wo[:, qr].t()).view(q.shape)
            dq, dk, dv = spec.attention.backward(dout, q, k, v, kept[g], spec.layout, spec.sliding_window)
            kept[g] = ()
            del dout, q, k
            dq, qn_part = _unnormed(_rope(dq, cos, sin, inverse=True), q0, qn_w, spec.qk_eps)
            dk, kn_part = _unnormed(_rope(dk, cos, sin, inverse=True), k0, kn_w, spec.qk_eps)
            del q0, k0
            grads["qn"] = _add(grads["qn"], qn_part)
            grads["kn"] = _add(grads["kn"], kn_part)
            parts = projections_backward(
                x,
                norm_w,
                rstd,
                (wq[qr], wk[kr], wv[kr]),
                (dq.flatten(2), dk.flatten(2), dv.flatten(2)),
                needs[4:11],
                grad_x,
                accumulate=True,
            )
            del dq, dk, dv
            grads["norm"] = _add(grads["norm"], parts[0])
            for name, rows, part in zip(("wq", "bq", "wk", "bk", "wv", "bv"), (qr, qr, kr, kr, kr, kr), parts[1:]):
                if part is not None and grads[name] is not None:
                    grads[name][rows] += part
        order = ["norm", "wq", "bq", "wk", "bk", "wv", "bv", "wo", "qn", "kn"]
        params = [norm_w, wq, bq, wk, bk, wv, bv, wo, qn_w, kn_w]
        typed = [None if p is None or not need else grads[name] for name, p, need in zip(order, params, needs[4:])]
        typed = [None if t is None else t.to(p.dtype) for t, p in zip(typed, params)]
        return None, grad_x, None, None, *typed


def _add(total: Tensor | None, part: Tensor | None) -> Tensor | None:
    if part is None:
        return total
    return part.float() if total is None else total + part.float()


def head_group_attention(
    module: Attention,
    x: Tensor,
    norm: RMSNorm,
    cos: Tensor | None,
    sin: Tensor | None,
    layout: SequenceLayout | None,
    groups: int,
    attention: SplitAttention,
    keep: bool = True,
) -> Tensor:
    """``module(x, norm, cos, sin, layout)`` (the attention block's output, [B, S, dim]) run
    over ``groups`` groups of heads with the split ``attention`` (see the module docstring).
    ``keep=False``: save no attention output; backward runs each group's attention forward
    again (for a layer that full checkpointing recomputes anyway: its output would otherwise
    be alive through the whole layer's backward)."""
    slices = head_group_slices(module.n_heads, module.n_kv_heads, groups)
    qk_eps = module.q_norm.eps if module.q_norm is not None else 0.0
    spec = _Spec(attention, slices, module.head_dim, norm.eps, qk_eps, layout, module.sliding_window, keep)
    qn = module.q_norm.weight if module.q_norm is not None else None
    kn = module.k_norm.weight if module.k_norm is not None else None
    return _HeadGroups.apply(
        spec, x, cos, sin, norm.weight, module.wq.weight, module.wq.bias, module.wk.weight, module.wk.bias,
        module.wv.weight, module.wv.bias, module.wo.weight, qn, kn,
    )  # fmt: skip


__all__ = ["SplitAttention", "head_group_attention", "head_group_slices"]
