"""RMSNorm, and the sequence tiles that bound the float32 temporaries of the model's
elementwise functions.

The model computes in the parameters' dtype (bf16 on accelerators) but takes a norm's
statistics and RoPE's rotation in float32. Over a whole long sequence those float32
temporaries are several times the bf16 activations (a norm's backward holds three
``[T, dim]`` float32 tensors at once: 48 KB per token for Llama-3-8B). The functions here
and in :mod:`loongtrain.model.lean` and :mod:`loongtrain.model.head_groups` run over tiles
instead, so they exist for one tile at a time; the results are the same (each token is
normalised or rotated alone; weight gradients are summed over tiles in float32).

A tile is as many tokens as keep its temporaries within
:data:`~loongtrain.model.config.TILE_BYTES` (:func:`tile_tokens`: 16K tokens at width 2048, 8K
at 4096): few tiles, so few kernel launches, and a bounded, priced working set
(``planner/memory.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from loongtrain.model.config import token_tile

Tensor = torch.Tensor

#: tokens of the sequence per tile wherever a function would otherwise make float32
#: temporaries as long as the sequence (the norms, RoPE, the q/k/v projections); 0: sized by
#: bytes (:func:`~loongtrain.model.config.token_tile`; tests set a count to run many tiles)
TOKEN_TILE = 0


def tile_tokens(width: int) -> int:
    """Tokens per tile of rows ``width`` wide: :data:`TOKEN_TILE` if set, else
    :func:`~loongtrain.model.config.token_tile` (read at call time)."""
    return TOKEN_TILE or token_tile(width)


def row_width(t: Tensor) -> int:
    """Elements of one token's row of ``t`` [B, S, ...]."""
    return math.prod(t.shape[2:])


def tiles(length: int, tile: int = 0, width: int = 0) -> list[slice]:
    """The sequence tiles of a dimension of ``length``: ``tile`` tokens each, or (0) as many as
    :func:`tile_tokens` gives rows ``width`` wide."""
    tile = tile or tile_tokens(width)
    return [slice(start, min(start + tile, length)) for start in range(0, length, tile)]


def over_tiles(
    fn: Callable[[slice], tuple[Tensor, ...]], length: int, tile: int = 0, width: int = 0
) -> tuple[Tensor, ...]:
    """``fn(rows)`` for each sequence tile (dim 1; ``tile`` and ``width`` as :func:`tiles`), its
    results written into tensors of the whole sequence (never a concatenation: the parts and
    the whole would coexist); one call when the sequence is one tile."""
    parts_of = tiles(length, tile, width)
    if len(parts_of) == 1:
        return fn(parts_of[0])
    outs: tuple[Tensor, ...] = ()
    for rows in parts_of:
        parts = fn(rows)
        if not outs:
            outs = tuple(p.new_empty((p.shape[0], length, *p.shape[2:])) for p in parts)
        for out, part in zip(outs, parts):
            out[:, rows] = part
    return outs


def sum_parts(total: Tensor | None, part: Tensor | None) -> Tensor | None:
    """``total + part``, in float32 from the second part on (None: not needed)."""
    if part is None:
        return None
    return part if total is None else total.float() + part


def inverse_rms(x: Tensor, eps: float) -> Tensor:
    """``1 / rms(x)`` over the last dimension, in float32 (``[..., 1]``)."""
    return torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``((x / rms(x)).type_as(x) * weight, 1 / rms)``, the statistics in float32."""
    x32 = x.float()
    rstd = inverse_rms(x32, eps)  # (no second float32 copy: .float() of a float32 tensor is itself)
    return (x32 * rstd).type_as(x) * weight, rstd


def normalize(x: Tensor, rstd: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """``(output, float32 normalised x)`` of :func:`rms_norm` given ``x``'s ``1 / rms``: what a
    backward that saved only ``x`` and ``rstd`` recomputes."""
    normed = x.float() * rstd
    return normed.type_as(x) * weight, normed


def cast_like(sums: list[Tensor | None], params: list[Tensor]) -> list[Tensor | None]:
    """Float32 gradient sums (None: not needed) in the dtypes of the parameters they belong to."""
    return [None if s is None else s.to(p.dtype) for s, p in zip(sums, params)]


def rms_norm_backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, weight_grad: bool, normed: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """``(grad_x, grad_weight or None)`` of :func:`rms_norm`; ``normed``: the float32
    normalised ``x`` when the caller has it (else recomputed)."""
    if normed is None:
        normed = x.float() * rstd
    grad_weight = (grad_out * normed.type_as(x)).flatten(0, -2).sum(0) if weight_grad else None
    g = (grad_out * weight).float()
    dot = (g * normed).mean(dim=-1, keepdim=True)
    grad_x = g.sub_(normed * dot).mul_(rstd)  # in place: one float32 [T, dim] temporary fewer
    return grad_x.type_as(x), grad_weight


class _RMSNormFunction(torch.autograd.Function):
    """:func:`rms_norm` over token tiles (:func:`tile_tokens`), saving only ``x`` (the
    caller's tensor, usually kept anyway) and the per-token ``1 / rms``; backward recomputes
    the rest, tile by tile. Autograd would keep a float32 copy of ``x`` and the normalised
    output, and its backward would make float32 ``[T, width]`` temporaries of the whole
    sequence (three at once)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        out, rstd = over_tiles(lambda rows: rms_norm(x[:, rows], weight, eps), x.shape[1], width=row_width(x))
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight, rstd = ctx.saved_tensors
        needs_weight = ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x)
        grad_weight = None
        for rows in tiles(x.shape[1], width=row_width(x)):
            xt, rt = x[:, rows], rstd[:, rows]
            grad_x[:, rows], part = rms_norm_backward(grad_out[:, rows], xt, weight, rt, needs_weight)
            grad_weight = sum_parts(grad_weight, part)
        return grad_x, *cast_like([grad_weight], [weight]), None


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with a learned weight (:class:`_RMSNormFunction`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)``, computed in float32 and cast back (plain
    autograd: the memory-lean paths, which read an :class:`RMSNorm`'s weight, do not take it)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


def make_norm(dim: int, eps: float, offset: bool = False) -> nn.Module:
    """:class:`OffsetRMSNorm` (Gemma) or :class:`RMSNorm` over ``dim``."""
    return OffsetRMSNorm(dim, eps) if offset else RMSNorm(dim, eps)
