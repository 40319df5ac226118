"""The event-driven schedule simulator against the closed-form ring model and the
transfer counts of the real schedule; the timeline picture. Pure: no processes."""

from __future__ import annotations

import pytest

from loongtrain.model.config import PRESETS
from loongtrain.planner.cost import (
    Candidate,
    Workload,
    attention_seconds,
    candidate_topology,
    comm_volume,
    dkv_hops,
)
from loongtrain.planner.simulate import simulate_layer
from loongtrain.planner.specs import CLUSTER_PRESETS
from loongtrain.planner.timeline import draw_timelines

A100 = CLUSTER_PRESETS["a100"]

LAYOUTS = [
    Candidate.of(cp=16),  # plain ring across two nodes
    Candidate.of(cp=16, ring_window=2),
    Candidate.of(cp=16, ring_window=8),  # windows = nodes
    Candidate.of(cp=16, ring_window=16),  # the same ring as window 1
    Candidate.of(hp=8, cp=8, placement="head_first"),
    Candidate.of(hp=8, cp=8, ring_window=2, placement="head_first"),
    Candidate.of(hp=4, cp=8, ring_window=4, placement="context_first"),
    Candidate.of(hp=32, cp=1),  # Ulysses
]


@pytest.mark.parametrize("model, seq", [("7b-gqa", 128 * 1024), ("7b-mha", 1024 * 1024)])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.label())
def test_simulator_agrees_with_closed_form(model, seq, layout):
    w = Workload(PRESETS[model], seq)
    fwd, bwd = simulate_layer(A100, w, layout)
    closed = attention_seconds(A100, w, layout, candidate_topology(A100, layout))
    assert fwd.makespan == pytest.approx(closed.fwd, rel=0.05)
    assert bwd.makespan == pytest.approx(closed.bwd, rel=0.05)
    # exposed time is what the ring and the all-to-alls add on top of the block kernels
    assert fwd.busy(0) == pytest.approx(closed.kernels_fwd, rel=1e-9)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.label())
def test_simulated_transfers_match_the_schedule(layout):
    w = Workload(PRESETS["7b-gqa"], 64 * 1024)
    fwd, bwd = simulate_layer(A100, w, layout)
    vol = comm_volume(w, layout.parallel)
    for rank in (0, layout.parallel.cp - 1):
        kv_fwd = sum(fwd.count(lane, "kv", rank) for lane in ("inner link", "outer link"))
        kv_bwd = sum(bwd.count(lane, "kv", rank) for lane in ("inner link", "outer link"))
        dkv = sum(bwd.count(lane, "dkv", rank) for lane in ("inner link", "outer link"))
        assert kv_fwd == kv_bwd == vol.count("fwd.ring_kv") == max(0, layout.parallel.cp - 1)
        assert dkv == vol.count("bwd.ring_dkv") == dkv_hops(layout.parallel)
        assert fwd.count("compute", "fwd", rank) == bwd.count("compute", "bwd", rank) == layout.parallel.cp
        assert fwd.count("compute", "fwd diagonal", rank) == 1  # the causal block of its own chunks


def test_double_ring_hides_what_the_plain_ring_exposes():
    # a plain ring over four nodes exposes 24 ms that the double ring hides; over eight nodes
    # (cp=64, 1M tokens) it is the same, 48 ms against none, but 7 s of simulation instead of 1 s
    w = Workload(PRESETS["7b-mha"], 512 * 1024)
    plain, _ = simulate_layer(A100, w, Candidate.of(cp=32))
    double, _ = simulate_layer(A100, w, Candidate.of(cp=32, ring_window=4))
    assert plain.exposed(0) > 10 * double.exposed(0)


def test_timeline_png(tmp_path):
    layout = Candidate.of(hp=2, cp=8, ring_window=4, placement="context_first")
    fwd, bwd = simulate_layer(A100, Workload(PRESETS["7b-gqa"], 256 * 1024), layout)
    path = draw_timelines(fwd, bwd, tmp_path / "sub" / "timeline.png", layout.label(), ranks=(0, 1))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_simulated_nics_are_shared_by_both_rings():
    # hp=8 cp=8 window 2, head_first: every node holds one context index, so every inner and
    # outer hop leaves the node, and two ranks share each of the node's four NICs. The outer
    # transfer slows the inner hops it overlaps: this double ring is slower than one ring,
    # in the simulation of the links and in the closed form.
    w = Workload(PRESETS["7b-mha"], 128 * 1024)
    layout = Candidate.of(hp=8, cp=8, ring_window=2, placement="head_first")
    fwd, _ = simulate_layer(A100, w, layout)
    plain, _ = simulate_layer(A100, w, Candidate.of(hp=8, cp=8, placement="head_first"))
    assert fwd.makespan > 1.15 * plain.makespan
    closed = attention_seconds(A100, w, layout, candidate_topology(A100, layout))
    assert fwd.makespan == pytest.approx(closed.fwd, rel=0.05)


@pytest.mark.parametrize("window", [16, 32])
def test_windows_larger_than_a_node_agree_with_the_link_simulation(window):
    # the inner ring crosses nodes too; the closed form's fluid model of the busiest shared NIC
    # stays within 10% of the event-driven simulation of every NIC (the gap: send and receive
    # NICs of a hop are paced separately in the simulation)
    w = Workload(PRESETS["7b-mha"], 128 * 1024)
    layout = Candidate.of(cp=64, ring_window=window)
    fwd, bwd = simulate_layer(A100, w, layout)
    closed = attention_seconds(A100, w, layout, candidate_topology(A100, layout))
    assert fwd.makespan == pytest.approx(closed.fwd, rel=0.10)
    assert bwd.makespan == pytest.approx(closed.bwd, rel=0.10)
