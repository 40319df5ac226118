"""The peak tracer of `loongtrain bench memory --parts trace`: what the allocator holds at the
largest moment, counted against what the code below allocates and frees by hand, every byte
of it named (the op, the loongtrain line, the phase), temporaries inside ops and backward
allocations included."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongtrain.tools.bench.trace import PHASE, AllocatorPeak, by_line

MiB = 2**20


def _phase(name: str) -> None:
    with torch.profiler.record_function(PHASE + name):
        pass


def _big(held) -> list:
    return sorted((h.op, h.nbytes, h.phase) for h in held if h.nbytes >= 64 * 1024)


def test_the_peak_holds_what_is_alive_at_the_largest_moment_byte_for_byte():
    x = torch.randn(1024, 256)  # 1 MiB, made before the block
    with AllocatorPeak() as top:
        _phase("one")
        a = x * 2  # 1 MiB alive
        b = a + 1  # 2
        del a  # 1
        _phase("two")
        c = b * 3  # 2
        d = torch.cat([b, c])  # 4: the peak (b, c, d)
        del b, c, d  # 0
        e = torch.ones(3 * 1024, 256)  # 3, less than the peak
        del x  # an older storage's free: not counted (the profiler does not report it)
    assert 4 * MiB <= top.bytes < 4 * MiB + 4096 and top.phase == "two" and top.op == "aten::cat"
    assert _big(top.held) == [("aten::add", MiB, "one"), ("aten::cat", 2 * MiB, "two"), ("aten::mul", MiB, "two")]
    assert sum(h.nbytes for h in top.held) == top.bytes  # every byte named
    rows = by_line(top.held)
    assert (rows[0][1], rows[0][2], rows[0][3]) == ("aten::cat", 1, 2 * MiB)
    del e


def test_a_phase_s_own_peak():
    x = torch.randn(1024, 256)  # 1 MiB
    with AllocatorPeak(within="one") as top:
        _phase("one")
        a = x * 2
        b = a + 1  # 2 MiB: phase one's peak
        del a
        _phase("two")
        c = torch.cat([b, b, b])  # 4 MiB: the block's peak, in phase two
        del b, c
    assert 2 * MiB <= top.bytes < 2 * MiB + 4096 and top.phase == "one"
    assert _big(top.held) == [("aten::add", MiB, "one"), ("aten::mul", MiB, "one")]


def test_the_allocator_peak_sees_temporaries_inside_ops_and_names_the_line():
    """An op's internal temporary (logsumexp's ``x - max``) is held at the peak and named by
    the op inside the op; an allocation of a loongtrain function is named by its line."""
    from loongtrain.model.loss import token_scores

    x = torch.randn(2048, 1024)  # 8 MiB, made before the block
    with AllocatorPeak() as top:
        torch.logsumexp(x, dim=-1)
    assert top.bytes >= 8 * MiB and [op for op, *_ in _big(top.held)] == ["aten::logsumexp > aten::sub"]
    h, w, labels = torch.randn(256, 64), torch.randn(4096, 64), torch.randint(0, 4096, (256,))
    with AllocatorPeak() as top:
        token_scores(h, w, labels, chunk=64)  # one [64, 4096] float32 chunk of logits: 1 MiB
    assert MiB <= top.bytes < 2 * MiB
    (logits,) = [held for held in top.held if held.nbytes == MiB]
    if top.python_frames:  # (a profiler that records no Python calls names no lines)
        assert logits.where.startswith("model/loss.py:") and logits.where.endswith(":_logits")


def test_a_built_in_backward_is_named_by_the_forward_line_that_made_its_node():
    """The whole-shard loss (built-in ops): the gradient of the logits, made in backward, is
    named by the autograd node and by the line of ``lm_loss`` that ran the forward op (both in
    the block: a backward whose forward ran before it is named "of ?")."""
    from loongtrain.model.loss import lm_loss

    h = torch.randn(256, 64, requires_grad=True)
    w = torch.randn(4096, 64, requires_grad=True)
    labels = torch.randint(0, 4096, (256,))
    with AllocatorPeak() as top:
        loss, _ = lm_loss(h, w, labels, chunk=0)
        loss.backward()
    # [256, 4096] float32: the saved log-softmax (forward) and the gradients made in backward
    wheres = {held.where for held in top.held if held.nbytes >= MiB}
    backward = {where for where in wheres if where.startswith("backward (")}
    assert backward, wheres
    if top.python_frames:
        assert all(" of model/loss.py:" in where and where.endswith(":lm_loss") for where in backward), wheres
    ref = F.cross_entropy(F.linear(h.detach().double(), w.detach().double()), labels, reduction="sum")
    assert abs(loss.item() - ref.item()) <= 1e-5 * ref.item()
