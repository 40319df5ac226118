"""The attention layer over head groups (``memory.head_groups``, :mod:`loongtrain.model.head_groups`)
equals the plain attention layer in float64, output and every gradient, in one group and
several, GQA whole groups and groups inside one key/value head, with q/k norms and biases,
packed documents and a sliding window; in fp32 and bf16. The distributed wiring is checked
by training (tests/test_parallel_training.py, tests/test_memory_options.py)."""

from __future__ import annotations

import functools

import pytest
import torch

from loongtrain.apply.attention import check_head_groups
from loongtrain.attention.layout import sequence_layout
from loongtrain.attention.local import LocalSplitAttention
from loongtrain.model.config import ModelConfig
from loongtrain.model.head_groups import head_group_attention
from loongtrain.model.lean import lean_normed_projections, tiled_rope
from loongtrain.model.llama import Attention, rope_tables
from loongtrain.model.norm import RMSNorm
from loongtrain.parallel.layout import head_group_slices

pytestmark = pytest.mark.unit


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _layer(cfg: ModelConfig, seed: int) -> tuple[Attention, RMSNorm]:
    gen = torch.Generator().manual_seed(seed)
    attention, norm = Attention(cfg).double(), RMSNorm(cfg.dim, cfg.norm_eps).double()
    with torch.no_grad():
        for p in (*attention.parameters(), *norm.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * (0.3 if p.dim() > 1 else 1.0))
    return attention, norm


def _run(attention: Attention, norm: RMSNorm, x, dy, cos, sin, layout):
    x = x.detach().requires_grad_()
    out = attention(x, norm, cos, sin, layout)
    out.backward(dy)
    grads = {"x": x.grad}
    for name, p in (*attention.named_parameters(), *(("norm." + n, p) for n, p in norm.named_parameters())):
        grads[name] = p.grad
    return out.detach(), grads


CASES = [
    # (n_heads, n_kv_heads, groups, extras)
    (8, 2, 2, {}),  # whole GQA groups per head group
    (8, 2, 4, {}),  # groups inside one key/value head
    (8, 2, 8, {"qk_norm": True, "qkv_bias": True}),  # one head a group, Qwen3/Qwen2 pieces
    (4, 4, 2, {"sliding_window": 7}),  # MHA, a window
    (8, 2, 1, {}),  # one group: the same function, every head at once
    (8, 2, 4, {"keep": False}),  # no output kept: backward runs each group's attention again
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[0]}-G{c[1]}-g{c[2]}" + "".join(f"-{k}" for k in c[3]))
def test_head_groups_equal_the_plain_attention_in_float64(case, dtype):
    heads, kv_heads, groups, extras = case
    extras = dict(extras)
    keep = extras.pop("keep", True)
    cfg = ModelConfig(dim=64, n_heads=heads, n_kv_heads=kv_heads, **extras)
    seq, cu = 40, [0, 9, 26, 40]  # three packed documents
    layout = sequence_layout(seq, None, cu)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])])
    cos, sin = rope_tables(positions.unsqueeze(0), cfg.head_dim, cfg.rope_theta)
    gen = torch.Generator().manual_seed(groups)
    x = torch.randn(2, seq, cfg.dim, generator=gen, dtype=torch.float64)
    dy = torch.randn(2, seq, cfg.dim, generator=gen, dtype=torch.float64)

    ref_attention, ref_norm = _layer(cfg, seed=11)
    want_out, want = _run(ref_attention, ref_norm, x, dy, cos.double(), sin.double(), layout)

    def errors(groups: int | None) -> dict[str, float]:
        attention, norm = _layer(cfg, seed=11)
        attention, norm = attention.to(dtype), norm.to(dtype)
        attention.projections, attention.rope = lean_normed_projections, tiled_rope  # as parallelize runs it
        if groups is not None:
            split = LocalSplitAttention()
            grouped = functools.partial(head_group_attention, groups=groups, attention=split, keep=keep)
            attention.over_head_groups = grouped
        out, got = _run(attention, norm, x.to(dtype), dy.to(dtype), cos, sin, layout)
        assert out.dtype == dtype and set(got) == set(want)
        assert all(got[name] is not None and got[name].dtype == dtype for name in want)
        return {"out": _rel(out, want_out)} | {name: _rel(got[name], want[name]) for name in want}

    grouped = errors(groups)
    if dtype == torch.float32:
        assert max(grouped.values()) <= 5e-6, grouped
    else:  # bf16: no further from float64 than the layer without groups
        plain = errors(None)
        for name, err in grouped.items():
            assert err <= 1.25 * plain[name] + 1e-3, (name, err, plain[name])


def test_head_group_slices_and_refusals():
    assert head_group_slices(8, 2, 2) == [(slice(0, 4), slice(0, 1)), (slice(4, 8), slice(1, 2))]
    assert head_group_slices(8, 2, 4)[3] == (slice(6, 8), slice(1, 2))
    assert head_group_slices(32, 8, 4)[1] == (slice(8, 16), slice(2, 4))
    with pytest.raises(ValueError, match="head_groups=3 does not split the model's heads"):
        head_group_slices(8, 2, 3)
    with pytest.raises(ValueError, match="head_groups=0 must be a positive integer"):
        head_group_slices(8, 2, 0)
    cfg = ModelConfig(dim=64, n_heads=8, n_kv_heads=2)
    check_head_groups(cfg, 2, [1, 2, 4])  # 4 query heads and one key/value head a group: hp 4 replicates it
    with pytest.raises(ValueError, match=r"head_groups=4: a group of 2 query .* over hp=4 .* use fewer head groups"):
        check_head_groups(cfg, 4, [4])
    from loongtrain.options import MemoryOptions

    with pytest.raises(ValueError, match="head_groups=0 must be a positive integer"):
        MemoryOptions(head_groups=0)
