"""Bad input raises a clear error on every rank before any communication."""

from __future__ import annotations

import pytest
import torch

import loongtrain as lt

from dist_pool import cached_state


def test_init_parallel_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        lt.init_parallel(lt.ParallelConfig())


def _bad_degrees() -> list[str]:
    messages = []
    for cfg in ({"hp": 3}, {"hp": 2, "cp": 2, "dp": 2}, {"cp": 4, "ring_window": 3}):
        try:
            lt.init_parallel(lt.ParallelConfig(**cfg))
        except ValueError as e:
            messages.append(str(e))
        else:
            messages.append("no error")
    return messages


@pytest.mark.dist
def test_bad_degrees_raise_on_every_rank(dist_pool):
    for messages in dist_pool(4).run(_bad_degrees):
        assert "world size 4 is not divisible by sp = hp*cp = 3*1 = 3" in messages[0]
        assert "dp*hp*cp = 2*2*2 = 8 does not equal the world size 4" in messages[1]
        assert "cp=4 is not divisible by ring_window=3" in messages[2]


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.zeros(*shape, dtype=dtype, device=device)


def _bad_attention_calls() -> dict[str, str]:
    s22 = cached_state(hp=2, cp=2)
    s4 = cached_state(hp=4)
    ring = cached_state(cp=4)
    cases = {
        "heads_vs_hp": (s22, _t(1, 4, 3, 8), _t(1, 4, 1, 8), _t(1, 4, 1, 8), {}),
        "groups_vs_hp": (s22, _t(1, 4, 6, 8), _t(1, 4, 3, 8), _t(1, 4, 3, 8), {}),
        "replication": (s4, _t(1, 4, 12, 8), _t(1, 4, 3, 8), _t(1, 4, 3, 8), {}),
        "gqa_ratio": (s22, _t(1, 4, 6, 8), _t(1, 4, 4, 8), _t(1, 4, 4, 8), {}),
        "odd_tokens": (ring, _t(1, 1, 2, 8), _t(1, 1, 2, 8), _t(1, 1, 2, 8), {}),
        "kv_shape": (s22, _t(1, 4, 4, 8), _t(1, 4, 2, 8), _t(1, 4, 4, 8), {}),
        "q_vs_kv": (s22, _t(1, 4, 4, 8), _t(1, 6, 2, 8), _t(1, 6, 2, 8), {}),
        "rank3": (s22, _t(4, 4, 8), _t(1, 4, 2, 8), _t(1, 4, 2, 8), {}),
        "dtypes": (s22, _t(1, 4, 4, 8), _t(1, 4, 2, 8, dtype=torch.bfloat16), _t(1, 4, 2, 8), {}),
        "int_dtype": (s22, *(_t(1, 4, 2, 8, dtype=torch.int32) for _ in range(3)), {}),
        "device": (s22, *(_t(1, 4, 2, 8, device="meta") for _ in range(3)), {}),
        "scale": (s22, _t(1, 4, 4, 8), _t(1, 4, 2, 8), _t(1, 4, 2, 8), {"softmax_scale": -1.0}),
    }
    found = {}
    for name, (state, q, k, v, kwargs) in cases.items():
        try:
            lt.head_context_attention(q, k, v, state, **kwargs)
        except (ValueError, TypeError) as e:
            found[name] = str(e)
        else:
            found[name] = "no error"
    try:
        lt.shard_sequence(_t(1, 30, 2, 8), s22)
    except ValueError as e:
        found["shard"] = str(e)
    return found


EXPECTED = {
    "heads_vs_hp": "query heads H=3 are not divisible by hp=2; choose hp among [1, 3]",
    "groups_vs_hp": "key/value heads G=3 are not divisible by hp=2",
    "replication": "hp=4 exceeds the key/value heads G=3 but is not a multiple of G",
    "gqa_ratio": "query heads H=6 are not a multiple of key/value heads G=4",
    "odd_tokens": "needs an even number of tokens per context rank",
    "kv_shape": "k (1, 4, 2, 8) and v (1, 4, 4, 8) must have the same shape",
    "q_vs_kv": "must agree in batch, local sequence length and head_dim",
    "rank3": "q must be 4-D",
    "dtypes": "dtypes differ",
    "int_dtype": "dtype torch.int32 is not supported by the cpu-flash attention kernel",
    "device": "inputs are on meta but the process groups communicate on cpu",
    "scale": "softmax_scale=-1.0 must be a positive finite number",
    "shard": "sequence length 30 is not divisible by 2*sp = 2*2*2 = 8",
}


