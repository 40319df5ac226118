"""The distributed attention as three PyTorch custom ops with hand-written backwards:

- ``loongtrain::head_scatter``  (q, k, v) -> (q_h, kv_h): all-to-all over the head group
- ``loongtrain::ring_attention`` (q_h, kv_h) -> (out_h, lse): double ring over the context group
- ``loongtrain::head_gather``   out_h -> out: all-to-all back

Being operators (not autograd Functions) makes them visible to PyTorch's selective
activation checkpointing: a policy can mark them MUST_SAVE, so a recomputed block gets
their outputs back with no communication and no attention compute (Selective
Checkpoint++). Each backward is a custom op too (``*_backward``), so ``torch.compile``
sees forward and backward as opaque calls with fake (shape-only) implementations and
never traces communication or the mask planning. Ops take the ParallelState by its
registry key.
"""

from __future__ import annotations

import zlib

import torch

from loongtrain.attention.blocks import accum_dtype
from loongtrain.attention.comm import all_gather_flat, head_to_seq, seq_to_head
from loongtrain.attention.double_ring import RingSetup, ring_backward, ring_forward
from loongtrain.attention.kernels import band_tile
from loongtrain.attention.layout import layout_of_op
from loongtrain.parallel.state import ParallelState, state_by_key

Tensor = torch.Tensor

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}


def mask_signature(cu_seqlens: Tensor | None, sliding_window: int) -> list[int]:
    """Small ints that differ when two ranks pass different masks (for the input check)."""
    boundaries = () if cu_seqlens is None else cu_seqlens.tolist()
    digest = zlib.crc32(b",".join(str(x).encode() for x in boundaries))
    return [len(boundaries), digest, sliding_window]


def verify_same_inputs(q: Tensor, kv_heads: int, state: ParallelState, causal: bool, mask: list[int]) -> None:
    """Check with one small all-gather that every sp rank passes the same shapes and options."""
    if state.sp_group is None:
        return
    meta = torch.tensor(
        [*q.shape, kv_heads, _DTYPE_CODES.get(q.dtype, -1), int(causal), *mask], dtype=torch.int64, device=state.device
    )
    sp = state.config.sp
    gathered = meta.new_empty((sp * meta.numel(),))
    all_gather_flat(gathered, meta, state.sp_group)
    rows = gathered.view(sp, -1).tolist()
    if any(row != rows[0] for row in rows):
        members = state.layout.sp_group(state.rank)
        detail = "; ".join(
            f"rank {r}: q={tuple(row[:4])} G={row[4]} causal={bool(row[6])} documents={row[7]} "
            f"(crc {row[8]}) sliding_window={row[9]}"
            for r, row in zip(members, rows)
        )
        raise ValueError(
            "head_context_attention: the ranks of the sequence-parallel group passed different "
            f"inputs ({detail}); every rank must pass its shard of the same batch, with the same layout "
            f"(cu_seqlens) and sliding_window"
        )


