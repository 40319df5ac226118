"""2D-Attention: head all-to-all (Ulysses) composed with the double ring (context).

Per rank: ``q`` [B, S/sp, H, d] and ``k``/``v`` [B, S/sp, G, d] zigzag shards (see
``shard_sequence``) with RoPE already applied.

1. GQA: if ``hp > G`` each key/value head is replicated ``hp // G`` times (its backward
   sums the replicas' gradients); otherwise ``G % hp == 0``.
2. All-to-all over the head group (scatter heads, gather sequence): q, and k and v
   stacked, are in flight together -> [B, S/cp, H/hp, d], [2, B, S/cp, max(G,hp)/hp, d].
3. Double ring over the context group -> out [B, S/cp, H/hp, d].
4. All-to-all back (scatter sequence, gather heads) -> [B, S/sp, H, d].

``hp == 1`` is pure ring attention and ``cp == 1`` pure Ulysses, through the same code.
"""

from __future__ import annotations

import math

import torch

from loongtrain.attention.blocks import accum_dtype
from loongtrain.attention.comm import (
    all_gather_flat,
    all_to_all_start,
    pack_head_to_seq,
    pack_seq_to_head,
    unpack_head_to_seq,
    unpack_seq_to_head,
)
from loongtrain.attention.double_ring import DoubleRingAttention, RingPlan
from loongtrain.attention.kernels import check_supported
from loongtrain.parallel.state import ParallelState
from loongtrain.parallel.stats import AttentionStats

Tensor = torch.Tensor


