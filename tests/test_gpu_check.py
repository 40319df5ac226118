"""The GPU check (``scripts/gpu_check.sh``) and the GPU run (``scripts/gpu_run.sh``) kept from
rotting without a GPU.

- The GPU run runs with ``--device cpu`` (the check at tiny sizes, every section, the compiled
  training row too, 2 gloo ranks for the distributed part; the peer benchmark at 64 and 128
  tokens; the verdict): no row fails or is skipped; every kernel of the grid is within the
  float64 bounds written here; the replay's overhead ratio is a number; each training row's MFU
  equals tokens/s x FLOPs/token (counted here by hand from the model's shape) over the peak the
  table states; the table printed and the JSON agree; the correctness rows come first; every
  row was written as a JSON line; what it leaves in OUT and prints fits what comes back from the
  GPU machine (at most 8 files, 16 MiB each, 64 MiB in all, two folders deep, plain names, 12,000
  characters of output), ending with the verdict table.
- The CUDA profile's kernel calls fit PyTorch's op schemas (meta device), its training
  rows fit one H200 by the planner, and its distributed sizes are valid for 2 to 8 GPUs.
- What cannot run is a ``skipped`` row with the reason; ``--device cuda`` without a GPU is
  a one-line error; the GPU run on a machine whose Python has no CUDA torch is a one-line error
  that installs nothing; its stages' timeouts add up to at most 6 minutes.
- The verdict of a killed check: read from its JSON lines, its report rebuilt.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cuda_rules import CudaArgumentRules
from loongtrain.apply import MemoryOptions
from loongtrain.attention.kernels import CudaSdpaBackend
from loongtrain.parallel.layout import check_head_split, check_sequence_length
from loongtrain.planner import cluster_spec
from loongtrain.tools.gpucheck.check import PROFILES, Budget, dist_rows, kernel_rows, replay_status, training_status
from loongtrain.tools.gpucheck.dist import check_layouts, documents, training_layout
from loongtrain.tools.gpucheck.kernels import case_inputs, installed_backends, kernel_grid, run_case
from loongtrain.tools.gpucheck.train import TrainCase, predict_step, resolve_auto_case

REPO = Path(__file__).resolve().parents[1]
# norm-relative bounds against float64 for out/dq/dk/dv, absolute for lse (nats)
BOUND = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 4e-3}
LSE_BOUND = {"float32": 1e-5, "bfloat16": 1e-3, "float16": 1e-3}


def _run_script(
    *args: str, timeout: float = 300, script: str = "gpu_check.sh", env: dict | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOONGTRAIN_PYTHON": sys.executable, **(env or {})}
    return subprocess.run(
        ["bash", str(REPO / "scripts" / script), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _hand_flops_per_token(cfg, seq: int) -> float:
    """3 x forward FLOPs: 2 per weight of the q/k/v/o projections and the SwiGLU MLP, 4 x H x d
    per key seen (mean causal context (S+1)/2) in attention, 2 per weight of the output layer."""
    hd = cfg.dim // cfg.n_heads
    weights = cfg.dim * cfg.n_heads * hd * 2 + 2 * cfg.dim * cfg.n_kv_heads * hd + 3 * cfg.dim * cfg.ffn_dim
    per_layer = 2 * weights + 4 * cfg.n_heads * hd * (seq + 1) / 2
    return 3 * (cfg.n_layers * per_layer + 2 * cfg.dim * cfg.vocab_size)


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
    """``scripts/gpu_run.sh --device cpu OUT``: its output and OUT."""
    out = tmp_path_factory.mktemp("gpu_run") / "out"
    traces = out.parent / "traces"
    env = {"GPU_RUN_TRACES": str(traces)}
    proc = _run_script("--device", "cpu", str(out), script="gpu_run.sh", timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr, out


@pytest.fixture(scope="module")
def cpu_run(gpu_run):
    """The GPU check's printed table (its log) and its JSON report, from the GPU run."""
    _, out = gpu_run
    return (out / "gpu_check.log").read_text(), json.loads((out / "gpu_check.json").read_text())


def _rows(report: dict, section: str) -> list[dict]:
    return [r for r in report["rows"] if r["section"] == section]


