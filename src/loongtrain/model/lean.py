"""Memory-lean versions of the model's pieces, which ``loongtrain.parallelize`` swaps in for
the plain formulas of :mod:`loongtrain.model.llama` (each is tested equal to its formula):

- :func:`lean_normed_projections`: RMSNorm and the q, k, v projections as one function that
  saves only the norm's input (the block input, kept anyway) and its float32 ``1 / rms``: the
  normalised input, ``[T, dim]``, never exists for the whole sequence;
- :func:`tiled_rope`: RoPE saving only cos/sin, its float32 temporaries (several times the
  size of ``x``) alive for one tile at a time.

Both run over token tiles (:func:`~loongtrain.model.norm.tile_tokens`; backward recomputes
a tile's normalised input), weight gradients summed in float32 over tiles. The tiled MLP is
:mod:`loongtrain.model.tiled_mlp`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongtrain.model.llama import apply_rope
from loongtrain.model.norm import (
    RMSNorm,
    cast_like,
    normalize,
    over_tiles,
    rms_norm,
    rms_norm_backward,
    row_width,
    sum_parts,
    tiles,
)

Tensor = torch.Tensor


class NormedProjections(torch.autograd.Function):
    """``rms_norm(x)`` then its q, k, v projections, saving ``x``, the norm weight, ``1 / rms``
    and the weights; over token tiles in forward and backward."""

    @staticmethod
    def forward(ctx, x, norm_weight, eps, wq, bq, wk, bk, wv, bv):
        def tile(rows: slice) -> tuple[Tensor, ...]:
            h, rstd = rms_norm(x[:, rows], norm_weight, eps)
            return F.linear(h, wq, bq), F.linear(h, wk, bk), F.linear(h, wv, bv), rstd

        q, k, v, rstd = over_tiles(tile, x.shape[1], width=row_width(x))
        ctx.save_for_backward(x, norm_weight, rstd, wq, wk, wv)
        return q, k, v

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor):
        x, norm_weight, rstd, wq, wk, wv = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_x = torch.empty_like(x)
        sums = projections_backward(x, norm_weight, rstd, (wq, wk, wv), (dq, dk, dv), (needs[1], *needs[3:]), grad_x)
        typed = cast_like(sums, [norm_weight, wq, wq, wk, wk, wv, wv])  # a bias has its weight's dtype
        return grad_x, typed[0], None, *typed[1:]


def projections_backward(
    x: Tensor,
    norm_weight: Tensor,
    rstd: Tensor,
    weights: tuple[Tensor, Tensor, Tensor],
    grads: tuple[Tensor, Tensor, Tensor],
    needs: tuple[bool, ...],
    grad_x: Tensor,
    accumulate: bool = False,
) -> list[Tensor | None]:
    """Backward of ``rms_norm(x)`` and its q, k, v projections (``weights``) for the
    gradients ``grads`` [B, S, *], over token tiles: writes (``accumulate``: adds) the input
    gradient into ``grad_x`` and returns the float32 sums of the norm weight's and each
    projection's weight and bias gradients (``needs``: which of these seven are wanted)."""
    wq, wk, wv = weights
    sums: list[Tensor | None] = [None] * 7  # norm weight, then (weight, bias) of q, k, v
    for rows in tiles(x.shape[1], width=row_width(x)):
        xt, rt = x[:, rows], rstd[:, rows]
        h, normed = normalize(xt, rt, norm_weight)
        h = h.flatten(0, -2)
        parts_of = [g[:, rows].flatten(0, -2) for g in grads]
        grad_h = parts_of[0].mm(wq)
        grad_h.addmm_(parts_of[1], wk).addmm_(parts_of[2], wv)  # accumulated in place
        parts: list[Tensor | None] = [None]
        for g, i in zip(parts_of, (1, 3, 5)):
            parts += [g.t().mm(h) if needs[i] else None, g.sum(0) if needs[i + 1] else None]
        del h
        tile_x, parts[0] = rms_norm_backward(grad_h.view_as(xt), xt, norm_weight, rt, needs[0], normed)
        if accumulate:
            grad_x[:, rows] += tile_x
        else:
            grad_x[:, rows] = tile_x
        sums = [sum_parts(total, part) for total, part in zip(sums, parts)]
    return sums


def lean_normed_projections(x: Tensor, norm: RMSNorm | None, wq: nn.Linear, wk: nn.Linear, wv: nn.Linear):
    """:func:`~loongtrain.model.llama.normed_projections` keeping only ``x`` for backward
    (without a norm the plain projections keep only ``x`` already)."""
    if norm is None:
        return wq(x), wk(x), wv(x)
    if not isinstance(norm, RMSNorm):  # Gemma's (1 + weight) norm: the plain formula
        h = norm(x)
        return wq(h), wk(h), wv(h)
    return NormedProjections.apply(x, norm.weight, norm.eps, wq.weight, wq.bias, wk.weight, wk.bias, wv.weight, wv.bias)


class TiledRope(torch.autograd.Function):
    """:func:`~loongtrain.model.llama.apply_rope` over token tiles, saving only cos/sin. A
    rotation's gradient is the inverse rotation: the same function with ``-sin``."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        rope = lambda rows: (apply_rope(x[:, rows], cos[:, rows], sin[:, rows]),)  # noqa: E731
        return over_tiles(rope, x.shape[1], width=row_width(x))[0]

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        inverse = lambda rows: (apply_rope(grad[:, rows], cos[:, rows], -sin[:, rows]),)  # noqa: E731
        (grad_x,) = over_tiles(inverse, grad.shape[1], width=row_width(grad))
        return grad_x, None, None


def tiled_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`~loongtrain.model.llama.apply_rope` keeping only cos/sin for backward."""
    return TiledRope.apply(x, cos, sin)
