"""The SwiGLU MLP over sequence tiles (ALST's TiledMLP), its RMSNorm included: one tile's
``[tile, ffn_dim]`` intermediates, and one tile's normalised input, exist at a time, in
forward and in backward.

The norm and the MLP act on each token alone, so cutting the sequence into tiles is exact.
Forward runs the tiles keeping only the input (the block's residual stream, which the
norm would keep anyway) and the norm's float32 ``1 / rms``; backward recomputes each tile's
normalised input and intermediates and backpropagates through both before moving on,
accumulating the weight gradients in float32. Cost: one more forward of the MLP per layer
(on top of what activation checkpointing recomputes). Memory: ``[B, tile, ffn_dim]``
intermediates instead of ``[B, S, ffn_dim]`` (``ffn_dim`` is 14336 for Llama-3-8B against
``dim`` 4096), and no ``[B, S, dim]`` normalised input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loongtrain.model.norm import (
    RMSNorm,
    cast_like,
    normalize,
    over_tiles,
    rms_norm,
    rms_norm_backward,
    sum_parts,
    tiles,
)

Tensor = torch.Tensor


def swiglu(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
    """``w2(silu(w1 x) * w3 x)`` with weight matrices ``[out, in]`` (no biases)."""
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class TiledNormedSwiGLU(torch.autograd.Function):
    """``swiglu(rms_norm(x))`` over tiles of ``tile`` tokens along dim 1 of ``x`` [B, S, dim]."""

    @staticmethod
    def forward(ctx, x: Tensor, norm_weight: Tensor, eps: float, w1: Tensor, w3: Tensor, w2: Tensor, tile: int):
        def part(rows: slice) -> tuple[Tensor, Tensor]:
            h, rstd = rms_norm(x[:, rows], norm_weight, eps)
            return swiglu(h, w1, w3, w2), rstd

        out, rstd = over_tiles(part, x.shape[1], tile)
        ctx.save_for_backward(x, norm_weight, rstd, w1, w3, w2)
        ctx.tile = tile
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, norm_weight, rstd, w1, w3, w2 = ctx.saved_tensors
        needs = ctx.needs_input_grad
        weights = [w.detach().requires_grad_(needs[i]) for w, i in zip((w1, w3, w2), (3, 4, 5))]
        grad_x = torch.empty_like(x)
        sums: list[Tensor | None] = [None] * 4  # norm weight, w1, w3, w2
        for rows in tiles(x.shape[1], ctx.tile):
            xt, rt = x[:, rows], rstd[:, rows]
            h, normed = normalize(xt, rt, norm_weight)
            h.requires_grad_()
            with torch.enable_grad():
                out = swiglu(h, *weights)
            wanted = [h, *(w for w in weights if w.requires_grad)]
            grads = iter(torch.autograd.grad(out, wanted, grad_out[:, rows]))
            grad_h = next(grads)
            parts = [None, *(next(grads) if w.requires_grad else None for w in weights)]
            del h, out
            grad_x[:, rows], parts[0] = rms_norm_backward(grad_h, xt, norm_weight, rt, needs[1], normed)
            sums = [sum_parts(total, p) for total, p in zip(sums, parts)]
        typed = cast_like(sums, [norm_weight, w1, w3, w2])
        return grad_x, typed[0], None, *typed[1:], None


def tiled_normed_mlp(x: Tensor, norm: RMSNorm, w1: nn.Linear, w3: nn.Linear, w2: nn.Linear, *, tile: int) -> Tensor:
    """:func:`~loongtrain.model.llama.normed_mlp` over tiles of ``tile`` tokens (the
    ``FeedForward.mlp`` that ``loongtrain.parallelize`` swaps in for ``memory.mlp_tile``)."""
    return normed_swiglu(x, norm, w1.weight, w3.weight, w2.weight, tile)


def normed_swiglu(x: Tensor, norm: RMSNorm, w1: Tensor, w3: Tensor, w2: Tensor, tile: int) -> Tensor:
    """:func:`swiglu` of ``norm(x)`` for ``x`` [B, S, dim], with at most ``tile`` tokens' norm
    output and intermediates alive (:class:`TiledNormedSwiGLU`); the plain norm and MLP
    when ``tile`` is 0 or covers the whole sequence."""
    if tile <= 0 or x.shape[1] <= tile:
        return swiglu(norm(x), w1, w3, w2)
    return TiledNormedSwiGLU.apply(x, norm.weight, norm.eps, w1, w3, w2, tile)