# -- head all-to-all: scatter heads, gather sequence ---------------------------------
@torch.library.custom_op("loongtrain::head_scatter", mutates_args=())
def head_scatter(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state_key: str,
    causal: bool,
    cu_seqlens: Tensor | None,
    sliding_window: int,
) -> tuple[Tensor, Tensor]:
    """[B,S,H,d], [B,S,G,d] x2 -> q_h [B, hp*S, H/hp, d], kv_h [2, B, hp*S, max(G,hp)/hp, d].

    ``cu_seqlens``/``sliding_window`` only enter the input check (the mask is applied in the ring).
    """
    state = state_by_key(state_key)
    hp, groups = state.hp, k.shape[2]
    if state.verify_inputs:
        verify_same_inputs(q, groups, state, causal, mask_signature(cu_seqlens, sliding_window))
    kv = torch.stack((k, v))
    if hp > groups:  # GQA with fewer KV heads than head ranks: replicate each KV head
        kv = kv.repeat_interleave(hp // groups, dim=-2)
    q_pending = seq_to_head(q, state, "fwd.all_to_all")
    kv_pending = seq_to_head(kv, state, "fwd.all_to_all")
    return q_pending.wait().contiguous(), kv_pending.wait().contiguous()


@head_scatter.register_fake
def _(q, k, v, state_key, causal, cu_seqlens, sliding_window):
    hp = state_by_key(state_key).hp
    b, s, h, d = q.shape
    kv_heads = max(k.shape[2], hp)
    return q.new_empty(b, hp * s, h // hp, d), k.new_empty(2, b, hp * s, kv_heads // hp, d)


def _head_scatter_setup(ctx, inputs, output) -> None:
    _, k, _, state_key, *_ = inputs
    ctx.state_key, ctx.groups = state_key, k.shape[2]


@torch.library.custom_op("loongtrain::head_scatter_backward", mutates_args=())
def head_scatter_backward(dq_h: Tensor, dkv_h: Tensor, state_key: str, groups: int) -> tuple[Tensor, Tensor]:
    """Gradients of :func:`head_scatter`: (dq [B,S,H,d], dkv [2,B,S,G,d])."""
    state = state_by_key(state_key)
    hp = state.hp
    dq_pending = head_to_seq(dq_h, state, "bwd.all_to_all")
    dkv_pending = head_to_seq(dkv_h, state, "bwd.all_to_all")
    dq, dkv = dq_pending.wait(), dkv_pending.wait()
    if hp > groups:  # sum the gradients of each KV head's replicas
        two, b, s, _, d = dkv.shape
        dkv = dkv.view(two, b, s, groups, hp // groups, d).sum(dim=4, dtype=accum_dtype(dkv.dtype)).to(dkv.dtype)
    return dq.contiguous(), dkv.contiguous()  # the fake implementations promise contiguous outputs


@head_scatter_backward.register_fake
def _(dq_h, dkv_h, state_key, groups):
    hp = state_by_key(state_key).hp
    b, s, hh, d = dq_h.shape
    return dq_h.new_empty(b, s // hp, hh * hp, d), dkv_h.new_empty(2, b, s // hp, groups, d)


def _head_scatter_backward(ctx, dq_h: Tensor, dkv_h: Tensor):
    dq, dkv = head_scatter_backward(dq_h.contiguous(), dkv_h.contiguous(), ctx.state_key, ctx.groups)
    return dq, dkv[0], dkv[1], None, None, None, None


head_scatter.register_autograd(_head_scatter_backward, setup_context=_head_scatter_setup)


# -- double ring over the context group ----------------------------------------------
@torch.library.custom_op("loongtrain::ring_attention", mutates_args=())
def ring_attention(
    q_h: Tensor,
    kv_h: Tensor,
    state_key: str,
    causal: bool,
    scale: float,
    verify: bool,
    cu_seqlens: Tensor | None,
    sliding_window: int,
) -> tuple[Tensor, Tensor]:
    """q_h [B, Sc, Hh, d], kv_h [2, B, Sc, Gh, d] -> out_h [B, Sc, Hh, d], lse [B, Sc, Hh].

    ``cu_seqlens`` (CPU int64, the global boundaries of the batch's
    :class:`~loongtrain.attention.layout.SequenceLayout`, or None) and
    ``sliding_window`` (0: none) select the mask; the layout (with the state's balance)
    says how the inputs were sharded.
    """
    state = state_by_key(state_key)
    if verify and state.verify_inputs:
        verify_same_inputs(q_h, kv_h.shape[3], state, causal, mask_signature(cu_seqlens, sliding_window))
    out, lse = ring_forward(_setup(state, q_h, causal, scale, cu_seqlens, sliding_window), q_h, kv_h)
    return out.contiguous(), lse.contiguous()


def _setup(
    state: ParallelState, q_h: Tensor, causal: bool, scale: float, cu_seqlens: Tensor | None, sliding_window: int
) -> RingSetup:
    """The ring of this call: the mask plan of the batch's layout (found again from its
    boundaries) under its documents and the sliding window (:meth:`SequenceLayout.mask_plan`;
    one zigzag document: the plain ring's calls)."""
    seq_len = q_h.shape[1] * state.cp
    layout = layout_of_op(state.config, seq_len, cu_seqlens)
    masks = layout.mask_plan(causal, sliding_window, band_tile(q_h.device, q_h.dtype))
    return RingSetup.from_state(state, causal=causal, scale=scale, masks=masks, sliding_window=masks.sliding_window)


@ring_attention.register_fake
def _(q_h, kv_h, state_key, causal, scale, verify, cu_seqlens, sliding_window):
    return torch.empty_like(q_h), q_h.new_empty(q_h.shape[:3], dtype=accum_dtype(q_h.dtype))


def _ring_setup(ctx, inputs, output) -> None:
    q_h, kv_h, state_key, causal, scale, _, cu_seqlens, sliding_window = inputs
    out_h, lse = output
    ctx.save_for_backward(q_h, kv_h, out_h, lse)
    ctx.state_key, ctx.causal, ctx.scale = state_key, causal, scale
    ctx.cu_seqlens, ctx.sliding_window = cu_seqlens, sliding_window


@torch.library.custom_op("loongtrain::ring_attention_backward", mutates_args=())
def ring_attention_backward(
    dout_h: Tensor,
    q_h: Tensor,
    kv_h: Tensor,
    out_h: Tensor,
    lse: Tensor,
    state_key: str,
    causal: bool,
    scale: float,
    cu_seqlens: Tensor | None,
    sliding_window: int,
) -> tuple[Tensor, Tensor]:
    """Gradients of :func:`ring_attention`: (dq_h, dkv_h)."""
    plan = _setup(state_by_key(state_key), q_h, causal, scale, cu_seqlens, sliding_window)
    dq, dkv = ring_backward(plan, dout_h.contiguous(), q_h, kv_h, out_h, lse)
    return dq.contiguous(), dkv.contiguous()


@ring_attention_backward.register_fake
def _(dout_h, q_h, kv_h, out_h, lse, state_key, causal, scale, cu_seqlens, sliding_window):
    return torch.empty_like(q_h), torch.empty_like(kv_h)


def _ring_backward(ctx, dout_h: Tensor, _dlse):
    q_h, kv_h, out_h, lse = ctx.saved_tensors
    dq, dkv = ring_attention_backward(
        dout_h.contiguous(), q_h, kv_h, out_h, lse, ctx.state_key, ctx.causal, ctx.scale,
        ctx.cu_seqlens, ctx.sliding_window,
    )  # fmt: skip
    return dq, dkv, None, None, None, None, None, None


ring_attention.register_autograd(_ring_backward, setup_context=_ring_setup)


# -- head all-to-all back: scatter sequence, gather heads -----------------------------
@torch.library.custom_op("loongtrain::head_gather", mutates_args=())
def head_gather(out_h: Tensor, state_key: str) -> Tensor:
    """[B, hp*S, H/hp, d] -> [B, S, H, d]."""
    return head_to_seq(out_h, state_by_key(state_key), "fwd.all_to_all").wait().contiguous()


@head_gather.register_fake
def _(out_h, state_key):
    hp = state_by_key(state_key).hp
    b, s, h, d = out_h.shape
    return out_h.new_empty(b, s // hp, h * hp, d)


def _head_gather_setup(ctx, inputs, output) -> None:
    ctx.state_key = inputs[1]


@torch.library.custom_op("loongtrain::head_gather_backward", mutates_args=())
def head_gather_backward(dout: Tensor, state_key: str) -> Tensor:
    """Gradient of :func:`head_gather`: [B, S, H, d] -> [B, hp*S, H/hp, d]."""
    return seq_to_head(dout, state_by_key(state_key), "bwd.all_to_all").wait().contiguous()


@head_gather_backward.register_fake
def _(dout, state_key):
    hp = state_by_key(state_key).hp
    b, s, h, d = dout.shape
    return dout.new_empty(b, hp * s, h // hp, d)


def _head_gather_backward(ctx, dout: Tensor):
    return head_gather_backward(dout.contiguous(), ctx.state_key), None


head_gather.register_autograd(_head_gather_backward, setup_context=_head_gather_setup)

#: The ops a Selective Checkpoint++ policy keeps instead of recomputing.
ATTENTION_OPS = (
    torch.ops.loongtrain.head_scatter.default,
    torch.ops.loongtrain.ring_attention.default,
    torch.ops.loongtrain.head_gather.default,
)
