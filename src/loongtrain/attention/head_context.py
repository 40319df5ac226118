"""2D-Attention: head all-to-all (Ulysses) composed with the double ring (context).

Per rank: ``q`` [B, S/sp, H, d] and ``k``/``v`` [B, S/sp, G, d] shards in the sequence layout's
order (zigzag, or the ``documents`` / ``locality`` balance's; see ``shard_sequence``) with
RoPE already applied.

1. GQA: if ``hp > G`` each key/value head is replicated ``hp // G`` times (its backward
   sums the replicas' gradients); otherwise ``G % hp == 0``.
2. All-to-all over the head group (scatter heads, gather sequence): q, and k and v
   stacked, are in flight together -> [B, S/cp, H/hp, d], [2, B, S/cp, max(G,hp)/hp, d].
3. Double ring over the context group -> out [B, S/cp, H/hp, d].
4. All-to-all back (scatter sequence, gather heads) -> [B, S/sp, H, d].

``hp == 1`` is pure ring attention and ``cp == 1`` pure Ulysses, through the same code.
The three stages are the custom ops of :mod:`loongtrain.attention.ops`.

Packed documents (a :class:`~loongtrain.attention.layout.SequenceLayout`, the same
one the inputs were sharded with) and sliding windows (``sliding_window``) are masks of the
ring: every context rank derives, from the layout's boundaries and sharding map, which
kernels each (query block, key/value block) pair needs (:mod:`mask_plan`), with no
communication beyond the plain ring's.
"""

from __future__ import annotations

import math

import torch

from loongtrain.attention import ops
from loongtrain.attention.documents import check_sliding_window
from loongtrain.attention.kernels import check_supported
from loongtrain.attention.layout import SequenceLayout, check_layout
from loongtrain.parallel.layout import check_head_split
from loongtrain.parallel.state import ParallelState

Tensor = torch.Tensor


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
    groups, hp, cp = k.shape[2], state.hp, state.cp
    try:
        check_head_split(heads, groups, hp)
    except ValueError as e:
        raise ValueError(f"head_context_attention: {e}") from None
    if causal and cp > 1 and (s * hp) % 2 != 0:
        raise ValueError(
            f"head_context_attention: causal ring attention needs an even number of tokens per "
            f"context rank (two zigzag chunks), got S/cp = {s}*{hp} = {s * hp}; the global "
            f"sequence length must be a multiple of 2*sp = {2 * hp * cp} (shard it with shard_sequence)"
        )
    if softmax_scale is not None and not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"head_context_attention: softmax_scale={softmax_scale} must be a positive finite number")


def head_context_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: ParallelState,
    causal: bool = True,
    softmax_scale: float | None = None,
    layout: SequenceLayout | None = None,
    sliding_window: int | None = None,
) -> Tensor:
    """2D head-context attention on sequence shards; returns [B, S/sp, H, d].

    Args:
        q: [B, S/sp, H, d] query shard (from ``shard_sequence``).
        k, v: [B, S/sp, G, d] key/value shards; GQA when ``G < H``.
        state: from :func:`loongtrain.init_parallel`.
        causal: causal (top-left aligned over the global sequence) or full attention.
        softmax_scale: defaults to ``d ** -0.5``.
        layout: the :class:`~loongtrain.attention.layout.SequenceLayout` the inputs were
            sharded with (``sequence_layout(S, state, cu_seqlens)``): packed documents, token
            ``i`` sees ``j`` only inside its own document. None: one sequence (not allowed
            under ``balance="documents"`` or ``"locality"``).
        sliding_window: ``i`` sees ``j`` only if ``i - j < sliding_window`` (``|i - j| <
            sliding_window`` when not causal), as in HF Mistral/Qwen.
    """
    return _attend_parts(q, k, v, state, causal, softmax_scale, layout, sliding_window)[0]


def head_context_attention_kv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: ParallelState,
    layout: SequenceLayout | None = None,
    sliding_window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal :func:`head_context_attention` (forward only) that also returns the keys and
    values this rank attended with: ``(out [B, S/sp, H, d], kv [2, B, S/cp, max(G,hp)/hp, d])``,
    its head group's key/value heads for its context rank's tokens (in the order of
    ``layout.ranges(h, c)`` for ``h = 0 .. hp-1``): the rank's shard of a K/V cache."""
    out, kv_h, _, _ = _attend_parts(q, k, v, state, True, None, layout, sliding_window)
    return out, kv_h