@pytest.mark.dist
def test_bad_attention_inputs_raise_on_every_rank(dist_pool):
    for found in dist_pool(4).run(_bad_attention_calls):
        for name, text in EXPECTED.items():
            assert text in found[name], f"{name}: {found[name]!r}"


def _mismatched_shapes() -> str:
    state = cached_state(cp=2)
    s_local = 4 if state.rank == 0 else 6
    q = torch.randn(1, s_local, 2, 8)
    try:
        lt.head_context_attention(q, q, q, state)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.dist
def test_shape_mismatch_across_ranks_is_caught(dist_pool):
    for message in dist_pool(2).run(_mismatched_shapes):
        assert "passed different inputs" in message
        assert "rank 0: q=(1, 4, 2, 8)" in message and "rank 1: q=(1, 6, 2, 8)" in message


def _error(fn) -> str:
    try:
        fn()
    except (ValueError, TypeError) as e:
        return str(e)
    return "no error"


def _bad_mask_calls() -> dict[str, str]:
    state = cached_state(hp=2, cp=2)  # local [1, 4, 4, 8] -> S = 16
    docs = cached_state(hp=2, cp=2, balance="documents")
    q, kv = _t(1, 4, 4, 8), _t(1, 4, 2, 8)
    x = _t(1, 16, 2, 8)
    layout_of_docs = lt.sequence_layout(16, docs, [0, 5, 16])
    cases = {
        "start": lambda: lt.sequence_layout(16, state, [2, 16]),
        "end": lambda: lt.sequence_layout(16, state, [0, 8]),
        "increasing": lambda: lt.sequence_layout(16, state, [0, 9, 5, 16]),
        "float": lambda: lt.sequence_layout(16, state, torch.tensor([0.0, 16.0])),
        "length": lambda: lt.sequence_layout(12, state, [0, 12]),
        "sliding_window": lambda: lt.head_context_attention(q, kv, kv, state, sliding_window=0),
        # the balance is the state's: a layout cut with one balance cannot serve a state of another
        "other_balance": lambda: lt.head_context_attention(q, kv, kv, state, layout=layout_of_docs),
        "other_length": lambda: lt.head_context_attention(q, kv, kv, docs, layout=lt.sequence_layout(32, docs)),
        "docs_needs_layout": lambda: lt.head_context_attention(q, kv, kv, docs),
        "shard_docs_needs_layout": lambda: lt.shard_sequence(x, docs),
        "unshard_other_balance": lambda: lt.unshard_sequence(q, state, layout=layout_of_docs),
        "no_per_call_balance": lambda: lt.shard_sequence(x, state, balance="documents"),
        "not_a_layout": lambda: lt.shard_sequence(x, state, layout=[0, 5, 16]),
    }
    return {name: _error(fn) for name, fn in cases.items()}


MASK_EXPECTED = {
    "start": "cu_seqlens must start at 0, got 2",
    "end": "cu_seqlens must end at the global sequence length S=16, got 8",
    "increasing": "strictly increasing, got 9 then 5",
    "float": "1-D integer tensor",
    "length": "sequence length 12 is not divisible by 2*sp = 2*2*2 = 8",
    "sliding_window": "sliding_window=0 must be a positive int",
    "other_balance": "head_context_attention: the layout was made for hp=2, cp=2, balance='documents', S=16 but is "
    "used with hp=2, cp=2, balance='zigzag', S=16",
    "other_length": "the layout was made for hp=2, cp=2, balance='documents', S=32 but is used with",
    "docs_needs_layout": "head_context_attention: balance='documents' lays each batch out by its document boundaries",
    "shard_docs_needs_layout": "shard_sequence: balance='documents' lays each batch out by its document boundaries",
    "unshard_other_balance": "unshard_sequence: the layout was made for hp=2, cp=2, balance='documents'",
    "no_per_call_balance": "unexpected keyword argument 'balance'",
    "not_a_layout": "layout must be a SequenceLayout (from sequence_layout), got list",
}


@pytest.mark.dist
def test_bad_masks_raise_on_every_rank(dist_pool):
    for found in dist_pool(4).run(_bad_mask_calls):
        for name, text in MASK_EXPECTED.items():
            assert text in found[name], f"{name}: {found[name]!r}"


def _mismatched_documents() -> str:
    state = cached_state(cp=2)
    q = torch.randn(1, 4, 2, 8)
    cu = [0, 3, 8] if state.rank == 0 else [0, 5, 8]
    try:
        lt.head_context_attention(q, q, q, state, layout=lt.sequence_layout(8, state, cu))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.dist
def test_documents_differing_across_ranks_are_caught(dist_pool):
    for message in dist_pool(2).run(_mismatched_documents):
        assert "passed different inputs" in message and "same layout (cu_seqlens)" in message
