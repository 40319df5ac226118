"""``loongtrain bench train --peer transformers`` and ``--profile DIR`` at a tiny size on CPU.

- The command end to end, in this process (a one-rank gloo group, as the GPU check's training
  rows): a loongtrain row per ``--checkpoint`` mode and transformers with its checkpointing on
  and off, each with positive tokens/s and finite losses; every row's loss equals loongtrain's
  step by step within 1e-4 (the same initial weights, tokens, AdamW and clip: the first step's
  loss checks the weights and the model, the second the update); the ratios and MFU are the
  stated arithmetic; the JSON and the printed table agree.
- ``--profile``: a Chrome trace per row and the kernel tables; each row's matrix products are
  those of the model's shape (3 per linear layer per step, plus the forward's again under
  checkpointing), the same count for loongtrain and transformers.
- The kernel table on synthetic records: summing, both orders, the top N, the kinds.
- Bad input is a one-line SystemExit before anything runs; without the new options the
  command is the multi-rank benchmark as before.
- ``--jsonl`` and ``--budget-s``: each row a JSON line when it ends; a row whose estimate ends past
  the budget is a skipped row saying so.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import torch

from loongtrain.apply import MemoryOptions
from loongtrain.cli import _worker_modules
from loongtrain.cli import main as cli_main
from loongtrain.config import OptimSection
from loongtrain.model import model_config
from loongtrain.tools.bench.kernel_table import format_kernel_table, kernel_table, kind_of
from loongtrain.tools.bench.peer import add_ratios, format_rows

pytest.importorskip("transformers")

TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128)
SEQ = 64
PEAK = 0.5  # TFLOP/s, stated (no measured matmul)


def _config(folder: Path) -> Path:
    path = folder / "tiny.toml"
    lines = ["[model]", 'preset = "debug"', *(f"{k} = {v}" for k, v in TINY.items())]
    # the auto row's budget: every policy fits, so it checkpoints nothing
    lines += ["[memory]", 'activation_checkpoint = "auto"', "device_memory_gib = 1.0"]
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli_main(argv)
    return out.getvalue()


@pytest.fixture(scope="module")
def peer_run(tmp_path_factory):
    """One run: loongtrain sc++ and none, transformers ckpt and no ckpt, each profiled."""
    folder = tmp_path_factory.mktemp("bench_peer")
    report, profile = folder / "rows.json", folder / "profile"
    stdout = _run([
        "bench", "train", "--peer", "transformers", "--config", str(_config(folder)), "--lengths", str(SEQ),
        "--checkpoint", "sc++", "none", "auto", "--steps", "1", "--peak-tflops", str(PEAK), "--json", str(report),
        "--profile", str(profile), "--profile-top", "5",
    ])  # fmt: skip
    return stdout, json.loads(report.read_text()), profile


# the first mode, transformers with and without checkpointing, then the other modes
ROWS = ["loongtrain sc++", "transformers ckpt", "transformers no ckpt", "loongtrain none", "loongtrain auto (none)"]


@pytest.mark.e2e  # the command end to end (in this process)
def test_peer_rows_train_the_same_model(peer_run):
    stdout, report, _ = peer_run
    rows = report["rows"]
    assert [r["who"] for r in rows] == ROWS and {r["length"] for r in rows} == {SEQ}
    ours = rows[0]["losses"]
    assert abs(ours[0] - math.log(TINY["vocab_size"])) < 0.05  # initial weights: near-uniform predictions
    for r in rows:
        assert r["error"] is None and r["finite"] and r["tokens_per_s"] > 0, r
        assert len(r["losses"]) == 3  # warm-up, timed, profiled
        assert r["wall_s"] > 0 and r["estimate_s"] == 0.0  # no budget: nothing estimated
        # same weights, tokens and model: the same first loss; same AdamW and clip: the same second
        assert r["losses"][:2] == pytest.approx(ours[:2], abs=1e-4), r["who"]
        flops = model_config("debug", **TINY).flops_per_token(SEQ)
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * flops / (PEAK * 1e12))
        assert r["tokens_per_s"] == pytest.approx(SEQ / r["step_s"])
    by_who = {r["who"]: r for r in rows}
    ckpt, no_ckpt = by_who["transformers ckpt"], by_who["transformers no ckpt"]
    for r in (r for r in rows if r["who"].startswith("loongtrain")):
        assert r["vs_transformers_ckpt"] == pytest.approx(r["tokens_per_s"] / ckpt["tokens_per_s"])
        assert r["vs_transformers_no_ckpt"] == pytest.approx(r["tokens_per_s"] / no_ckpt["tokens_per_s"])
    env = report["environment"]
    assert (env["device"], env["dtype"], env["peak_tflops"]) == ("cpu", "float32", PEAK)
    for r in rows:  # the printed table has every row
        assert f"{SEQ:8d} {r['who']:20s} {r['step_s']:8.3f}" in stdout
    assert "same run" in stdout


@pytest.mark.e2e
def test_profile_writes_a_trace_and_the_kernel_tables(peer_run):
    stdout, _, profile = peer_run
    tables = json.loads((profile / "top_kernels.json").read_text())
    assert [t["who"] for t in tables] == ROWS
    for t in tables:
        trace = json.loads(Path(t["trace"]).read_text())
        assert Path(t["trace"]).parent == profile and any(
            e.get("name", "").startswith("aten::") for e in trace["traceEvents"]
        )
        table = t["table"]
        assert len(table["by_time"]) == len(table["by_calls"]) == 5
        assert table["total_calls"] >= sum(r["calls"] for r in table["by_calls"])
    # each linear layer: a product forward, two backward; checkpointing runs the layers' forward again
    linears = 7 * TINY["n_layers"] + 1  # q, k, v, o, w1, w2, w3 per layer; the output layer
    matmuls = {t["who"]: t["table"]["kind_calls"]["matmul"] for t in tables}
    assert (
        matmuls["loongtrain none"]
        == matmuls["loongtrain auto (none)"]
        == matmuls["transformers no ckpt"]
        == 3 * linears
    )
    assert matmuls["transformers ckpt"] == 3 * linears + 7 * TINY["n_layers"]
    assert matmuls["loongtrain sc++"] > matmuls["loongtrain none"]
    text = (profile / "top_kernels.txt").read_text()
    assert text.count("by time:") == 5 and "aten::mm" in text and text.strip() in stdout


@pytest.mark.unit
def test_kernel_table_sums_sorts_and_counts_kinds():
    records = [
        ("aten::mm", 30.0, 2), ("aten::mm", 10.0, 1), ("aten::addmm", 5.0, 1), ("aten::bmm", 1.0, 1),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 50.0, 4), ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNN", 20.0, 2),
        ("aten::copy_", 4.0, 6), ("Memcpy DtoD (Device -> Device)", 2.0, 1),
        ("void at::native::elementwise_kernel<128, 4, direct_copy_kernel_cuda>", 3.0, 2),
        ("aten::mul", 1.0, 9), ("aten::_foreach_mul_", 1.0, 1), ("void at::native::MulFunctor<float>", 1.0, 1),
        ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 8.0, 3),
        ("loongtrain::comm_wait", 2.0, 1), ("aten::view", 0.5, 20),
    ]  # fmt: skip
    table = kernel_table(records, top=3)
    assert [(r.name, r.time_us, r.calls) for r in table.by_time] == [
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 50.0, 4), ("aten::mm", 40.0, 3),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNN", 20.0, 2),
    ]  # fmt: skip
    assert [(r.name, r.calls) for r in table.by_calls] == [("aten::view", 20), ("aten::mul", 9), ("aten::copy_", 6)]
    assert table.total_calls == 55 and table.total_time_us == pytest.approx(138.5)
    assert table.kind_calls == {"matmul": 3 + 1 + 1 + 4 + 2, "copy": 6 + 1 + 2, "multiply": 9 + 1 + 1}
    assert table.kind_time_us["matmul"] == pytest.approx(116.0)
    for name in ("loongtrain::comm_wait", "void at::native::multi_tensor_apply_kernel<X>", "aten::symmetric_x"):
        assert kind_of(name) is None, name
    text = format_kernel_table(table, "title")
    assert text.startswith("title\ntotal 55 calls, 0.139 ms; matmul 11 calls (83.8% of time), copy 9 calls")
    with pytest.raises(ValueError, match="top=0"):
        kernel_table(records, top=0)


@pytest.mark.unit
def test_a_failed_row_is_shown_with_its_error_and_has_no_ratio():
    rows = [
        {"length": 64, "who": "loongtrain sc++", "checkpoint": "sc++", "error": None, "step_s": 0.5,
         "tokens_per_s": 128.0, "mfu": 0.25, "peak_memory_gib": 1.0, "losses": [4.8]},
        {"length": 64, "who": "transformers ckpt", "checkpoint": "full", "error": None, "step_s": 1.0,
         "tokens_per_s": 64.0, "mfu": 0.125, "peak_memory_gib": 2.0, "losses": [4.8]},
        {"length": 64, "who": "transformers no ckpt", "checkpoint": "none",
         "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"},
    ]  # fmt: skip
    add_ratios(rows)
    assert rows[0]["vs_transformers_ckpt"] == 2.0 and rows[0]["vs_transformers_no_ckpt"] is None
    lines = format_rows(rows).splitlines()
    assert lines[1].split()[-2:] == ["2.00x", "-"]
    assert lines[3].endswith("failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.unit
@pytest.mark.parametrize(
    "extra, message",
    [
        (["--peer", "torchtitan"], "bench train: unknown --peer 'torchtitan'; choose one of ['transformers']"),
        (["--peer", "transformers", "--lengths", "0", "64"], "--lengths must be positive token counts, got [0]"),
        (["--profile", "x", "--lengths", "-8"], "--lengths must be positive token counts, got [-8]"),
        (["--peer", "transformers", "--checkpoint", "auto"], "--checkpoint auto fills the device's memory, and on cpu"),
        (["--peer", "transformers", "--checkpoint", "half"], "bench train: --checkpoint ['half']: name modes of"),
        (["--peer", "transformers", "--model", "70b"], "unknown --model '70b'; choose one of ['gpu-check']"),
        (["--peer", "transformers", "--config", "/no/such.toml"], "config file '/no/such.toml' does not exist"),
    ],
)
def test_bad_input_is_a_clear_error(monkeypatch, extra, message):
    import loongtrain.tools.bench.peer as peer

    monkeypatch.setattr(peer, "launch", lambda *a, **k: pytest.fail("started"))
    with pytest.raises(SystemExit) as done:
        cli_main(["bench", "train", *extra])
    assert message in str(done.value.code)


@pytest.mark.unit
def test_without_the_new_options_bench_train_is_unchanged(monkeypatch):
    import loongtrain.cli
    import loongtrain.tools.bench.train as bench_train

    monkeypatch.setattr(loongtrain.cli, "start_worker_server", lambda modules: None)
    monkeypatch.setattr(bench_train, "launch", lambda *a, **k: pytest.fail("spawned"))
    with pytest.raises(SystemExit) as bad_case:
        cli_main(["bench", "train", "--cases", "huge"])
    assert "unknown case or mode ['huge']" in str(bad_case.value.code)
    assert bench_train.MAIN_CONFIG.is_file()  # the default --config
    # one process: no fork server started beside the timings; the multi-rank benchmark gets one
    assert _worker_modules(["bench", "train", "--peer", "transformers"]) is None
    assert _worker_modules(["bench", "train", "--profile=out"]) is None
    assert _worker_modules(["bench", "train"]) == ["loongtrain.tools.bench.train"]


@pytest.mark.unit
def test_rows_are_written_as_they_finish_and_started_only_within_the_budget(monkeypatch, tmp_path):
    """With a 70 s budget and rows estimated at 30 s that take 30 s: the first two rows run, the
    others are skipped rows naming their estimate; when the second row starts, the first is already
    a line of --jsonl (a timeout then would lose only the row in flight)."""
    import loongtrain.tools.bench.peer as peer
    import loongtrain.tools.gpucheck.check as check

    clock = [0.0]

    class FakeBudget(check.Budget):
        def elapsed(self) -> float:
            return clock[0]

    jsonl = tmp_path / "rows.jsonl"
    seen_at_start: list[list[str]] = []

    def fake_measure(*args, profile_step=None, **kwargs) -> dict:
        seen_at_start.append([json.loads(line)["row"]["who"] for line in jsonl.read_text().splitlines()[1:]])
        clock[0] += 30.0
        return {"step_s": 0.5, "tokens_per_s": 128.0, "mfu": 0.1, "peak_memory_gib": 1.0, "losses": [4.8, 4.7],
                "finite": True}  # fmt: skip

    monkeypatch.setattr(check, "Budget", FakeBudget)
    monkeypatch.setattr(peer, "measure_training_step", fake_measure)
    monkeypatch.setattr(peer, "measure_hf_step", fake_measure)
    monkeypatch.setattr(peer, "row_seconds", lambda *args, **kwargs: 30.0)
    monkeypatch.setattr(peer, "one_rank_state", lambda: None)
    monkeypatch.setattr(peer, "launch", lambda fn, nproc, *args, device: fn(torch.device(device), *args))
    plan = peer.PeerPlan(
        model=model_config("debug", **TINY), model_name="tiny", lengths=(SEQ,), checkpoints=("sc++", "none"),
        memory=MemoryOptions(), optim=OptimSection(), device="cpu", dtype="float32", steps=1, warmup=1,
        peer="transformers", peak_tflops=PEAK, jsonl=jsonl, budget_s=70.0,
    )  # fmt: skip
    result = peer.run_peer(plan)
    assert [r["who"] for r in result.rows] == ["loongtrain sc++", "transformers ckpt", "transformers no ckpt",
                                               "loongtrain none"]  # fmt: skip
    assert seen_at_start == [[], ["loongtrain sc++"]]
    ran, skipped = result.rows[:2], result.rows[2:]
    assert all(r["tokens_per_s"] == 128.0 and r["estimate_s"] == 30.0 for r in ran)
    assert all(r["skipped"] == "estimated 30 s, 10 s of the time budget of 70 s left" for r in skipped)
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert lines[0]["environment"]["budget_s"] == 70.0
    # as written when each row ended: before the ratios to the transformers rows were added
    assert [line["row"] for line in lines[1:]] == [{k: v for k, v in r.items() if not k.startswith("vs_")}
                                                   for r in result.rows]  # fmt: skip
    assert [line["t_s"] for line in lines[1:]] == [30.0, 60.0, 60.0, 60.0]
    assert "skipped: estimated 30 s" in format_rows(result.rows).splitlines()[3]