def _attend_parts(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: ParallelState,
    causal: bool,
    softmax_scale: float | None,
    layout: SequenceLayout | None,
    sliding_window: int | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The 2D attention: ``(out, kv_h, out_h, lse)``: the output, the stacked key/value heads
    the ring attended with, and the ring's output and log-sum-exp in its layout."""
    if torch.compiler.is_compiling():
        # Under torch.compile the checks that read values (a kernel table) stay out of the
        # graph; the ops find the layout again from its boundaries tensor when they run.
        cu = None if layout is None else layout.cu_seqlens
    else:
        check_attention_inputs(q, k, v, state, causal, softmax_scale)
        try:
            check_sliding_window(sliding_window)
        except ValueError as e:
            raise ValueError(f"head_context_attention: {e}") from None
        check_layout(state, q.shape[1] * state.sp, layout, "head_context_attention")
        cu = None if layout is None else layout.cu_seqlens
    sliding = sliding_window or 0  # the ops take an int (0: none)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    if state.hp == 1:
        kv = torch.stack((k, v))
        out, lse = ops.ring_attention(q, kv, state.key, causal, scale, True, cu, sliding)
        return out, kv, out, lse
    q_h, kv_h = ops.head_scatter(q, k, v, state.key, causal, cu, sliding)
    out_h, lse = ops.ring_attention(q_h, kv_h, state.key, causal, scale, False, cu, sliding)
    return ops.head_gather(out_h, state.key), kv_h, out_h, lse


def state_of_layout(layout: SequenceLayout | None, states: dict, default: ParallelState) -> ParallelState:
    """The state a batch's ``layout`` was made for, among ``states`` keyed by ``(hp, cp,
    balance)`` (the other splits of a layout per microbatch); ``default`` otherwise."""
    if layout is None:
        return default
    return states.get((layout.hp, layout.cp, layout.balance), default)


class HeadContextSplit:
    """:func:`head_context_attention` (causal) as a forward and a backward the caller runs
    (:class:`~loongtrain.model.head_groups.SplitAttention`, for the attention over head
    groups): the same custom ops and communication, called without autograd.

    ``saved`` is the ring's output and log-sum-exp in its own layout (``[B, S/cp, H/hp, d]``).
    With ``hp > 1`` the backward runs the head all-to-all of q, k, v again (q_h and kv_h are
    not kept) and :meth:`output` gathers the output again (an all-to-all of ``out``).
    ``states``: the states of other hp x cp splits a microbatch's layout may take, as
    :func:`~loongtrain.apply.attention.apply_attention`'s ``alternatives``.
    """

    def __init__(self, state: ParallelState, states: dict | None = None) -> None:
        self.state, self.states = state, states or {}

    def _state(self, layout: SequenceLayout | None) -> ParallelState:
        return state_of_layout(layout, self.states, self.state)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, layout: SequenceLayout | None = None, sliding_window: int | None = None
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        state = self._state(layout)
        out, _kv, out_h, lse = _attend_parts(q, k, v, state, True, None, layout, sliding_window)
        return out, (out_h, lse) if state.hp > 1 else (out, lse)

    def output(self, saved: tuple[Tensor, ...], layout: SequenceLayout | None = None) -> Tensor:
        state = self._state(layout)
        return ops.head_gather(saved[0], state.key) if state.hp > 1 else saved[0]

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        saved: tuple[Tensor, ...],
        layout: SequenceLayout | None = None,
        sliding_window: int | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        state = self._state(layout)
        out_h, lse = saved
        cu, sliding = (None if layout is None else layout.cu_seqlens), sliding_window or 0
        scale = q.shape[-1] ** -0.5
        if state.hp == 1:
            dq, dkv = ops.ring_attention_backward(
                dout.contiguous(), q, torch.stack((k, v)), out_h, lse, state.key, True, scale, cu, sliding
            )
            return dq, dkv[0], dkv[1]
        q_h, kv_h = ops.head_scatter(q, k, v, state.key, True, cu, sliding)
        dout_h = ops.head_gather_backward(dout.contiguous(), state.key)
        dq_h, dkv_h = ops.ring_attention_backward(dout_h, q_h, kv_h, out_h, lse, state.key, True, scale, cu, sliding)
        del q_h, kv_h, dout_h
        dq, dkv = ops.head_scatter_backward(dq_h, dkv_h, state.key, k.shape[2])
        return dq, dkv[0], dkv[1]
