"""Planner cost formulas against hand-computed cases: FLOPs per ring step, communication
volumes per scheme, link and ring-schedule times, ZeRO collectives, memory by scope,
and the calibration fits. Pure: no processes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loongtrain.model.config import PRESETS, ModelConfig
from loongtrain.parallel.config import ParallelConfig
from loongtrain.planner.cost import (
    Candidate,
    Workload,
    all_to_all_seconds,
    comm_volume,
    dkv_hops,
    linear_flops_fwd,
    overlapped,
    ring_backward_seconds,
    ring_forward_seconds,
    ring_hop_seconds,
    ring_step_flops,
    shared_outer_step_seconds,
)
from loongtrain.planner.fit import fit_line, fit_two
from loongtrain.planner.memory import layer_bytes, memory_bytes
from loongtrain.planner.specs import CLUSTER_PRESETS
from loongtrain.planner.topology import HeadTraffic, RingTraffic, Topology
from loongtrain.planner.zero import collective_seconds, group_shape, shard_degree

# H=4 query heads, G=2 KV heads, head_dim 16
M = ModelConfig(vocab_size=100, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
A100 = CLUSTER_PRESETS["a100"]


def test_ring_step_flops_by_hand():
    w = Workload(M, seq_len=64)
    # hp=2, cp=4: half of a (64/4 = 16) x 16 block on 4/2 = 2 heads of dim 16: 4*16*16*2*16 / 2
    assert ring_step_flops(w, 2, 4) == 16384
    assert ring_step_flops(replace(w, causal=False), 2, 4) == 32768
    # every rank's cp steps together are the causal attention of the sequence (2*S^2*H*d) / sp
    for hp, cp in [(1, 1), (1, 4), (2, 2), (4, 1), (2, 4), (4, 8)]:
        assert cp * ring_step_flops(w, hp, cp) * hp * cp == 2 * 64 * 64 * 4 * 16


def test_linear_flops_and_params_by_hand():
    # q, o: 64*64 each; k, v: 64*32 each; SwiGLU: 3*64*128
    assert M.layer_matmul_params() == 4096 + 2 * 2048 + 4096 + 3 * 8192 == 36864
    assert M.layer_params() == 36864 + 2 * 64  # + two norms
    assert M.num_params() == M.n_layers * M.layer_params() + 2 * 100 * 64 + 64
    assert linear_flops_fwd(Workload(M, seq_len=64), sp=4) == 2 * 16 * 36864


@pytest.mark.parametrize(
    "hp, cp, window, expected",
    [
        # 2D, hp=4 > G=2 (KV replicated to 4 heads), S/sp = 8 tokens, bf16:
        # q 8*4*16*2 = 1024 B, kv 2*8*4*16*2 = 2048 B, out 1024 B; ring block 2*32*(4/4)*16 = 1024
        # elements (2048 B bf16, 4096 B fp32), 1 KV hop, 1 dK/dV partial
        (
            4,
            2,
            1,
            {
                "fwd.all_to_all": (3, 4096),
                "bwd.all_to_all": (3, 4096),
                "fwd.ring_kv": (1, 2048),
                "bwd.ring_kv": (1, 2048),
                "bwd.ring_dkv": (1, 4096),
            },
        ),
        # double ring cp=8, w=2: block 2*8*2*16 = 512 elements; 7 KV hops; dK/dV one partial per remote reader
        (1, 8, 2, {"fwd.ring_kv": (7, 7168), "bwd.ring_kv": (7, 7168), "bwd.ring_dkv": (7, 14336)}),
        # Ulysses hp=2: S/sp = 32 tokens: q 32*4*16*2 = 4096, kv 2*32*2*16*2 = 4096, out 4096
        (2, 1, 1, {"fwd.all_to_all": (3, 12288), "bwd.all_to_all": (3, 12288)}),
    ],
)
def test_comm_volume_by_hand(hp, cp, window, expected):
    assert comm_volume(Workload(M, seq_len=64), ParallelConfig(hp=hp, cp=cp, ring_window=window)).kinds == expected


@pytest.mark.parametrize(
    "cp, window, hops", [(1, 1, 0), (4, 1, 3), (4, 4, 3), (4, 2, 3), (8, 2, 7), (8, 4, 7), (16, 8, 15)]
)
def test_dkv_hops(cp, window, hops):
    assert dkv_hops(ParallelConfig(cp=cp, ring_window=window)) == hops


def test_ring_forward_schedule_by_hand():
    # one window of 4: three inner hops each hidden behind (or exposing past) one block
    assert ring_forward_seconds(1, 4, 1.0, 0.5, 0.0) == 4.0
    assert ring_forward_seconds(1, 4, 1.0, 2.0, 0.0) == 3 * 2.0 + 1.0
    # plain ring of 4 windows of 1: three outer hops of 3 s behind 1 s blocks
    assert ring_forward_seconds(4, 1, 1.0, 0.0, 3.0) == 3 * 3.0 + 1.0
    # two windows of 2: the outer hop (3 s) hides behind 2 blocks + 1 inner hop, partly
    assert ring_forward_seconds(2, 2, 1.0, 0.5, 3.0) == 3.0 + 2.0
    # no overlap at all: every transfer adds to the compute
    assert ring_forward_seconds(1, 2, 1.0, 0.5, 0.0, overlap=0.0) == 2.5
    assert overlapped(1.0, 0.4, 0.5) == 1.2


def test_ring_backward_schedule_by_hand():
    def hop(nbytes):  # one second per byte
        return nbytes

    assert ring_backward_seconds(1, 1, 1.0, hop, hop, 0.5, 1.0) == 1.0  # one block, nothing to send
    # plain ring of 2: KV hop hidden, then the other rank's partial goes home, exposed
    assert ring_backward_seconds(2, 1, 1.0, hop, hop, 0.5, 1.0) == 1.0 + 1.0 + 1.0
    # inner ring of 2: step 0 sends KV (hidden), step 1's partial goes home, exposed
    assert ring_backward_seconds(1, 2, 1.0, hop, hop, 0.5, 1.0) == 1.0 + 1.0 + 1.0
    # inner ring of 3: step 0's gradient stays with its owner, so step 1 carries KV only; step 2
    # carries step 1's partial (1 s, hidden behind the block); the last partial's trip home exposed
    assert ring_backward_seconds(1, 3, 1.0, hop, hop, 0.5, 1.0) == 1.0 + 1.0 + 1.0 + 1.0
    # two windows of 2: window 0 is 2 s (its KV hops hidden); window 1's step 0 carries KV and
    # the home hop of window 0's partial (1.5 s), its step 1 its own chain's partial (1 s,
    # hidden); its total goes home across windows at the end (1 s)
    assert ring_backward_seconds(2, 2, 1.0, hop, hop, 0.5, 1.0) == 2.0 + (1.5 + 1.0) + 1.0


def test_ring_hop_time_by_link_and_nic_sharing():
    one_gb = 1e9
    across = RingTraffic(size=16, crosses=True, off_node=1, on_node=7, per_nic=1)
    crowded = RingTraffic(size=8, crosses=True, off_node=8, on_node=0, per_nic=2)
    inside = RingTraffic(size=8, crosses=False, off_node=0, on_node=8)
    # one transfer leaving the node uses its rank's NIC at 22.5 GB/s
    assert ring_hop_seconds(A100, across, one_gb) == pytest.approx(15e-6 + 1 / 22.5)
    # eight transfers leave through the node's four NICs, two ranks on each: 11.25 GB/s each
    assert ring_hop_seconds(A100, crowded, one_gb) == pytest.approx(15e-6 + 1 / 11.25)
    # inside the node: NVLink, 240 GB/s per device (non-blocking switch)
    assert ring_hop_seconds(A100, inside, one_gb) == pytest.approx(10e-6 + 1 / 240)


def test_outer_step_sharing_a_nic_with_the_inner_ring_by_hand():
    # windows of 16 on a100 nodes: the NIC of local ranks 6 and 7 carries one inner hop (7 -> 8)
    # and two outer hops (6 and 7 -> next window) at once; flows share a NIC fairly
    c = replace(A100, inter_latency_us=1e-9)
    topo = Topology(
        head=HeadTraffic(size=1, off_peers=0, ranks_off=0),
        inner=RingTraffic(size=16, crosses=True, off_node=1, on_node=7, per_nic=1),
        outer=RingTraffic(size=4, crosses=True, off_node=8, on_node=0, per_nic=2),
        nic_loads=((1, 2),),
    )
    b = 22.5e9  # one second on one NIC
    # outer block = inner block: the first inner hop runs at 1/3 of the NIC (3 s) while both outer
    # blocks finish with it; the next two hops have the NIC (1 s each, compute 0.5 s hidden); last compute
    assert shared_outer_step_seconds(c, topo, 0.5, [b, b, b, 0.0], b) == pytest.approx(3 + 1 + 1 + 0.5)
    # outer blocks of 4: every inner hop shares (3 x 3 s, b each), then the outer flows have the
    # NIC at 1/2 each: 0.25 b during the last compute, 0.75 b after (1.5 s)
    assert shared_outer_step_seconds(c, topo, 0.5, [b, b, b, 0.0], 4 * b) == pytest.approx(9 + 0.5 + 1.5)
    # the same step with nothing to share: just the node fabric bound of the inner hops inside the node
    alone = replace(topo, nic_loads=((1, 0), (0, 2)))
    assert shared_outer_step_seconds(c, alone, 0.5, [b, b, b, 0.0], b) == pytest.approx(7 * 3 * b / (1920e9))


def test_all_to_all_time_inside_and_across_nodes():
    nbytes = 8e9  # packed buffer: 1 GB to each of 8 head ranks (own chunk included)
    inside = HeadTraffic(size=8, off_peers=0, ranks_off=0)
    across = HeadTraffic(size=8, off_peers=7, ranks_off=8)
    sync = A100.hop_sync_us * 1e-6  # posting the collective and waiting for it
    assert all_to_all_seconds(A100, inside, nbytes) == pytest.approx(7 * 10e-6 + 7 / 210 + sync)
    # every device of the node sends 7 GB off the node through 4 NICs of 22.5 GB/s
    assert all_to_all_seconds(A100, across, nbytes) == pytest.approx(7 * 15e-6 + 7 / 11.25 + sync)


def test_zero_collectives_and_shard_degree():
    # all-gather of 8 GB over 8 devices of one node: 7/8 of it at 240 GB/s
    node = group_shape(tuple(range(8)), 8)
    assert node == (8, 1, 8)
    assert collective_seconds(A100, node, 8e9, "ag") == pytest.approx(7 / 240 + 7 * 10e-6)
    # over 16 devices (2 nodes, one group): the node's NICs carry it at 90 GB/s
    two = group_shape(tuple(range(16)), 8)
    assert collective_seconds(A100, two, 16e9, "rs") == pytest.approx(15 / 90 + 15 * 15e-6)
    assert collective_seconds(A100, two, 16e9, "ar") == pytest.approx(2 * (15 / 90 + 15 * 15e-6))
    # 8 groups of 2 (one member per node) share the NICs: 11.25 GB/s each
    strided = group_shape((0, 8), 8)
    assert strided == (2, 2, 1)
    assert collective_seconds(A100, strided, 2e9, "ag") == pytest.approx(1 / 11.25 + 15e-6)
    degrees = {zero: shard_degree(Candidate.of(dp=2, hp=2, cp=2, zero=zero)) for zero in ("none", "dp", "sp", "dp_sp")}
    assert degrees == {"none": 1, "dp": 2, "sp": 4, "dp_sp": 8}


def test_memory_states_by_zero_scope():
    w = Workload(PRESETS["7b-gqa"], seq_len=8192, batch=2)
    params = PRESETS["7b-gqa"].num_params()
    for zero, degree in (("none", 1), ("dp", 2), ("sp", 4), ("dp_sp", 8)):
        terms = dict(memory_bytes(w, Candidate.of(dp=2, hp=2, cp=2, zero=zero)).terms)
        assert terms["params"] == 4 * params / degree  # fp32 parameters
        assert terms["optimizer"] == 8 * params / degree  # two fp32 AdamW moments


def test_kept_bytes_by_checkpoint_mode_by_hand():
    # bf16; D=64, H=4, G=2, d=16, F=128
    assert layer_bytes(M, 1, 1, 2, "full", False).kept == 2 * 64
    # sc++ keeps the block input, the ring output and its fp32 lse
    assert layer_bytes(M, 1, 1, 2, "sc++", False).kept == 128 + 2 * 4 * 16 + 4 * 4
    # ... and with hp > 1 also the head-scattered q, kv (G=2 -> 2 heads) and the gathered output
    assert layer_bytes(M, 2, 1, 2, "sc++", False).kept == 272 + 2 * (4 + 2 * 2) * 16 + 2 * 4 * 16
    # none: two norms (bf16 input, fp32 1/rms), the MLP's projection input (norm1 and wq/wk/wv are one
    # function keeping only the norm's input), q/kv/out/lse, four SwiGLU tensors
    assert layer_bytes(M, 1, 1, 2, "none", False).kept == 2 * (2 * 64 + 4) + 2 * 64 + 400 + 4 * 2 * 128
    for name in ("7b-mha", "7b-gqa"):
        m = PRESETS[name]
        none, sc, full = (layer_bytes(m, 4, 1, 2, mode, False).kept for mode in ("none", "sc++", "full"))
        assert none > sc > full


def test_memory_shrinks_with_more_sequence_parallelism():
    w = Workload(PRESETS["7b-mha"], seq_len=256 * 1024)
    totals = [memory_bytes(w, Candidate.of(cp=cp, activation_checkpoint="full")).total for cp in (8, 16, 32)]
    assert totals[0] > totals[1] > totals[2]


def test_fit_line_and_fit_two_recover_known_coefficients():
    xs = [1e5, 1e6, 4e6, 1.6e7]
    assert fit_line(xs, [2e-3 + 3e-9 * x for x in xs]) == pytest.approx((2e-3, 3e-9))
    rows = [(1, 0.5e6), (3, 0.75e6), (1, 8e6), (3, 12e6)]
    assert fit_two(rows, [1e-3 * u + 2e-9 * v for u, v in rows]) == pytest.approx((1e-3, 2e-9))
    with pytest.raises(ValueError, match="noise"):
        fit_line(xs, [1.0 - 1e-9 * x for x in xs])


def test_fit_cluster_from_synthetic_measurements():
    from loongtrain.planner.fit import fit_cluster

    sizes = [2**18, 2**20, 2**22, 2**24]
    heads, head_dim = 8, 64

    def causal_flops(tokens):
        return 2.0 * tokens * tokens * heads * head_dim

    meas = {
        "nproc": 4,
        "memory_gib": 16.0,
        "calib_heads": heads,
        "calib_head_dim": head_dim,
        "pair": [(b, 1e-3 + b / 1e9) for b in sizes],
        "ring": [(b, 1e-3 + b / 0.5e9) for b in sizes],
        "a2a": [(g, b, 1e-4 * (g - 1) + (g - 1) / g * b / 0.8e9) for g in (2, 4) for b in sizes],
        "fwd": [(causal_flops(s), 2e-4 + causal_flops(s) / 20e9, False) for s in (512, 1024, 2048)]
        + [(causal_flops(s), 2e-4 + causal_flops(s) * (1 + 256 / s) / 20e9, True) for s in (1024, 4096)],
        "bwd": [(causal_flops(s), 3e-4 + 2.5 * causal_flops(s) / 25e9, False) for s in (512, 1024, 2048)]
        + [(causal_flops(s), 3e-4 + 2.5 * causal_flops(s) * (1 + 256 / s) / 25e9, True) for s in (1024, 4096)],
        "matmul_alone": 50e9,
        "matmul_all": 20e9,
        "overlap": {"compute": 0.1, "transfer": 0.1, "both": 0.15},
        # a ring step of 20 ms whose block alone takes 17 ms, over a 1 ms link latency: 2 ms to meet
        "step": {"step": 0.020, "block": 0.017},
    }
    spec, comments = fit_cluster(meas)
    assert (spec.nodes, spec.devices_per_node, spec.device_memory_gib) == (1, 4, 4.0)
    assert spec.intra_bw_gbs == pytest.approx(1.0)
    assert spec.intra_latency_us == pytest.approx(1000)
    assert spec.intra_node_bw_gbs == pytest.approx(2.0)
    assert spec.a2a_bw_gbs == pytest.approx(0.8)
    assert spec.a2a_latency_us == pytest.approx(100)
    assert spec.attn_fwd_tflops == pytest.approx(0.02)
    assert spec.attn_bwd_tflops == pytest.approx(0.025)
    assert spec.kernel_overhead_us == pytest.approx(200)
    assert spec.kernel_bwd_overhead_us == pytest.approx(300)
    assert spec.hop_sync_us == pytest.approx(2000)
    assert spec.causal_tile == pytest.approx(256)
    assert spec.overlap == pytest.approx(0.5)
    assert (spec.peak_tflops, spec.matmul_tflops) == pytest.approx((0.05, 0.02))
    assert set(comments) <= set(spec.__dataclass_fields__)


def test_validation_probe_and_drift_rescaling():
    from loongtrain.planner.validation import probe_seconds, rescaled

    local = replace(A100, name="local", attn_wave_rows=0.0, kernel_bwd_overhead_us=30.0)
    flops = 2.0 * 2048 * 2048 * 8 * 64  # half of a 2048 x 2048 block, 8 heads of 64
    fwd, bwd = probe_seconds(local, 8, 64)
    assert fwd == pytest.approx(20e-6 + flops / 215.6e12)
    assert bwd == pytest.approx(30e-6 + 2.5 * flops / 182.2e12)
    # the machine runs the probe 2x (forward) and 3x (backward) slower than calibrated
    slower = rescaled(local, (2 * fwd, 3 * bwd), (fwd, bwd))
    assert probe_seconds(slower, 8, 64) == pytest.approx((2 * fwd, 3 * bwd))
    assert (slower.intra_bw_gbs, slower.hop_sync_us) == (local.intra_bw_gbs, local.hop_sync_us)


def test_a_sliding_layer_is_priced_by_its_window():
    """OLMo 3 7B at 128K on 8 H100s (cp = 8): a sliding layer's kernels take the share of keys its
    window leaves (a query sees min(i + 1, 4096) keys, not i + 1), the mean layer is 3 sliding to 1
    full, and below a chunk (8192 tokens) its halo hides behind its kernels."""
    from loongtrain.model import PRESETS
    from loongtrain.planner.cost import (
        Candidate,
        Workload,
        attention_seconds,
        candidate_topology,
        layer_attention_seconds,
        sliding_attention_seconds,
    )  # fmt: skip
    from loongtrain.planner.specs import cluster_spec

    cluster, model, seq = cluster_spec("h100"), PRESETS["olmo3-7b"], 131072
    layout = Candidate.of(cp=8)
    w, topo = Workload(model, seq), candidate_topology(cluster, layout)
    full = attention_seconds(cluster, w, layout, topo)
    sliding = sliding_attention_seconds(cluster, w, layout, topo, 4096, full)
    share = sum(min(i + 1, 4096) for i in range(seq)) / sum(i + 1 for i in range(seq))
    assert sliding.kernels_fwd == pytest.approx(full.kernels_fwd * share, rel=1e-9)
    mean = layer_attention_seconds(cluster, w, layout, topo)
    assert mean.kernels_bwd == pytest.approx((8 * full.kernels_bwd + 24 * sliding.kernels_bwd) / 32, rel=1e-9)
    assert sliding.ring_fwd < 1.01 * sliding.kernels_fwd < full.ring_fwd / 5