@pytest.mark.e2e
def test_cpu_run_has_every_section_and_no_failure(cpu_run):
    stdout, report = cpu_run
    assert report["failures"] == 0 and "0 failed, 0 skipped" in stdout
    assert {r["status"] for r in report["rows"]} <= {"pass", "measured"}
    sections = ("kernels", "calibrate", "ceiling", "replay", "training", "memory", "speed", "distributed")
    counts = {s: len(_rows(report, s)) for s in sections}
    # 3 dtypes x causal/full x MHA/GQA x mask/none; one ceiling per length; 2 lengths x cp 4, 8 x
    # windows 1, 2; 2 lengths x auto/sc++/full + 1 compiled; offload and packed documents; dense
    # and documents; 2 layouts x 2 dtypes x 2 masks + training
    assert counts == {"kernels": 24, "calibrate": 1, "ceiling": 2, "replay": 8, "training": 7, "memory": 2,
                      "speed": 2, "distributed": 9}  # fmt: skip
    for row in report["rows"]:  # the printed table holds every row
        assert any(row["case"] in line and row["status"] in line for line in stdout.splitlines()), row["case"]


@pytest.mark.e2e
def test_cpu_run_training_rows_stand_beside_their_ceiling_and_auto_follows_the_budget(cpu_run):
    _, report = cpu_run
    ceilings = [row["values"] for row in _rows(report, "ceiling")]
    assert [c["tokens"] for c in ceilings] == [64, 128]
    for ceiling in ceilings:
        steps = {p["mode"]: p["step_s"] for p in ceiling["policies"]}
        assert 0 < steps["none"] < steps["sc++"] < steps["full"], ceiling  # recompute only adds
        assert all(m["tflops"] > 0 for m in ceiling["matmuls"]) and ceiling["attention"]["bwd_s"] > 0
    for row in _rows(report, "training"):
        v = row["values"]
        ceiling = v["ceiling"]
        # each row against its own policy's ceiling at its length, measured in the same run
        assert ceiling["tokens"] == v["seq"] and ceiling["tokens_per_s"] > 0
        assert v["of_ceiling"] == pytest.approx(v["tokens_per_s"] / ceiling["tokens_per_s"])
        assert f"{v['of_ceiling']:.0%} of the ceiling" in row["result"]
    # auto under the CPU profile's budget: no checkpointing at 64 tokens, sc++ on the first layer at 128
    auto = {r["values"]["seq"]: r for r in _rows(report, "training")
            if r["values"]["checkpoint"] == "auto" and not r["values"]["compiled"]}  # fmt: skip
    assert auto[64]["case"].endswith("S=64 auto: none") and auto[64]["values"]["ceiling"]["checkpointed"] == 0
    assert auto[128]["case"].endswith("S=128 auto: sc++ on the first 1 of 2 layers")
    assert (auto[128]["values"]["ceiling"]["mode"], auto[128]["values"]["ceiling"]["checkpointed"]) == ("sc++", 1)
    assert auto[128]["values"]["policy"].startswith("sc++ on the first 1 of 2 layers (predicted peak")
    # the compiled row: compiled in its warm-up, no graph break, no recompile; its gain over the eager row
    (compiled,) = [r for r in _rows(report, "training") if r["values"]["compiled"]]
    c = compiled["values"]["compile"]
    assert c["graphs_in_warmup"] >= 1 and c["graphs_in_timed_steps"] == 0 and c["graph_breaks"] == 0, c
    gain = compiled["values"]["tokens_per_s"] / auto[64]["values"]["tokens_per_s"]
    assert compiled["values"]["gain_over_eager"] == pytest.approx(gain)
    assert compiled["result"].startswith(f"{gain:.2f}x the eager row; ")


@pytest.mark.e2e
def test_cpu_run_kernels_within_float64_bounds(cpu_run):
    _, report = cpu_run
    seen = set()
    for row in _rows(report, "kernels"):
        errors, dtype = row["values"]["errors"], row["values"]["dtype"]
        seen.add(row["case"])
        names = {"out", "lse", "dq", "dk", "dv"} | ({"merge_out", "merge_lse"} if " full " in row["case"] else set())
        if "band" in row["case"]:
            names -= {"merge_out", "merge_lse"}
        assert set(errors) == names, row["case"]
        for name, err in errors.items():
            bound = LSE_BOUND[dtype] if name.endswith("lse") else BOUND[dtype]
            assert 0 < err <= bound, (row["case"], name, err)
    assert len(seen) == 24


@pytest.mark.e2e
def test_cpu_run_replay_ratio_is_a_number(cpu_run):
    _, report = cpu_run
    for row in _rows(report, "replay"):
        v = row["values"]
        assert math.isfinite(v["ratio"]) and v["ratio"] > 0
        assert v["ratio"] == pytest.approx(v["replay_s"] / v["fused_s"])
        assert v["max_rel_err"] < BOUND["bfloat16"]
        assert f"{v['ratio']:.3f}x" in row["result"]


