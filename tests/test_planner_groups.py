"""The layout the planner picks for N devices (up to 1024) is the layout ``init_parallel``
builds: its groups are instantiated on PyTorch's fake backend in this one process and
compared with the plan (group members, ring order, and which hops leave a node)."""

from __future__ import annotations

import pytest

from loongtrain.model.config import PRESETS
from loongtrain.planner.cost import Candidate, Workload
from loongtrain.planner.search import search_layouts
from loongtrain.planner.specs import CLUSTER_PRESETS
from loongtrain.tools.calibrate.groups import check_groups

A100 = CLUSTER_PRESETS["a100"]


@pytest.mark.parametrize(
    "model, seq, devices, batch",
    [
        ("7b-gqa", 1024 * 1024, 64, 1),
        ("7b-mha", 256 * 1024, 256, 1),
        ("7b-gqa", 1024 * 1024, 1024, 1),
        ("7b-gqa", 128 * 1024, 1024, 16),
    ],
)
def test_planned_layout_groups_are_built(model, seq, devices, batch):
    best = search_layouts(A100, Workload(PRESETS[model], seq, batch=batch), devices).best
    lines = check_groups(best.candidate, A100.devices_per_node)
    assert len(lines) == 4 and all(line.startswith("rank ") for line in lines)


def test_double_ring_context_first_groups_at_1024():
    layout = Candidate.of(dp=2, hp=8, cp=64, ring_window=8, placement="context_first")
    lines = check_groups(layout, 8, ranks=[0, 511, 777, 1023])
    assert any("other node" in line for line in lines)
