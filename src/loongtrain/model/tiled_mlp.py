"""The SwiGLU MLP over sequence tiles (ALST's TiledMLP): one tile's ``[tile, ffn_dim]``
intermediates exist at a time, in forward and in backward.

The MLP acts on each token alone, so cutting the sequence into tiles is exact. Forward
runs the tiles without keeping anything but the input; backward recomputes each tile's
intermediates and backpropagates through it before moving on, accumulating the weight
gradients in float32. Cost: one more forward of the MLP per layer (on top of what
activation checkpointing recomputes). Memory: ``[B, tile, ffn_dim]`` intermediates
instead of ``[B, S, ffn_dim]`` -- ``ffn_dim`` is 14336 for Llama-3-8B against ``dim`` 4096.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def swiglu(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
    """``w2(silu(w1 x) * w3 x)`` with weight matrices ``[out, in]`` (no biases)."""
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class TiledSwiGLU(torch.autograd.Function):
    """:func:`swiglu` over tiles of ``tile`` tokens along dim 1 of ``x`` [B, S, dim]."""

    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, tile: int) -> Tensor:
        out = torch.cat([swiglu(part, w1, w3, w2) for part in x.split(tile, dim=1)], dim=1)
        ctx.save_for_backward(x, w1, w3, w2)
        ctx.tile = tile
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, w1, w3, w2 = ctx.saved_tensors
        weights = [w.detach().requires_grad_() for w in (w1, w3, w2)]
        grad_w = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in weights]
        grad_x = torch.empty_like(x)
        start = 0
        for part, grad_part in zip(x.split(ctx.tile, dim=1), grad_out.split(ctx.tile, dim=1)):
            part = part.detach().requires_grad_()
            with torch.enable_grad():
                out = swiglu(part, *weights)
            grads = torch.autograd.grad(out, (part, *weights), grad_part)
            grad_x[:, start : start + part.shape[1]] = grads[0]
            for acc, g in zip(grad_w, grads[1:]):
                acc += g
            start += part.shape[1]
        return grad_x, *(g.to(w.dtype) for g, w in zip(grad_w, (w1, w3, w2))), None


def tiled_swiglu(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, tile: int) -> Tensor:
    """:func:`swiglu` of ``x`` [B, S, dim] with at most ``tile`` tokens' intermediates alive;
    the plain MLP when ``tile`` is 0 or covers the whole sequence."""
    if tile <= 0 or x.shape[1] <= tile:
        return swiglu(x, w1, w3, w2)
    return TiledSwiGLU.apply(x, w1, w3, w2, tile)