@pytest.mark.e2e
def test_cpu_run_mfu_is_computed_against_the_stated_peak(cpu_run):
    stdout, report = cpu_run
    peak = report["environment"]["peak_tflops"]
    (title,) = [line for line in stdout.splitlines() if line.startswith("loongtrain GPU check, cpu profile")]
    assert peak > 0 and f"MFU peak {peak:.4g} TFLOP/s" in title
    cfg = PROFILES["cpu"].train_model
    for row in _rows(report, "training"):
        v = row["values"]
        assert v["finite"] and all(math.isfinite(x) for x in v["losses"])
        assert v["tokens_per_s"] == pytest.approx(v["seq"] / v["step_s"])
        flops = _hand_flops_per_token(cfg, v["seq"])
        assert v["peak_tflops"] == peak
        assert v["mfu"] == pytest.approx(v["tokens_per_s"] * flops / (peak * 1e12), rel=1e-9)
        assert f"MFU {v['mfu']:.1%}" in row["result"]
        assert v["planner"]["step_s"] > 0 and v["planner_cluster"] == "local"
    assert any(r["values"]["compiled"] for r in _rows(report, "training"))


@pytest.mark.e2e
def test_cpu_run_offload_and_packed_documents_rows(cpu_run):
    """Every memory option on beside the same run without offload, step by step; packed documents
    under a window beside the same documents as separate sequences (at the same weights)."""
    _, report = cpu_run
    offload, packed = _rows(report, "memory")
    v, p = offload["values"], PROFILES["cpu"]
    assert v["memory"]["offload_activations"] and v["memory"]["offload_states"]
    assert len(v["losses"]) == len(v["baseline"]["losses"]) == p.offload_steps
    assert all(math.isfinite(x) for x in v["losses"]) and v["losses"][-1] < v["losses"][0]  # it trains
    worst = max(abs(a - b) / b for a, b in zip(v["losses"], v["baseline"]["losses"]))
    assert v["max_rel_diff"] == pytest.approx(worst, abs=1e-12) and worst <= 1e-6  # fp32 compute here
    v = packed["values"]
    assert v["window"] == p.packed_window and v["documents"] >= 3
    assert abs(v["packed_loss"] - v["separate_loss"]) <= 1e-5 * v["separate_loss"]
    assert v["finite"] and len(v["losses"]) == p.train_steps + p.train_warmup


@pytest.mark.e2e
def test_cpu_run_speed_rows(cpu_run):
    """The chosen kernel beside SDPA's backends (those that run on CPU), packed documents beside one
    sequence: times, ratios computed from them, the documents drawn as the profile says."""
    _, report = cpu_run
    dense, documents = _rows(report, "speed")
    v = dense["values"]
    ours = v["times_s"]["loongtrain cpu"]
    assert ours > 0 and v["fastest_sdpa"] in v["times_s"]
    assert v["ratio_to_fastest"] == pytest.approx(ours / v["times_s"][v["fastest_sdpa"]])
    v = documents["values"]
    assert v["documents"] >= 3 and v["fewer_keys"] > 1
    assert v["speedup"] == pytest.approx(v["one_sequence_s"] / v["packed_s"])
    assert v["kernel_calls"] == v["plan_calls"] == v["documents"]  # the CPU kernel: one call per document


@pytest.mark.e2e
def test_cpu_run_calibrates_the_planner(cpu_run, tmp_path):
    """The report holds what ``loongtrain plan --calibrate-gpu`` reads, and it makes a cluster from it
    that predicts every one-device training row (the rates here are a CPU's at tiny sizes)."""
    from loongtrain.planner import calibrate_gpu

    _, report = cpu_run
    (row,) = _rows(report, "calibrate")
    v = row["values"]
    assert v["matmul"]["tflops"] == pytest.approx(v["matmul"]["flops"] / v["matmul"]["seconds"] / 1e12)
    assert [a["seq"] for a in v["attention"]] == list(PROFILES["cpu"].calibration_seqs)
    # each pass timed alone (a loaded machine cannot make the backward negative); no order between timings
    assert all(a["fwd_s"] > 0 and a["bwd_s"] > 0 and a["fwd_bwd_s"] == a["fwd_s"] + a["bwd_s"] for a in v["attention"])
    cluster, checks, _ = calibrate_gpu.calibrate(cluster_spec("local"), report)
    assert cluster.matmul_tflops == v["matmul"]["tflops"] and cluster.host_mem_bw_gbs > 0
    # 6 plain training rows (auto resolved to its policy), the offload row and the longest (packed
    # documents and compiled rows left out)
    assert len(checks) == 8 and all(c.predicted_s > 0 for c in checks)
    assert all(c.options.activation_checkpoint != "auto" for c in checks)


