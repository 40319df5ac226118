"""The step breakdown of ``bench train``: the interval arithmetic against hand-counted
timelines, the event names it sorts, and one real profiled step of the model."""

from __future__ import annotations

import time

import pytest
import torch
from torch.profiler import profile, record_function

from loongtrain.attention.kernels import CpuFlashBackend
from loongtrain.tools.bench.step_profile import Span, breakdown, classify, spans_of


def test_breakdown_counts_each_instant_once_by_precedence():
    spans = [
        Span(0.0, 10.0, "compute"),  # an op holding everything below
        Span(1.0, 3.0, "attention"),
        Span(2.0, 4.0, "communication"),  # overlaps the kernel: attention wins on [2, 3]
        Span(12.0, 13.0, "communication"),
        Span(12.5, 14.0, "compute"),
        Span(-5.0, 0.5, "attention"),  # clipped to the step
        Span(19.0, 25.0, "compute"),  # clipped to the step
    ]
    parts = breakdown(spans, 0.0, 20.0)
    assert parts["attention"] == pytest.approx(0.5 + 2.0)  # [0, 0.5] and [1, 3]
    assert parts["communication"] == pytest.approx(1.0 + 1.0)  # [3, 4] and [12, 13]
    assert parts["compute"] == pytest.approx(0.5 + 6.0 + 1.0 + 1.0)  # [0.5,1], [4,10], [13,14], [19,20]
    assert parts["framework"] == pytest.approx(2.0 + 5.0)  # [10, 12] and [14, 19]
    assert sum(parts.values()) == pytest.approx(20.0)


def test_breakdown_of_nothing_is_framework_and_refuses_a_reversed_step():
    assert breakdown([], 1.0, 3.0) == {"attention": 0.0, "communication": 0.0, "compute": 0.0, "framework": 2.0}
    with pytest.raises(ValueError, match="ends"):
        breakdown([], 3.0, 1.0)


def test_classify_names():
    assert classify("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention"
    assert classify("aten::_efficient_attention_forward") == "attention"
    assert classify("loongtrain::comm_wait") == "communication"
    assert classify("c10d::allgather_") == "communication"
    assert classify("FSDP::all_gather") == "communication"
    assert classify("aten::mm") == "compute"
    assert classify("Torch-Compiled Region: 0/0") == "compute"
    assert classify("ampere_sgemm_128x64_tn", device_kernel=True) == "compute"
    assert classify("FSDP::pre_forward") is None  # a Python-level range: framework
    assert classify("ampere_sgemm_128x64_tn") is None


def test_a_profiled_step_splits_its_wall_time():
    """A real profile: the attention kernel's own time shows up as attention, the matmuls as
    compute, and a sleep in Python as framework; the parts add up to the step."""
    q = torch.randn(1, 256, 4, 32, requires_grad=True)
    w = torch.randn(512, 512)
    with profile() as prof:
        with record_function("step"):
            out, _ = CpuFlashBackend().forward(q, q, q, causal=True, scale=32**-0.5)
            for _ in range(20):
                w = w @ w / 512
            time.sleep(0.05)
    spans, start, end = spans_of(prof.events(), "step", device_kernels=False)
    parts = breakdown(spans, start, end)
    assert sum(parts.values()) == pytest.approx(end - start)
    assert parts["attention"] > 0 and parts["compute"] > 0
    assert parts["framework"] >= 0.05  # the sleep
    assert parts["communication"] == 0.0
    with pytest.raises(ValueError, match="no profiler range"):
        spans_of(prof.events(), "not-there", device_kernels=False)
