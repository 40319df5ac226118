"""The peak tracer of `loongtrain bench memory --parts trace`: which storages are alive at the
largest moment, counted against what the code below allocates and frees by hand, and
loongtrain's custom attention ops seen from the inside."""

from __future__ import annotations

import torch

from loongtrain.attention.ops import ATTENTION_OPS
from loongtrain.tools.bench.trace import LiveTensors, _python_implementations, by_line

MiB = 2**20


def test_the_snapshot_is_what_is_alive_at_the_largest_moment():
    x = torch.randn(1024, 256)  # 1 MiB, made before the block: not seen
    with LiveTensors() as live:
        live.phase = "one"
        a = x * 2  # 1 MiB alive
        b = a + 1  # 2
        del a  # 1
        live.phase = "two"
        c = b * 3  # 2
        d = torch.cat([b, c])  # 4: the peak (b, c, d)
        del b, c, d  # 0
        e = torch.ones(3 * 1024, 256)  # 3, less than the peak
        small = torch.ones(8)  # under min_bytes: not counted
    assert live.peak == 4 * MiB and live.peak_phase == "two"
    assert sorted((m.op, m.shape, m.nbytes, m.phase) for m in live.snapshot) == [
        ("aten.add.Tensor", (1024, 256), MiB, "one"),
        ("aten.cat.default", (2048, 256), 2 * MiB, "two"),
        ("aten.mul.Tensor", (1024, 256), MiB, "two"),
    ]
    rows = by_line(live.snapshot)
    assert [(op, count, nbytes) for _, op, count, nbytes in rows][0] == ("aten.cat.default", 1, 2 * MiB)
    assert sum(nbytes for *_, nbytes in rows) == live.peak
    del e, small


def test_loongtrain_attention_ops_run_their_python_code_under_the_tracer():
    impls = _python_implementations()
    forward_ops = set(ATTENTION_OPS)
    assert forward_ops <= set(impls)
    assert len(impls) == 2 * len(forward_ops)  # each op and its backward
    assert all(callable(fn) for fn in impls.values())


def test_the_allocator_peak_sees_temporaries_inside_ops_and_names_the_line():
    """An op's internal temporary (logsumexp's ``x - max``) is invisible to the dispatch-mode
    tracer but not to the allocator's events; the peak of a loongtrain function is named by
    its line, a built-in backward by its autograd node."""
    from loongtrain.model.loss import token_scores
    from loongtrain.tools.bench.trace import AllocatorPeak

    x = torch.randn(2048, 1024)  # 8 MiB, made before the blocks
    with AllocatorPeak() as top, LiveTensors() as live:
        torch.logsumexp(x, dim=-1)
    assert live.peak < MiB and top.bytes >= 8 * MiB and top.op.startswith("aten::logsumexp")
    h, w, labels = torch.randn(256, 64), torch.randn(4096, 64), torch.randint(0, 4096, (256,))
    with AllocatorPeak() as top:
        token_scores(h, w, labels, chunk=64)  # one [64, 4096] float32 chunk of logits: 1 MiB
    assert MiB <= top.bytes < 2 * MiB
    if top.python_frames:  # torch 2.11 on Python 3.12 records no Python calls
        assert top.where.startswith("model/loss.py:") and "_chunk" in top.where
    w.requires_grad_()
    with AllocatorPeak() as top:
        torch.nn.functional.linear(h, w).logsumexp(-1).sum().backward()
    assert top.where.startswith("backward of ")


def test_a_view_of_a_storage_made_before_the_block_is_not_new():
    x = torch.randn(1024, 256)  # 1 MiB
    with LiveTensors() as live:
        y = x.t()  # a view: no new storage
        z = y * 1  # 1 MiB, new
    assert live.peak == MiB and [m.op for m in live.snapshot] == ["aten.mul.Tensor"]
    del z
