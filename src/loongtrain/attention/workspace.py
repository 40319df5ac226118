"""How a block's attention backward is split over heads, and what the GPU kernel allocates
beside its outputs. Pure (no torch): the kernels (:mod:`loongtrain.attention.kernels`)
and the planner's memory model (:mod:`loongtrain.planner.memory`) read the same rule.

FlashAttention-2's backward (the ``flash_attn`` package, and PyTorch's CUDA flash kernel,
which vendors it: ``mha_bwd`` in ``flash_api.cpp``) allocates, per call, an fp32 ``dq``
accumulator ``[B, Sq, H, d]`` and, with GQA (fewer key/value heads than query heads),
``dk``/``dv`` at the query heads ``[B, Sk, H, d]`` in the input dtype, summed into the real
``dk``/``dv`` at the end. At long sequences that is more than the outputs themselves
(Llama-3-8B, one GPU: 32 KB per token against 12 KB of dq/dk/dv). Attention heads are
independent, so a call over many rows runs over groups of heads instead, each call's
workspace bounded by :data:`BACKWARD_ROW_HEADS`; the result is the same.
"""

from __future__ import annotations

#: a backward kernel call covers at most this many query rows x query heads (when one head
#: is more, one head a call): 1M row-heads, 512 MiB of fp32 dq accumulator at head size 128
BACKWARD_ROW_HEADS = 1 << 20


def backward_heads_per_call(rows: int, q_heads: int, kv_heads: int) -> int:
    """Query heads per kernel call in the backward of a block of ``rows`` query rows (batch
    included): all ``q_heads`` when they fit :data:`BACKWARD_ROW_HEADS`, else the largest
    whole number of key/value groups (``q_heads // kv_heads`` query heads each) that fits,
    else the largest divisor of one group's query heads that fits (one at least)."""
    if q_heads % kv_heads:
        raise ValueError(f"backward_heads_per_call: {q_heads} query heads are not a multiple of {kv_heads}")
    if rows * q_heads <= BACKWARD_ROW_HEADS:
        return q_heads
    ratio = q_heads // kv_heads
    groups = [ratio * n for n in range(kv_heads, 0, -1) if kv_heads % n == 0]
    within = [c for c in range(ratio - 1, 0, -1) if ratio % c == 0]
    for heads in groups + within:
        if rows * heads <= BACKWARD_ROW_HEADS:
            return heads
    return 1


def backward_workspace_bytes(
    q_rows: int, kv_rows: int, q_heads: int, kv_heads: int, head_dim: int, dtype_bytes: int
) -> float:
    """Bytes a FlashAttention-2 backward call allocates beside its outputs (see the module
    docstring): the fp32 dq accumulator, and with GQA dk/dv at the query heads."""
    dq_accum = 4.0 * q_rows * q_heads * head_dim
    expanded = 2.0 * dtype_bytes * kv_rows * q_heads * head_dim if kv_heads < q_heads else 0.0
    return dq_accum + expanded