@pytest.mark.e2e
def test_cpu_run_distributed_checks(cpu_run):
    _, report = cpu_run
    rows = _rows(report, "distributed")
    assert {"ring", "ulysses"} <= {r["values"]["layout"] for r in rows}
    training = [r for r in rows if "training" in r["case"]]
    assert len(training) == 1
    errors = training[0]["values"]["errors"]
    assert errors["loss"] <= 2e-6 and errors["grad"] <= 2e-6 and errors["param"] <= 2e-5
    for row in rows:
        if row not in training:
            assert max(row["values"]["errors"].values()) <= BOUND[row["values"]["dtype"]], row["case"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cuda_profile_kernel_calls_fit_the_op_schemas(dtype):
    """What the GPU run calls, at its sizes, checked by PyTorch's meta kernels of the aten ops."""
    p = PROFILES["cuda"]
    cases = kernel_grid((dtype,), p.kernel_batch, p.kernel_seq, p.kernel_heads, p.kernel_kv_heads, p.kernel_head_dim)
    for case in cases:
        with CudaArgumentRules():  # and by the rules the CUDA kernels check beyond the meta kernels
            got = run_case(CudaSdpaBackend(), case, case_inputs(case, torch.device("meta")))
        sq, sk = case.shape
        assert got["out"].shape == (p.kernel_batch, sq, p.kernel_heads, p.kernel_head_dim)
        assert got["lse"].shape == (p.kernel_batch, sq, p.kernel_heads) and got["lse"].dtype == torch.float32
        assert got["dq"].shape == got["out"].shape
        assert got["dk"].shape == got["dv"].shape == (p.kernel_batch, sk, case.kv_heads, p.kernel_head_dim)
        if case.checks_merge:
            assert got["merge_out"].shape == got["out"].shape and got["merge_lse"].dtype == torch.float32


def test_cuda_profile_fits_one_h200_by_the_planner():
    p = PROFILES["cuda"]
    assert 1.0e9 < p.train_model.num_params() < 1.3e9  # "a ~1B-parameter Llama"
    h200 = cluster_spec("h200")
    predicted_s = 0.0
    for case in p.train_cases + p.compiled_cases + (p.packed_case,):
        case, _ = resolve_auto_case(case, p.train_model, torch.bfloat16, h200.usable_memory_bytes, gpu=True)
        pred = predict_step(h200, p.train_model, case, torch.bfloat16)
        assert pred["fits"] and pred["memory_gib"] < 0.9 * 139, (case, pred)
        predicted_s += (p.train_steps + p.train_warmup) * pred["step_s"]
    pred = predict_step(h200, p.train_model, p.offload_case, torch.bfloat16)
    assert pred["fits"] and pred["memory_gib"] < 0.9 * 139
    predicted_s += 2 * p.offload_steps * pred["step_s"]
    assert predicted_s < 150  # the training rows' share of the check's 300 s budget (run alone), by the planner


@pytest.mark.parametrize("world", [2, 4, 8])
def test_cuda_profile_distributed_sizes_are_valid(world):
    d = PROFILES["cuda"].dist
    seq = d.tokens_per_rank * world
    for layout in check_layouts(world, d.heads, d.kv_heads):
        check_head_split(d.heads, d.kv_heads, layout.config.hp)
        check_sequence_length(seq, layout.config.hp, layout.config.cp)
    assert len(check_layouts(world, d.heads, d.kv_heads)) >= 2
    cu = documents(seq)
    assert cu[0] == 0 and cu[-1] == seq and all(a < b for a, b in zip(cu, cu[1:]))
    train = training_layout(world)
    assert train.hp * train.cp == world and train.cp % train.ring_window == 0
    check_head_split(d.model.n_heads, d.model.n_kv_heads, train.hp)
    check_sequence_length(d.train_tokens_per_rank * world, train.hp, train.cp)


@pytest.mark.e2e  # the command in a subprocess (4-9 s of imports before it refuses): not in the unit subset
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_device_cuda_without_a_gpu_is_a_clear_error():
    proc = _run_script("--device", "cuda", timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device is visible" in lines[0] and "--device cpu" in lines[0]


def test_goals_are_judged_on_the_measured_numbers():
    """The GPU run's goals: overhead <= 1.10x at S >= 32K; the planner's policy 40,600 tok/s at 32K
    with its peak within 5% of the planner's; sc++ forced 35,700 tok/s in 24 GiB; planner within 20%."""
    ok = {"seq": 32768, "ratio": 1.08, "max_rel_err": 1e-3}
    assert replay_status(ok, 2e-2, goals=True)[1] == "goal met"
    assert replay_status({**ok, "ratio": 1.2}, 2e-2, goals=True)[1] == "below goal"
    assert replay_status({**ok, "ratio": 1.2, "seq": 16384}, 2e-2, goals=True)[1] == "measured"
    assert replay_status({**ok, "max_rel_err": 0.1}, 2e-2, goals=True)[1] == "FAIL"
    assert replay_status({**ok, "max_rel_err": float("nan")}, 2e-2, goals=False)[1] == "FAIL"
    sc = TrainCase(32768, "sc++")
    good = {"finite": True, "tokens_per_s": 36_000, "peak_memory_gib": 21.0, "step_s": 1.0}
    pred = {"step_s": 0.85, "memory_gib": 20.5}
    target = "tok/s >= 35,700 (H200), peak <= 24 GiB, planner within 20%"
    assert training_status(True, sc, good, pred) == (target, "goal met")
    assert training_status(True, sc, {**good, "tokens_per_s": 30_000}, pred)[1] == "below goal: tok/s"
    assert training_status(True, sc, {**good, "peak_memory_gib": 25.0}, pred)[1] == "below goal: peak memory"
    assert training_status(True, sc, good, {**pred, "step_s": 0.7})[1] == "below goal: planner"
    auto = TrainCase(32768, "auto", memory=MemoryOptions(activation_checkpoint="none"), policy="none")
    fast = {**good, "tokens_per_s": 41_000, "peak_memory_gib": 60.0}
    assert training_status(True, auto, fast, {**pred, "memory_gib": 58.0})[1] == "goal met"
    assert training_status(True, auto, fast, {**pred, "memory_gib": 56.0})[1] == "below goal: planner's peak"
    assert training_status(True, TrainCase(131072, "full"), {**good, "mfu": 0.1}, None) == ("-", "measured")
    assert training_status(False, sc, {**good, "finite": False}, None)[1] == "FAIL"


def test_what_cannot_run_is_a_skipped_row_with_the_reason():
    p, cpu = PROFILES["cpu"], torch.device("cpu")
    rows = dist_rows(p, cpu, 1, Budget(0))
    assert [r.status for r in rows] == ["skipped"] and "--dist-world < 2" in rows[0].result
    rows = kernel_rows(p, cpu, Budget(1e-9))  # spent before the first kernel
    assert len(rows) == 24 and all(r.status == "skipped" and "time budget" in r.result for r in rows)


def test_the_cuda_backends_checked_on_a_hopper_gpu(monkeypatch):
    """No GPU needed: choosing the backends runs no kernel (the device's capability stubbed)."""
    import loongtrain.attention.backends as backends_module

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed here")
    monkeypatch.setattr(backends_module, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    backends, missing = installed_backends(torch.device("cuda"))
    assert [name for name, _ in backends] == ["sdpa", "flash", "cudnn"]
    assert missing == [("flash-attn", "attention kernel 'flash-attn': flash_attn>=2.7 is not installed (pip install "
                                      "flash-attn to use it)")]  # fmt: skip


# -- the GPU run: what comes back, in what order, and the verdict ------------------------------

MiB = 2**20
RUN_FILES = ["gpu_check.json", "gpu_check.jsonl", "gpu_check.log", "nvidia_smi.txt", "peer.jsonl", "peer.log",
             "top_kernels.txt"]  # fmt: skip


@pytest.mark.e2e
def test_gpu_run_leaves_only_what_comes_back_from_the_gpu_machine(gpu_run):
    """At most 8 plain files, each at most 16 MiB, 64 MiB in all, no deeper than OUT/a/b/file,
    names of letters, digits, '.', '_', '-'; at most 12,000 characters of output. The Chrome traces
    stay outside OUT (one per profiled row: the 4 rows of the short length)."""
    output, out = gpu_run
    files = [p for p in out.rglob("*") if not p.is_dir()]
    assert sorted(p.relative_to(out).as_posix() for p in files) == RUN_FILES
    assert len(files) <= 8 and all(p.is_file() and not p.is_symlink() for p in files)
    sizes = [p.stat().st_size for p in files]
    assert max(sizes) <= 16 * MiB and sum(sizes) <= 64 * MiB
    for p in files:
        parts = p.relative_to(out).parts
        assert len(parts) <= 3 and all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in parts), p
    assert len(output) <= 12_000, len(output)
    traces = [t.name for t in (out.parent / "traces").glob("*.json") if t.name != "top_kernels.json"]
    assert len(traces) == 4 and all(name.startswith("64-") for name in traces)


@pytest.mark.e2e
def test_gpu_run_writes_every_row_as_a_json_line_correctness_first(gpu_run):
    """The check's JSON lines hold every row of its report, in the order measured: the kernels, then
    the offload and packed-documents rows, before any calibration, training, speed or replay row.
    The peer benchmark's lines: per length the loongtrain auto row, transformers with and without
    checkpointing, then sc++; each with its wall time."""
    _, out = gpu_run
    lines = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    report = json.loads((out / "gpu_check.json").read_text())
    assert lines[0]["profile"] == "cpu" and lines[0]["environment"]["device"] == "cpu"
    assert lines[-1]["end"]["rows"] == len(report["rows"]) and report["complete"]
    rows = [line for line in lines if "row" in line]
    assert [line["row"] for line in rows] == report["rows"]
    times = [line["t_s"] for line in rows]
    assert times == sorted(times) and times[-1] <= lines[-1]["end"]["elapsed_s"] + 0.1
    sections = [r["section"] for r in report["rows"]]
    first = {s: sections.index(s) for s in dict.fromkeys(sections)}
    assert sections[: first["memory"]] == ["kernels"] * first["memory"]
    assert sections[first["memory"] : first["memory"] + 2] == ["memory", "memory"]
    assert first["memory"] < first["calibrate"] < first["training"] < first["speed"] < first["replay"]
    peer = [json.loads(line) for line in (out / "peer.jsonl").read_text().splitlines()]
    peer_rows = [line["row"] for line in peer if "row" in line]
    for length in (64, 128):
        who = [r["who"].split(" (")[0] for r in peer_rows if r["length"] == length]
        assert who == ["loongtrain auto", "transformers ckpt", "transformers no ckpt", "loongtrain sc++"]
    assert all(r["error"] is None and r["wall_s"] > 0 and r["tokens_per_s"] > 0 for r in peer_rows)
    assert (out / "top_kernels.txt").read_text().count("by time:") == 4


@pytest.mark.e2e
def test_gpu_run_ends_with_the_verdict_table(gpu_run):
    """The last lines printed are the verdict: every goal with what was measured (the numbers of the
    rows), its target and met or not (on CPU: measured, not judged; correctness: met)."""
    output, out = gpu_run
    lines = output.rstrip().splitlines()
    start = max(i for i, line in enumerate(lines) if line.startswith("verdict: "))
    table = lines[start + 3 :]  # the count, the header, the rule
    report = json.loads((out / "gpu_check.json").read_text())
    goals = {line.split("  ")[0]: line for line in table}
    assert len(table) == 20  # both packed-documents goals stand on the one CPU length
    for name in ("GPU check ran to its end", "correctness rows of the GPU check", "kernels vs float64",
                 "offload: every step's loss (step-3 NaN)", "packed documents: loss = separate"):  # fmt: skip
        assert goals[name].endswith("  met"), goals[name]
    passed = sum(r["status"] == "pass" for r in report["rows"])
    assert f"{passed} pass, 0 FAIL, 0 skipped" in goals["correctness rows of the GPU check"]
    auto = next(
        r["values"]
        for r in _rows(report, "training")
        if (r["values"]["seq"], r["values"]["checkpoint"], r["values"]["compiled"]) == (64, "auto", False)
    )
    assert f"{auto['tokens_per_s']:,.0f} (check" in goals["tok/s auto, 64"]  # fmt: skip
    peer = [json.loads(line)["row"] for line in (out / "peer.jsonl").read_text().splitlines() if '"row"' in line]
    ours = next(r for r in peer if r["length"] == 128 and r["who"].startswith("loongtrain auto"))
    theirs = next(r for r in peer if r["length"] == 128 and r["who"] == "transformers ckpt")
    ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
    assert f"{ratio:.2f}x" in goals["loongtrain auto / transformers ckpt, 128"]
    assert all(line.endswith(("  met", "  measured")) for line in table)
    # the worst planner row is named by its whole name (issue 53: it read "n the first 1 of 2 layers) 128")
    planner = goals["planner's step / measured (worst)"]
    named = re.search(r"\d\.\d\d \((.*?)\)  ", planner).group(1)
    cases = {r["case"].split(":")[0] for r in _rows(report, "training")} | {
        f"peer {r['who']} {r['length']}" for r in peer
    }
    assert named in cases, planner


def test_a_killed_check_keeps_its_rows_and_still_gets_a_verdict(tmp_path, capsys):
    """Rows written as they are measured, a last line cut by the kill: the verdict reads every whole
    row, rebuilds the JSON report (marked incomplete), names where the check stopped, lists the
    failed row and marks the goals whose rows never came as not run."""
    from loongtrain.tools.gpucheck.check import Row, RowLog
    from loongtrain.tools.gpucheck.verdict import main as verdict_main

    out = tmp_path / "out"
    log = RowLog(out / "gpu_check.jsonl", {"profile": "cuda", "environment": {"device": "cuda"}}, clock=lambda: 12.5)
    log.append(Row("kernels", "cudnn: bf16 causal", "out 1e-3", "<= 2e-2", "pass", {"errors": {"out": 1e-3}}))
    log.append(Row("kernels", "flash: bf16 causal", "RuntimeError: boom", "runs", "FAIL"))
    offload = {"max_rel_diff": 3e-4, "losses": [10.4, 10.3, 10.1, 9.9], "finite": True}
    log.append(Row("memory", "1.1B llama S=32K sc++ offload activations+states", "...", "...", "pass", offload))
    # the kill: the packed row's line only half written, no end line
    with open(out / "gpu_check.jsonl", "a") as f:
        f.write('{"row": {"section": "memory", "case": "1.1B llama S=32K sc++ packed')
    assert verdict_main([str(out)]) == 1  # a failed row
    printed = capsys.readouterr().out
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["complete"] is False and report["failures"] == 1 and len(report["rows"]) == 3
    assert report["environment"] == {"device": "cuda"}
    assert "FAIL kernels flash: bf16 causal: RuntimeError: boom" in printed
    goals = {line.split("  ")[0]: line for line in printed.splitlines()}
    assert "killed after '1.1B llama S=32K sc++ offload activa' at 12 s" in goals["GPU check ran to its end"]
    assert goals["GPU check ran to its end"].endswith("MISSED")
    assert goals["correctness rows of the GPU check"].endswith("FAIL")
    assert "2 pass, 1 FAIL, 0 skipped" in goals["correctness rows of the GPU check"]
    assert goals["kernels vs float64"].endswith("FAIL") and "1 of 2 rows" in goals["kernels vs float64"]
    assert "max rel diff 3.0e-04 over 4 steps" in goals["offload: every step's loss (step-3 NaN)"]
    assert goals["offload: every step's loss (step-3 NaN)"].endswith("  met")
    assert goals["packed documents: loss = separate"].endswith("not run")
    assert goals["tok/s auto, 32K"].endswith("not run")  # judged on cuda, never measured
    assert printed.rstrip().splitlines()[-1].startswith("replay overhead, 32K")  # the table ends the output


def test_what_would_not_come_back_is_named(tmp_path):
    """Too many files, a file over 16 MiB, one three folders deep, a name with a space."""
    from loongtrain.tools.gpucheck.verdict import return_problems

    for i in range(7):
        (tmp_path / f"f{i}.txt").write_text("x")
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c" / "deep.txt").write_text("x")
    (tmp_path / "a" / "b" / "ok.txt").write_text("x")
    (tmp_path / "bad name.txt").write_text("x")
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(17 * MiB)
    problems = return_problems(tmp_path)
    assert any(p.startswith("a/b/c/deep.txt: deeper than 2 folders") for p in problems)
    assert any(p.startswith("bad name.txt: a name with") for p in problems)
    assert any(p.startswith("big.bin: 17.0 MiB, over 16 MiB") for p in problems)
    assert "11 files, over 8" in problems and not any("ok.txt" in p for p in problems)
    assert return_problems(tmp_path / "a") == []


def _fake_gpu_machine(tmp_path: Path) -> tuple[Path, dict]:
    """A copy of the scripts (no .venv beside them) and a PATH whose nvidia-smi answers and whose
    python3 imports no torch (and refuses ``-m``: no virtual environment, no pip)."""
    root = tmp_path / "repo"
    shutil.copytree(REPO / "scripts", root / "scripts")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA H200'\n")
    refuse_m = 'case "$1" in -m) echo "python3 -m refused here" >&2; exit 1;; esac'
    (bin_dir / "python3").write_text(f'#!/bin/sh\n{refuse_m}\nexec {sys.executable} -S "$@"\n')
    for exe in bin_dir.iterdir():
        exe.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    return root, env


@pytest.mark.e2e  # bash and a Python start-up; no torch import
def test_gpu_run_without_cuda_torch_is_one_line_and_installs_nothing(tmp_path):
    root, env = _fake_gpu_machine(tmp_path)
    proc = subprocess.run(["bash", str(root / "scripts" / "gpu_run.sh"), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, lines
    assert "no Python here imports torch with CUDA" in lines[0] and "No module named 'torch'" in lines[0]
    assert "LOONGTRAIN_PYTHON" in lines[0]
    assert not (root / ".venv").exists() and not (tmp_path / "out").exists()


@pytest.mark.e2e
def test_gpu_run_stages_add_up_to_at_most_six_minutes(tmp_path):
    """The default timeouts pass (the run stops at the Python check, later); one raised past 360 s in
    all is refused in one line before anything runs."""
    root, env = _fake_gpu_machine(tmp_path)
    script = str(root / "scripts" / "gpu_run.sh")
    proc = subprocess.run(["bash", script, str(tmp_path / "out")], env={**env, "GPU_CHECK_TIMEOUT": "200"},
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert "timeouts add up to 370 s, over the 360 s a run may take on cuda" in lines[0]
    proc = subprocess.run(["bash", script, str(tmp_path / "out")], env={**env, "GPU_RUN_PARTS": "peer",
                          "PEER_128K_TIMEOUT": "295"}, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "add up" not in proc.stderr and "no Python here imports torch" in proc.stderr  # a rerun of one part


def test_the_gpu_run_budgets_are_sized_from_its_rows_estimates():
    """On one H200 by the planner (times the measured factors, plus the build): the offload and packed
    rows fit the check's budget; at 32K the comparison rows (loongtrain auto, transformers with and
    without checkpointing, each profiled) fit the 32K peer budget, at 128K loongtrain auto and
    transformers ckpt fit the 128K one; each budget leaves its timeout some room."""
    from loongtrain.tools.gpucheck.train import PEER_STEP_FACTOR, PLANNER_OPTIMISM, row_seconds

    text = (REPO / "scripts" / "gpu_run.sh").read_text()
    default = {name: int(value) for name, value in re.findall(r"\$\{(\w+):-(\d+)\}", text.split("else")[0])}
    p, h200, bf16 = PROFILES["cuda"], cluster_spec("h200"), torch.bfloat16
    model = p.train_model
    plain = TrainCase(p.offload_case.seq, "sc++")
    memory = (row_seconds(h200, model, p.offload_case, bf16, p.offload_steps, PLANNER_OPTIMISM)
              + row_seconds(h200, model, plain, bf16, p.offload_steps)
              + row_seconds(h200, model, p.packed_case, bf16, p.train_steps + p.train_warmup + 2))  # fmt: skip
    assert memory < default["GPU_CHECK_BUDGET"] / 2
    auto = {seq: resolve_auto_case(TrainCase(seq, "auto"), model, bf16, h200.usable_memory_bytes, True)[0]
            for seq in (32768, 131072)}  # fmt: skip
    peer32 = row_seconds(h200, model, auto[32768], bf16, 4) + sum(
        row_seconds(h200, model, TrainCase(32768, mode), bf16, 4, PEER_STEP_FACTOR) for mode in ("full", "none")
    )
    peer128 = row_seconds(h200, model, auto[131072], bf16, 2) + row_seconds(
        h200, model, TrainCase(131072, "full"), bf16, 2, PEER_STEP_FACTOR
    )
    assert peer32 <= default["PEER_32K_BUDGET"] and peer128 <= default["PEER_128K_BUDGET"]
    for stage in ("GPU_CHECK", "PEER_32K", "PEER_128K"):
        assert default[f"{stage}_BUDGET"] + 10 <= default[f"{stage}_TIMEOUT"]
    assert sum(default[f"{stage}_TIMEOUT"] for stage in ("GPU_CHECK", "PEER_32K", "PEER_128K")) <= 360


def test_a_row_the_verdict_cannot_read_costs_only_its_part():
    """A training row whose numbers are not numbers: the training goals become one FAIL line naming
    the error; the correctness, peer and speed goals are still judged."""
    from loongtrain.tools.gpucheck.verdict import verdict

    odd = {"section": "training", "case": "S=32K auto", "result": "", "target": "", "status": "measured",
           "values": {"seq": 32768, "checkpoint": "auto", "compiled": False, "tokens_per_s": "fast"}}  # fmt: skip
    check = {"header": {"environment": {"device": "cuda"}}, "rows": [odd], "end": {"elapsed_s": 5.0}, "t_s": 5.0}
    goals = {g.goal: g for g in verdict(check, None)}
    assert goals["training goals"].verdict == "FAIL" and "verdict error: ValueError" in goals["training goals"].measured
    assert goals["GPU check ran to its end"].verdict == "met"
    assert goals["loongtrain auto / transformers ckpt, 32K"].verdict == "not run"
    assert goals["replay overhead, 32K (worst)"].verdict == "not run"
