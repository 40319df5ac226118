"""Planner topology, feasibility rules, search on cases with a known optimum, baselines,
bad input (clear errors, exit status 2) and the CLI. Pure: no processes."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import replace

import pytest

from loongtrain.model.config import PRESETS, ModelConfig
from loongtrain.parallel import ParallelConfig, RankLayout
from loongtrain.planner import cli
from loongtrain.planner.cost import Candidate, Workload
from loongtrain.planner.estimate import estimate
from loongtrain.planner.explain import explain
from loongtrain.planner.memory import memory_bytes
from loongtrain.planner.search import BASELINES, check_candidate, enumerate_layouts, leanest, search_layouts
from loongtrain.planner.specs import (
    CLUSTER_FIELDS,
    CLUSTER_PRESETS,
    PlanError,
    cluster_spec,
    cluster_to_toml,
    load_cluster_file,
    model_spec,
)
from loongtrain.planner.topology import analyze

A100 = CLUSTER_PRESETS["a100"]
M1 = 2**20


# -- topology ---------------------------------------------------------------------------
def test_topology_by_hand():
    ring = analyze(
        ParallelConfig(hp=1, cp=16, ring_window=1, placement="head_first"), 8
    )  # 16 consecutive ranks: one hop per node leaves it
    assert (ring.outer.crosses, ring.outer.off_node, ring.outer.on_node, ring.inner.size) == (True, 1, 7, 1)
    hf = analyze(
        ParallelConfig(hp=8, cp=8, ring_window=1, placement="head_first"), 8
    )  # head group = a node; every ring hop leaves it
    assert hf.head.off_peers == 0 and (hf.outer.crosses, hf.outer.off_node) == (True, 8)
    cf = analyze(
        ParallelConfig(hp=8, cp=8, ring_window=1, placement="context_first"), 8
    )  # ring = a node; all-to-all across 8 nodes
    assert (cf.head.off_peers, cf.head.ranks_off) == (7, 8) and not cf.outer.crosses
    dr = analyze(
        ParallelConfig(hp=1, cp=64, ring_window=8, placement="head_first"), 8
    )  # windows of 8 = nodes: inner NVLink, outer all 8 ranks
    assert not dr.inner.crosses and (dr.outer.crosses, dr.outer.off_node) == (True, 8)
    assert dr.double_ring_concurrent
    twod = analyze(
        ParallelConfig(hp=2, cp=32, ring_window=4, placement="head_first"), 8
    )  # a window of 4 contexts x 2 heads fills a node
    assert twod.head.off_peers == 0 and not twod.inner.crosses and twod.outer.off_node == 8


@pytest.mark.parametrize(
    "hp, cp, window, placement, dpn",
    [
        (1, 16, 4, "head_first", 8),
        (2, 8, 2, "context_first", 8),
        (4, 4, 2, "head_first", 2),
        (2, 6, 3, "head_first", 4),
    ],
)
def test_topology_matches_brute_force_over_all_rings(hp, cp, window, placement, dpn):
    nics = max(1, dpn // 2)  # two ranks per NIC: local ranks 2k and 2k+1 share NIC k
    topo = analyze(ParallelConfig(hp=hp, cp=cp, ring_window=window, placement=placement), dpn, nics)
    world = 2 * hp * cp
    layout = RankLayout.build(ParallelConfig(hp=hp, cp=cp, ring_window=window, placement=placement), world)
    per_nic = {}
    for name, rings, traffic in (
        ("inner", layout.all_inner_rings(), topo.inner),
        ("outer", layout.all_outer_rings(), topo.outer),
    ):
        off, on = {}, {}
        for ring in rings:
            for pos, src in enumerate(ring if len(ring) > 1 else ()):
                dst = ring[(pos + 1) % len(ring)]
                table = off if dst // dpn != src // dpn else on
                table[src // dpn] = table.get(src // dpn, 0) + 1
                if dst // dpn != src // dpn:
                    for rank, way in ((src, "out"), (dst, "in")):
                        nic = (rank // dpn, rank % dpn // 2, way)
                        per_nic.setdefault(nic, {"inner": 0, "outer": 0})[name] += 1
        assert traffic.crosses == bool(off)
        assert traffic.off_node == max(off.values(), default=0)
        assert traffic.on_node == max(on.values(), default=0)
        assert traffic.per_nic == max((n[name] for n in per_nic.values()), default=0)
    assert set(topo.nic_loads) == {(n["inner"], n["outer"]) for n in per_nic.values()}
    worst = max(sum(1 for o in g if o // dpn != r // dpn) for g in layout.all_head_groups() for r in g)
    assert topo.head.off_peers == worst


# -- enumeration and feasibility --------------------------------------------------------
def test_enumeration_count_small_case_by_hand():
    debug = PRESETS["debug"]  # H=4, G=2
    # batch 1 -> dp=1, sp=4: hp=1 (cp=4: windows 1, 2), hp=2 (cp=2: window 1, two placements),
    # hp=4 (cp=1; 4 is a multiple of G=2); ZeRO none/dp_sp; 3 checkpoint modes
    assert len(enumerate_layouts(debug, Workload(debug, 1024, batch=1), 4)) == (2 + 2 + 1) * 2 * 3 == 30
    # batch 4 adds dp=4 (sp=1: zero none/dp) and dp=2 (sp=2: hp=1 or 2, all four scopes)
    assert len(enumerate_layouts(debug, Workload(debug, 1024, batch=4), 4)) == 30 + 2 * 3 + 2 * 4 * 3 == 60


def test_enumeration_count_1024_devices():
    m = PRESETS["7b-gqa"]  # H=32, G=8: hp in 1, 2, 4, 8 (divide G), 16, 32 (multiples of G)
    # batch 1 -> dp=1, sp=1024, cp = 1024/hp; windows: the divisors of cp below cp (log2 cp of them);
    # placements 2 when hp > 1; ZeRO none/dp_sp; 3 modes
    expected = (10 * 1 + 9 * 2 + 8 * 2 + 7 * 2 + 6 * 2 + 5 * 2) * 2 * 3
    w = Workload(m, M1)
    assert len(enumerate_layouts(m, w, 1024)) == expected == 480
    result = search_layouts(A100, w, 1024)
    assert result.n_candidates == 480 and len(result.ranked) + len(result.too_big) == 480
    assert result.elapsed_s > 0  # printed by the CLI; not asserted against a bound (machine noise)


def test_feasibility_rules():
    w = Workload(PRESETS["7b-gqa"], 64 * 1024)
    check_candidate(w, Candidate.of(hp=8, cp=8, ring_window=4, placement="context_first"), 64)
    bad = [
        (Candidate.of(hp=8, cp=4), "dp\\*hp\\*cp"),
        (Candidate.of(hp=8, cp=8, zero="all"), "zero="),
        (Candidate.of(dp=2, hp=4, cp=8), "batch=1"),
        (Candidate.of(hp=8, cp=8, mlp_tile=2048), "mlp_tile=2048 is larger than a rank's shard of 1024 tokens"),
        (
            Candidate.of(hp=8, cp=8, activation_checkpoint="sc++", activation_checkpoint_layers=40),
            "activation_checkpoint_layers=40 but the model has 32 layers",
        ),
    ]
    for layout, message in bad:
        with pytest.raises(PlanError, match=message):
            check_candidate(w, layout, 64)
    with pytest.raises(PlanError, match="hp=3 does not fit the model's heads"):
        check_candidate(w, Candidate.of(hp=3, cp=8), 24)
    with pytest.raises(PlanError, match="2\\*sp"):
        check_candidate(Workload(PRESETS["7b-gqa"], 1000), Candidate.of(hp=8, cp=8), 64)
    # the holders' own checks, through --layout: one line naming the value
    for text, message in (
        ("hp=8,cp=8,w=3", "not divisible by ring_window=3"),
        ("hp=8,cp=8,placement=diagonal", "placement"),
        ("hp=8,cp=8,ckpt=some", "activation checkpoint mode 'some'"),
        ("hp=8,cp=8,ckpt=none,offload=activations", "offload_activations moves what activation checkpointing"),
    ):
        with pytest.raises(PlanError, match=message):
            cli.parse_candidate(text, 64)


# -- search: cases with a known optimum -------------------------------------------------
H8 = ModelConfig(vocab_size=1000, dim=1024, n_layers=4, n_heads=8, n_kv_heads=8, ffn_dim=2048)
NODE8 = replace(A100, name="node8", nodes=1)


def test_compute_bound_cluster_keeps_every_activation():
    fast = replace(
        NODE8,
        intra_bw_gbs=1e6,
        intra_node_bw_gbs=8e6,
        a2a_bw_gbs=1e6,
        intra_latency_us=1e-3,
        a2a_latency_us=1e-3,
        kernel_overhead_us=1e-3,
        hop_sync_us=0.0,
        device_memory_gib=1e4,
    )
    best = search_layouts(fast, Workload(H8, 64 * 1024), 8).best
    assert best.candidate.checkpoint == "none"  # nothing to recompute, nothing to wait for
    assert best.ring_s + best.a2a_s < 1e-3 * best.step_s


def test_memory_limit_picks_selective_checkpoint():
    w = Workload(H8, 256 * 1024)
    big = replace(NODE8, device_memory_gib=1e4)
    result = search_layouts(big, w, 8)
    # without checkpointing, even the leanest options (MLP tiles) keep every layer's activations
    need_none = min(
        memory_bytes(w, leanest(big, w, e.candidate)).total for e in result.ranked if e.candidate.checkpoint == "none"
    )
    need_sc = min(
        memory_bytes(w, leanest(big, w, e.candidate)).total for e in result.ranked if e.candidate.checkpoint == "sc++"
    )
    assert need_sc < need_none
    limit_gib = (need_sc + need_none) / 2 / 2**30 / NODE8.usable_memory_fraction
    best = search_layouts(replace(NODE8, device_memory_gib=limit_gib), w, 8).best
    assert best.candidate.checkpoint == "sc++"  # none does not fit; sc++ recomputes less than full


def test_slow_all_to_all_picks_the_ring_and_slow_p2p_picks_ulysses():
    w = Workload(H8, 64 * 1024)
    slow_a2a = search_layouts(replace(NODE8, a2a_bw_gbs=1e-3), w, 8).best
    assert slow_a2a.candidate.parallel.hp == 1
    slow_p2p = search_layouts(replace(NODE8, intra_bw_gbs=1e-3, intra_node_bw_gbs=8e-3), w, 8).best
    assert slow_p2p.candidate.parallel.cp == 1 and slow_p2p.candidate.parallel.hp == 8


def test_double_ring_wins_when_the_ring_crosses_nodes():
    # one head (hp must be 1): only the ring can spread the sequence; 2 nodes of 8
    one_head = ModelConfig(vocab_size=1000, dim=1024, n_layers=4, n_heads=1, n_kv_heads=1, ffn_dim=2048)
    result = search_layouts(replace(A100, nic_bw_gbs=5.0), Workload(one_head, 64 * 1024), 16)
    best = result.best
    assert 1 < best.candidate.parallel.ring_window < 16  # inner ring on NVLink, outer hop hidden behind window blocks
    plain = min((e for e in result.ranked if e.candidate.parallel.ring_window == 1), key=lambda e: e.step_s)
    assert plain.ring_s > 1.5 * best.ring_s and plain.step_s > 1.5 * best.step_s
    assert any("double ring" in line for line in explain(result))


def test_double_ring_windows_larger_than_a_node_are_not_slower_than_one_ring():
    # 7b-mha 128K, hp=1, cp=64 (8 nodes): windows of 16 and 32 span 2 and 4 nodes. Per outer
    # step each outer transfer crosses its NIC once, next to the inner ring's node-crossing
    # hops on the same NIC: per window of inner steps the busiest NIC carries one block more
    # than the plain ring's (h100: a NIC per GPU) or two (a100: a NIC per two GPUs), and
    # fair sharing slows the inner hops it overlaps. So: a few percent, not the 2.2x that
    # charging the outer transfer to every inner step gave.
    w = Workload(PRESETS["7b-mha"], 128 * 1024)
    for name, slack in (("h100", 1.05), ("a100", 1.10)):
        c = CLUSTER_PRESETS[name]
        plain = estimate(c, w, Candidate.of(cp=64, activation_checkpoint="sc++")).step_s
        for window in (16, 32):
            double = estimate(c, w, Candidate.of(cp=64, ring_window=window, activation_checkpoint="sc++")).step_s
            assert double <= slack * plain, f"{name} window {window}: {double:.2f} s vs ring {plain:.2f} s"
        # windows of one node keep the inner ring on NVLink: much faster than the NIC-bound ring
        assert estimate(c, w, Candidate.of(cp=64, ring_window=8, activation_checkpoint="sc++")).step_s < 0.5 * plain


def test_global_batch_in_tokens_sets_the_sequences_and_is_reported(capsys):
    w = Workload.from_tokens(PRESETS["7b-gqa"], 128 * 1024, 4 * M1)
    assert (w.batch, w.tokens) == (32, 4 * M1)
    with pytest.raises(PlanError, match="not a whole number of 131072-token sequences"):
        Workload.from_tokens(PRESETS["7b-gqa"], 128 * 1024, 4 * M1 + 1024)
    # the default is a 4M-token global batch, and every report says which batch it assumed
    _cli(["--model", "7b-gqa", "--seq-len", "1M", "--devices", "64", "--top", "1"])
    assert "global batch 4M tokens (4 x 1M sequences) per step" in capsys.readouterr().out
    _cli(["--model", "7b-gqa", "--seq-len", "1M", "--devices", "64", "--global-batch", "1M", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert (data["global_batch_tokens"], data["batch"]) == (M1, 1)
    _cli(["--model", "7b-gqa", "--seq-len", "128K,1M", "--devices", "64"])
    assert "global batch 4M tokens per step" in capsys.readouterr().out


def test_baselines_are_their_families_and_never_beat_loongtrain():
    result = search_layouts(A100, Workload(PRESETS["7b-mha"], 256 * 1024), 64)
    assert result.baselines["DeepSpeed-Ulysses"] is None  # sp=64 > H=32 with batch 1
    for name, base in result.baselines.items():
        if base is not None:
            assert BASELINES[name](base.candidate)
            assert base.candidate.checkpoint != "sc++"
            assert result.best.step_s <= base.step_s
    megatron = result.baselines["Megatron-CP"].candidate.parallel
    assert (megatron.hp, megatron.ring_window) == (1, 1)
    gqa = search_layouts(A100, Workload(PRESETS["7b-gqa"], 128 * 1024), 32)
    assert gqa.baselines["DeepSpeed-Ulysses"].candidate.parallel.cp == 1


def test_estimate_reports_consistent_numbers():
    w = Workload(PRESETS["7b-gqa"], 128 * 1024, batch=4)
    e = estimate(A100, w, Candidate.of(dp=2, hp=4, cp=4, ring_window=2, activation_checkpoint="sc++"))
    assert e.microbatches == 2
    assert e.step_s == pytest.approx(e.compute_s + e.a2a_s + e.ring_s + e.zero_s + e.offload_s)
    assert e.tokens_per_s_per_device == pytest.approx(4 * 128 * 1024 / (e.step_s * 32))
    assert 0 < e.mfu < 1


# -- bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cluster, model, seq, devices, message",
    [
        ("a100", "7b-gqa", M1, 60, "devices=60 is not a multiple of devices_per_node=8"),
        ("a100", "7b-gqa", M1, 2048, "exceeds cluster 'a100'"),
        ("a100", "7b-mha", 16 * M1, 8, "does not fit on 8 devices"),
        ("a100", "7b-mha", 1000, 64, "seq_len=1000 is not a multiple of 2\\*sp"),
    ],
)
def test_impossible_requests_explain_themselves(cluster, model, seq, devices, message):
    with pytest.raises(PlanError, match=message):
        search_layouts(cluster_spec(cluster), Workload(model_spec(model), seq), devices)


def test_head_groups_that_do_not_split_the_heads_are_refused():
    from loongtrain.planner.search import check_candidate

    w = Workload(PRESETS["llama3-8b"], 64 * 1024)
    with pytest.raises(PlanError, match="layout: head_groups=3 does not split the model's heads"):
        check_candidate(w, Candidate.of(head_groups=3), 1)
    with pytest.raises(PlanError, match="layout: head_groups=8: a group of 4 query .* over hp=8"):
        check_candidate(w, Candidate.of(hp=8, head_groups=8), 8)
    check_candidate(w, Candidate.of(hp=8, head_groups=4), 8)


def test_too_long_sequence_suggests_more_devices():
    with pytest.raises(PlanError, match="devices would fit"):
        search_layouts(A100, Workload(PRESETS["7b-mha"], 8 * M1), 8)


def test_unknown_presets():
    with pytest.raises(PlanError, match="unknown cluster 'tpu'"):
        cluster_spec("tpu")
    with pytest.raises(PlanError, match="unknown model '70b'"):
        model_spec("70b")


def test_cluster_file_round_trip_and_errors(tmp_path):
    good = tmp_path / "a100.toml"
    good.write_text(cluster_to_toml(A100, {"nic_bw_gbs": "4 x HDR"}, header="test cluster"))
    loaded = load_cluster_file(good)
    for name in CLUSTER_FIELDS:  # numbers are written with six significant digits
        want = getattr(A100, name)
        assert getattr(loaded, name) == (want if isinstance(want, (str, type(None))) else pytest.approx(want, rel=1e-6))
    assert cluster_spec(str(good)).name == "a100"
    text = good.read_text()
    cases = {
        "unknown.toml": (text + "gpus = 8\n", "unknown key\\(s\\) \\['gpus'\\]"),
        "missing.toml": (text.replace("nic_bw_gbs", "# nic_bw_gbs"), "missing key\\(s\\) \\['nic_bw_gbs'\\]"),
        "negative.toml": (text.replace("nodes = 128", "nodes = -1"), "nodes=-1 must be positive"),
        "zero_bw.toml": (text.replace("intra_bw_gbs = 240.0", "intra_bw_gbs = 0.0"), "intra_bw_gbs=0.0 must be"),
        "text.toml": (text.replace("nodes = 128", 'nodes = "many"'), "nodes='many' must be an integer"),
        "broken.toml": ("nodes = = 3\n", "not valid TOML"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_text(content)
        with pytest.raises(PlanError, match=message):
            load_cluster_file(path)
    with pytest.raises(PlanError, match="does not exist"):
        cluster_spec(str(tmp_path / "absent.toml"))
    assert set(CLUSTER_FIELDS) >= {"nics_per_node", "nic_bw_gbs", "intra_bw_gbs", "peak_tflops", "device_memory_gib"}


def test_presets_are_valid_and_named():
    for name, spec in CLUSTER_PRESETS.items():
        assert spec.name == name and spec.devices_per_node == 8
        assert spec.matmul_tflops < spec.peak_tflops and spec.attn_fwd_tflops < spec.peak_tflops
    assert CLUSTER_PRESETS["a100"].peak_tflops == 312 and CLUSTER_PRESETS["h800"].peak_tflops == 989
    assert CLUSTER_PRESETS["h800"].intra_bw_gbs < CLUSTER_PRESETS["h100"].intra_bw_gbs


# -- CLI -----------------------------------------------------------------------------------
def _cli(argv: list[str]) -> None:
    from loongtrain import plan_cli

    parser = argparse.ArgumentParser(prog="loongtrain plan")
    plan_cli.add_arguments(parser)
    plan_cli.main(parser.parse_args(argv))


@pytest.mark.parametrize("text, tokens", [("128K", 131072), ("1M", 1048576), ("4096", 4096), ("0.5M", 524288)])
def test_parse_length(text, tokens):
    assert cli.parse_length(text) == tokens


@pytest.mark.parametrize("text", ["12Q", "M", "-4K", "1.3K", ""])
def test_parse_length_rejects(text):
    with pytest.raises(ValueError, match="length"):
        cli.parse_length(text)


def test_cli_table_and_json(capsys):
    _cli(["--model", "7b-gqa", "--seq-len", "256K", "--devices", "32", "--top", "3"])
    out = capsys.readouterr().out
    assert "MFU" in out and "Megatron-CP" in out and "why:" in out and "planned in" in out
    _cli(["--model", "7b-gqa", "--seq-len", "256K", "--devices", "32", "--json", "--layout", "hp=8,cp=4,ckpt=full"])
    data = json.loads(capsys.readouterr().out)
    assert data["candidates"] > 0 and len(data["ranked"]) == 10
    assert data["layout"]["hp"] == 8 and data["layout"]["activation_checkpoint"] == "full"
    assert set(data["baselines"]) == set(BASELINES)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seq-len", "1M", "--devices", "60"], "devices=60 is not a multiple"),
        (["--seq-len", "1M", "--devices", "64", "--cluster", "tpu"], "unknown cluster"),
        (["--seq-len", "1M", "--devices", "64", "--model", "70b"], "unknown model"),
        (["--seq-len", "64M", "--devices", "8", "--model", "7b-mha", "--global-batch", "64M"], "does not fit"),
        (["--seq-len", "1M", "--devices", "64", "--global-batch", "1536K"], "not a whole number of 1048576-token"),
        (["--seq-len", "8M", "--devices", "64"], "less than one sequence of 8388608; use --global-batch 8388608"),
        (["--devices", "8"], "--seq-len and --devices are required"),
        (["--seq-len", "1M", "--devices", "64", "--layout", "hp=3"], "hp\\*cp = 3\\*1 = 3 does not divide"),
        (["--seq-len", "1M", "--devices", "64", "--layout", "hp=4,cp=16,w=3"], "ring_window=3"),
        (["--seq-len", "1M", "--devices", "64", "--layout", "heads=4"], "cannot read 'heads=4'"),
    ],
)
def test_cli_errors_exit_2_without_traceback(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _cli(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("loongtrain plan: error:")
    assert re.search(message, err)


# -- --layout beside the search ---------------------------------------------------------------
@pytest.fixture(scope="module")
def h100_32k():
    """Llama-3-8B at 32K on 8 H100s: the search and a parse of a --layout on it."""
    c, w = CLUSTER_PRESETS["h100"], Workload.from_tokens(model_spec("llama3-8b"), 32 * 1024, 4 * M1)
    return c, w, search_layouts(c, w, 8)


def _standing(h100_32k, text: str):
    from loongtrain.planner.report import layout_standing

    c, w, result = h100_32k
    chosen = estimate(c, w, cli.parse_candidate(text, 8))
    return chosen, layout_standing(result, chosen)


def test_layout_outside_the_search_that_fits_is_ranked_by_its_time(h100_32k):
    # dp=8 with ckpt=full on every layer fits (27.3 GiB): the search lists dp=8 as zero=dp and
    # checkpoints only its first 22 layers, so the asked layout is no searched row, yet it fits
    _, _, result = h100_32k
    chosen, s = _standing(h100_32k, "hp=1,cp=1,ckpt=full")
    assert chosen.fits
    faster = sum(1 for e in result.ranked if e.step_s < chosen.step_s)
    assert s.rank == faster + 1 and 1 < s.rank < len(result.ranked)
    n = len(result.ranked)
    assert s.text == f"fits: 27.3 of 72.0 GiB per device; rank {s.rank} beside the {n} searched layouts that fit"
    x = s.searched.candidate
    assert (x.parallel.dp, x.parallel.sp, x.zero, x.checkpoint) == (8, 1, "dp", "full")
    assert x.memory.activation_checkpoint_layers == 22
    assert s.searched is result.ranked[s.searched_rank - 1]
    assert "zero=dp_sp as zero=dp (the same shards at dp=8, sp=1)" in s.note
    assert f"row {s.searched_rank}: ch1024 first22, where --layout asks ch1024" in s.note


@pytest.mark.parametrize("row", [0, 7, 60])
def test_layout_that_is_a_searched_row_gets_its_rank(h100_32k, row):
    from loongtrain.planner.report import layout_standing

    c, w, result = h100_32k
    chosen = estimate(c, w, result.ranked[row].candidate)
    s = layout_standing(result, chosen)
    assert (s.rank, s.text, s.note) == (row + 1, f"rank {row + 1} of {len(result.ranked)}", None)


def test_layout_written_another_way_is_the_searched_row(h100_32k):
    # hp=4 x cp=1 with context_first is the searched head_first row 1 (placement matters only with hp, cp > 1)
    _, s = _standing(h100_32k, "hp=4,cp=1,ckpt=none,placement=context_first")
    assert s.rank == 1 and s.text.startswith("rank 1 of ")
    why = "placement=context_first as head_first (the same groups when hp or cp is 1)"
    assert s.note == f"a searched row: the search lists {why}"


def test_layout_that_does_not_fit_says_by_how_much_and_where_the_search_fits_it(h100_32k):
    _, _, result = h100_32k
    chosen, s = _standing(h100_32k, "hp=1,cp=1,ckpt=none")
    assert not chosen.fits and s.rank is None
    assert s.text == "does not fit: needs 172.7 GiB per device, more than the usable 72.0 GiB"
    assert s.searched.candidate.memory.mlp_tile > 0 and s.searched is result.ranked[s.searched_rank - 1]
    assert s.note == f"the search fits this layout with the memory options it picks: row {s.searched_rank}"


@pytest.mark.parametrize(
    "asked, listed",
    [
        (dict(dp=8, zero="dp_sp"), dict(zero="dp")),  # sp=1: every rank is the dp group
        (dict(dp=8, zero="sp"), dict(zero="none")),
        (dict(dp=1, cp=8, zero="dp"), dict(zero="none")),  # dp=1: nothing to shard over
        (dict(dp=1, cp=8, zero="sp"), dict(zero="dp_sp")),
        (dict(dp=1, zero="dp_sp"), dict(zero="none")),  # one rank
        (dict(dp=2, hp=2, cp=2, zero="sp"), dict(zero="sp")),  # dp, sp > 1: four distinct scopes
        (dict(dp=1, cp=8, ring_window=8), dict(ring_window=1)),  # one window of the whole ring
        (dict(dp=2, hp=4, placement="context_first"), dict(placement="head_first")),
        (dict(dp=2, cp=4, placement="context_first"), dict(placement="head_first")),
        (dict(dp=2, hp=2, cp=2, placement="context_first"), dict(placement="context_first")),
    ],
)
def test_listed_form_is_the_searched_equivalent(asked, listed):
    from loongtrain.planner.search import listed_form

    c, w = CLUSTER_PRESETS["h100"], Workload.from_tokens(model_spec("llama3-8b"), 32 * 1024, 4 * M1)
    x = Candidate.of(activation_checkpoint="full", **asked)
    y = listed_form(x)
    assert y == x.with_(**listed)
    assert any((e.parallel, e.zero) == (y.parallel, y.zero) for e in enumerate_layouts(w.model, w, x.devices))
    a, b = estimate(c, w, x), estimate(c, w, y)
    assert (a.step_s, a.memory.total) == (b.step_s, b.memory.total)


def test_cli_layout_row_says_it_fits_and_its_rank(capsys):
    # before: "--layout (does not fit in memory; 1.19x ...)" for a layout its own JSON priced as fitting
    argv = "--cluster h100 --model llama3-8b --seq-len 32K --devices 8 --layout hp=1,cp=1,ckpt=full".split()
    _cli(argv)
    out = capsys.readouterr().out.split("\n--layout (")[1]
    assert out.startswith("fits: 27.3 of 72.0 GiB per device; rank ") and "does not fit" not in out
    assert "not itself a searched row: the search lists zero=dp_sp as zero=dp" in out
    _cli([*argv, "--json"])
    layout = json.loads(capsys.readouterr().out)["layout"]
    assert layout["fits"] and layout["rank"] > 1 and layout["standing"].startswith("fits: 27.3 of 72.0 GiB")
    assert layout["searched"]["activation_checkpoint_layers"] == 22 and layout["searched"]["rank"] < layout["rank"]