class HeadScatter(torch.autograd.Function):
    """``(q, k, v) -> (q_h, kv_h)``: scatter heads, gather sequence over the head group."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group, hp: int, stats: AttentionStats):
        groups = k.shape[2]
        kv = torch.stack((k, v))
        if hp > groups:
            kv = kv.repeat_interleave(hp // groups, dim=-2)
        q_pending = all_to_all_start(pack_seq_to_head(q, hp), group, stats)
        kv_pending = all_to_all_start(pack_seq_to_head(kv, hp), group, stats)
        ctx.group, ctx.hp, ctx.groups, ctx.stats = group, hp, groups, stats
        return unpack_seq_to_head(q_pending.wait()), unpack_seq_to_head(kv_pending.wait())

    @staticmethod
    def backward(ctx, dq_h: Tensor, dkv_h: Tensor):
        hp, groups = ctx.hp, ctx.groups
        dq_pending = all_to_all_start(pack_head_to_seq(dq_h, hp), ctx.group, ctx.stats)
        dkv_pending = all_to_all_start(pack_head_to_seq(dkv_h, hp), ctx.group, ctx.stats)
        dq = unpack_head_to_seq(dq_pending.wait())
        dkv = unpack_head_to_seq(dkv_pending.wait())
        if hp > groups:
            two, b, s, _, d = dkv.shape
            dkv = dkv.view(two, b, s, groups, hp // groups, d).sum(dim=4, dtype=accum_dtype(dkv.dtype)).to(dkv.dtype)
        return dq, dkv[0], dkv[1], None, None, None


class HeadGather(torch.autograd.Function):
    """``out_h -> out``: scatter sequence, gather heads over the head group."""

    @staticmethod
    def forward(ctx, out_h: Tensor, group, hp: int, stats: AttentionStats):
        ctx.group, ctx.hp, ctx.stats = group, hp, stats
        return unpack_head_to_seq(all_to_all_start(pack_head_to_seq(out_h, hp), group, stats).wait())

    @staticmethod
    def backward(ctx, dout: Tensor):
        pending = all_to_all_start(pack_seq_to_head(dout, ctx.hp), ctx.group, ctx.stats)
        return unpack_seq_to_head(pending.wait()), None, None, None


def check_attention_inputs(
    q: Tensor, k: Tensor, v: Tensor, state: ParallelState, causal: bool, softmax_scale: float | None
) -> None:
    """Validate shapes, dtypes and the layout locally (no communication).

    Every check depends only on values that are the same on every rank of a correct
    program, so a bad call raises on every rank before any transfer starts.
    """
    state.check_alive()
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"head_context_attention: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"head_context_attention: {name} must be 4-D [batch, seq/sp, heads, head_dim], "
                f"got shape {tuple(t.shape)}"
            )
    if k.shape != v.shape:
        raise ValueError(f"head_context_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    b, s, heads, d = q.shape
    if (k.shape[0], k.shape[1], k.shape[3]) != (b, s, d):
        raise ValueError(
            f"head_context_attention: q {tuple(q.shape)} and k/v {tuple(k.shape)} must agree in "
            f"batch, local sequence length and head_dim ([B, S/sp, heads, d])"
        )
    if s == 0 or b == 0:
        raise ValueError(f"head_context_attention: empty input, q shape {tuple(q.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"head_context_attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one dtype"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"head_context_attention: q, k, v are on different devices ({q.device}, {k.device}, {v.device})"
        )
    if q.device.type != state.device.type:
        raise ValueError(
            f"head_context_attention: inputs are on {q.device} but the process groups communicate "
            f"on {state.device}; move the tensors there (gloo: cpu, NCCL: cuda)"
        )
    check_supported(q.device, q.dtype)
    groups, hp, cp = k.shape[2], state.config.hp, state.config.cp
    if heads % groups != 0:
        raise ValueError(
            f"head_context_attention: query heads H={heads} are not a multiple of key/value heads "
            f"G={groups} (GQA needs H % G == 0)"
        )
    if heads % hp != 0:
        options = [x for x in range(1, heads + 1) if heads % x == 0]
        raise ValueError(
            f"head_context_attention: query heads H={heads} are not divisible by hp={hp}; "
            f"choose hp among {options} or change the model's head count"
        )
    if hp > groups and hp % groups != 0:
        raise ValueError(
            f"head_context_attention: hp={hp} exceeds the key/value heads G={groups} but is not a "
            f"multiple of G, so KV heads cannot be replicated evenly; use hp a multiple of {groups} "
            f"or a divisor of {groups}"
        )
    if hp <= groups and groups % hp != 0:
        raise ValueError(
            f"head_context_attention: key/value heads G={groups} are not divisible by hp={hp}; "
            f"use hp dividing {groups} or a multiple of {groups}"
        )
    if causal and cp > 1 and (s * hp) % 2 != 0:
        raise ValueError(
            f"head_context_attention: causal ring attention needs an even number of tokens per "
            f"context rank (two zigzag chunks), got S/cp = {s}*{hp} = {s * hp}; the global "
            f"sequence length must be a multiple of 2*sp = {2 * hp * cp} (shard it with shard_sequence)"
        )
    if softmax_scale is not None and not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"head_context_attention: softmax_scale={softmax_scale} must be a positive finite number")


_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}


def verify_same_inputs(q: Tensor, k: Tensor, state: ParallelState, causal: bool) -> None:
    """Check with one small all-gather that every sp rank passes the same shapes and options."""
    if state.sp_group is None:
        return
    meta = torch.tensor(
        [*q.shape, k.shape[2], _DTYPE_CODES.get(q.dtype, -1), int(causal)], dtype=torch.int64, device=state.device
    )
    sp = state.config.sp
    gathered = meta.new_empty((sp * meta.numel(),))
    all_gather_flat(gathered, meta, group=state.sp_group)
    rows = gathered.view(sp, -1).tolist()
    if any(row != rows[0] for row in rows):
        members = state.layout.sp_group(state.rank)
        detail = "; ".join(
            f"rank {r}: q={tuple(row[:4])} G={row[4]} causal={bool(row[6])}" for r, row in zip(members, rows)
        )
        raise ValueError(
            "head_context_attention: the ranks of the sequence-parallel group passed different "
            f"inputs ({detail}); every rank must pass its shard of the same batch"
        )


def head_context_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: ParallelState,
    causal: bool = True,
    softmax_scale: float | None = None,
) -> Tensor:
    """2D head-context attention on zigzag sequence shards; returns [B, S/sp, H, d].

    Args:
        q: [B, S/sp, H, d] query shard (from ``shard_sequence``).
        k, v: [B, S/sp, G, d] key/value shards; GQA when ``G < H``.
        state: from :func:`loongtrain.init_parallel`.
        causal: causal (top-left aligned over the global sequence) or full attention.
        softmax_scale: defaults to ``d ** -0.5``.
    """
    check_attention_inputs(q, k, v, state, causal, softmax_scale)
    if state.verify_inputs:
        verify_same_inputs(q, k, state, causal)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    hp = state.config.hp
    plan = RingPlan.from_state(state, causal=causal, scale=scale)
    if hp == 1:
        q_h, kv_h = q, torch.stack((k, v))
    else:
        q_h, kv_h = HeadScatter.apply(q, k, v, state.head_group, hp, state.stats)
    out_h, _lse = DoubleRingAttention.apply(q_h, kv_h, plan)
    if hp == 1:
        return out_h
    return HeadGather.apply(out_h, state.head_group, hp, state.stats)
