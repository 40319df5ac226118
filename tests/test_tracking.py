"""Weights & Biases and MLflow beside ``metrics.jsonl``, with the real libraries and no network.

One small run on 2 gloo ranks (a 3-source mixture of packed documents, a step the guard skips
as non-finite, a held-out evaluation) is tracked by W&B in offline mode and by MLflow in a
SQLite store, then resumed for two more steps. Every number of its ``metrics.jsonl`` is read
back, equal, through each library's own reader (``wandb leet inspect --json`` for W&B's run
file; ``MlflowClient`` for MLflow), with the curves image, the data-inspect table and the
resolved config; the resume appends to the same tracked runs. A service that cannot be reached
(a loopback port nothing listens on; a loopback socket that accepts and never answers) costs
one warning and at most ``metrics.connect_timeout_s``, and the run's metrics are complete."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from loongtrain.config import load_config
from loongtrain.data import write_tokens

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")

EOS, VOCAB = 255, 256
SOURCES = {"code": ((0, 80), 300, 0.3), "books": ((80, 160), 400, 0.3), "short": ((160, 240), 40, 0.4)}
BASE = [
    "run.log_every=100", "run.eval_batches=1", "run.tensorboard=false", "run.progress=off", "data.source=tokens",
    "data.pack=true", "data.global_batch=4", "data.seq_len=128", "optim.warmup_steps=0", "run.eval_every=2",
    "guard.nonfinite=skip", "metrics.wandb=true", "metrics.mlflow=true", "metrics.tags=ci,mixture",
    "metrics.run_name=tracked",
]  # fmt: skip
SKIPPED = 3  # the step whose loss is made non-finite


def _refuse(constant: str):
    raise ValueError(f"not strict JSON: {constant}")


def _write_mixture(folder: Path) -> list[str]:
    out = []
    for i, (name, ((lo, hi), median, weight)) in enumerate(SOURCES.items()):
        rng = np.random.default_rng(i)
        lengths = np.maximum(2, rng.lognormal(np.log(median), 1.0, 200).astype(np.int64))
        tokens = rng.integers(lo, hi, int(lengths.sum()))
        tokens[np.cumsum(lengths) - 1] = EOS
        write_tokens(folder / f"{name}.tok", tokens, vocab_size=VOCAB, eos=EOS)
        out += [f"data.sources.{name}.path={folder / f'{name}.tok'}", f"data.sources.{name}.weight={weight}"]
    return out


_SAVED: dict = {}


def _poison_one_step(run, done, reporter, beat) -> None:
    """Before step SKIPPED the embedding holds an infinity (its loss is not finite, so the guard
    skips it without touching the weights); afterwards the weights are put back."""
    weight = dict(run.model.named_parameters())["tok_embeddings.weight"]
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    with torch.no_grad():
        if done == SKIPPED - 1:
            _SAVED["w"] = local.clone()
            local.view(-1)[0] = math.inf
        elif done == SKIPPED:
            local.copy_(_SAVED.pop("w"))


def _train(overrides: list[str], env: dict[str, str]) -> float:
    """Train on this rank with ``env`` set (WANDB_MODE, ...); the seconds the run took."""
    import os

    from loongtrain.train.trainer import preflight, train

    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        cfg = load_config(None, BASE + overrides)
        t0 = time.perf_counter()
        spec = preflight(cfg, torch.distributed.get_world_size())
        train(torch.device("cpu"), cfg, spec, after_step=_poison_one_step)
        return time.perf_counter() - t0
    finally:  # the pool's workers live on: leave no W&B settings (wandb reads them once a process) behind
        wandb.teardown()
        for key, value in before.items():
            os.environ.pop(key) if value is None else os.environ.update({key: value})


def _expected(run_dir: Path) -> dict[tuple[str, int], float]:
    """Every finite number of ``metrics.jsonl`` (read strictly) as ``(KIND/KEY, step) -> value``."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line, parse_constant=_refuse)
        for key, value in record.items():
            if key not in ("kind", "step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{record['kind']}/{key}", record["step"]] = float(value)
    return out


def _wandb_records(run_file: Path) -> list[dict]:
    """The records of a W&B run file, read by wandb's own reader."""
    leet = Path(sys.executable).with_name("wandb")
    text = subprocess.run([str(leet), "leet", "inspect", "--json", str(run_file)], capture_output=True, text=True,
                          timeout=60, check=True).stdout  # fmt: skip
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def tracked(dist_pool, tmp_path_factory):
    """The run (4 steps, then resumed to 6), its folder and its MLflow store."""
    tmp = tmp_path_factory.mktemp("tracked")
    run_dir, store = tmp / "run", f"sqlite:///{tmp / 'mlflow.db'}"
    common = [*_write_mixture(tmp), f"run.output_dir={run_dir}", f"metrics.mlflow_tracking_uri={store}"]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    pool = dist_pool(2)
    pool.run(_train, [*common, "run.steps=4"], env)
    first = {"metrics": _expected(run_dir), "ids": json.loads((run_dir / "tracking.json").read_text())}
    pool.run(_train, [*common, "run.steps=6"], env)  # resumed from step-4
    return {"dir": run_dir, "store": store, "first": first, "metrics": _expected(run_dir)}


def test_the_run_meets_a_skipped_step_an_absent_source_and_an_evaluation(tracked):
    lines = (tracked["dir"] / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=_refuse) for line in lines]
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    assert sorted(train) == [1, 2, 3, 4, 5, 6] and train[SKIPPED]["guard"] == "skipped: non-finite loss"
    assert train[SKIPPED]["loss"] is None
    assert any(r["kind"] == "eval" for r in records)
    assert {f"loss/{n}" for n in SOURCES} <= {k for r in train.values() for k in r}


def test_wandb_offline_holds_every_metric_the_images_table_and_config(tracked):
    run_dir, ids = tracked["dir"], tracked["first"]["ids"]
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{ids['wandb']['id']}.wandb" for f in files)  # resumed: same run
    got: dict[tuple[str, int], float] = {}
    media = []
    for k, path in enumerate(files):
        records = _wandb_records(path)
        (run,) = [r["run"] for r in records if r["type"] == "run"]
        assert run["run_id"] == ids["wandb"]["id"] and run["display_name"] == "tracked"
        assert run["tags"] == ["ci", "mixture"] and run.get("resume", False) == (k == 1)
        config = run["config"]["update"]
        assert config["data"]["seq_len"] == 128 and config["metrics"]["wandb"] is True
        for r in records:
            if r["type"] == "history":
                item = r["history"]["item"]
                for key, value in item.items():
                    if not key.startswith("_") and key != "step" and isinstance(value, (int, float)):
                        got[key, item["step"]] = float(value)
            if r["type"] == "files":
                media += [f["path"] for f in r["files"]["files"]]
    expected = tracked["metrics"]
    assert len(expected) > 100 and ("train/loss/code", 1) in expected and ("eval/loss", 2) in expected
    assert {key: got.get(key) for key in expected} == expected
    assert got["train/guard/skipped", SKIPPED] == 1.0  # the guard's mark, also as a number
    assert any(p.startswith("media/images/curves") for p in media)
    assert any(p.startswith("media/table/data/inspect") for p in media)


def test_mlflow_holds_every_metric_the_images_table_and_config(tracked):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracked["store"])
    ids = tracked["first"]["ids"]["mlflow"]
    assert json.loads((tracked["dir"] / "tracking.json").read_text())["mlflow"] == ids  # resumed: the same run
    run = client.get_run(ids["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert {"ci", "mixture"} <= run.data.tags.keys() and run.data.params["data.seq_len"] == "128"
    expected = tracked["metrics"]
    got = {}
    for key in {k for k, _ in expected}:
        for m in client.get_metric_history(ids["run_id"], key):
            got[key, m.step] = m.value
    assert got == expected
    artifacts = {a.path for a in client.list_artifacts(ids["run_id"])}
    assert {"config.toml", "curves", "data"} <= artifacts
    assert "seq_len = 128" in Path(client.download_artifacts(ids["run_id"], "config.toml")).read_text()
    table = json.loads(Path(client.download_artifacts(ids["run_id"], "data/inspect.json")).read_text())
    assert [row[0] for row in table["data"]] == list(SOURCES)


def test_a_stage_names_the_tracked_runs_it_started_from(tracked, tmp_path):
    from mlflow.tracking import MlflowClient

    from loongtrain.train.tracking import open_trackers

    cfg = load_config(None, ["metrics.mlflow=true", f"metrics.mlflow_tracking_uri={tracked['store']}"])
    stage = tmp_path / "stage2"
    stage.mkdir()
    trackers = open_trackers(cfg.metrics, stage, {}, "", stage_from=tracked["dir"] / "checkpoints" / "step-6")
    trackers.close()
    new = json.loads((stage / "tracking.json").read_text())["mlflow"]["run_id"]
    tags = MlflowClient(tracking_uri=tracked["store"]).get_run(new).data.tags
    assert tags["loongtrain.stage_of.mlflow_run_id"] == tracked["first"]["ids"]["mlflow"]["run_id"]
    assert tags["loongtrain.stage_of.wandb_id"] == tracked["first"]["ids"]["wandb"]["id"]


def _silent_server() -> socket.socket:
    """A loopback socket that accepts connections (the kernel's backlog) and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    return server


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind", ["closed", "silent"])
def test_an_unreachable_service_costs_one_warning_and_a_bounded_wait(tmp_path, monkeypatch, kind):
    from loongtrain.train.tracking import open_trackers

    server = _silent_server() if kind == "silent" else None
    port = server.getsockname()[1] if server else _closed_port()
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", url)
    monkeypatch.setenv("WANDB_SILENT", "true")
    timeout = 2.0
    cfg = load_config(None, ["metrics.wandb=true", "metrics.mlflow=true", f"metrics.mlflow_tracking_uri={url}",
                             f"metrics.connect_timeout_s={timeout}"])  # fmt: skip
    said = []
    t0 = time.perf_counter()
    trackers = open_trackers(cfg.metrics, tmp_path, {}, "", say=said.append)
    waited = time.perf_counter() - t0
    trackers.log({"kind": "train", "step": 1, "loss": 1.0})  # goes nowhere, costs nothing
    trackers.close()
    total = time.perf_counter() - t0
    print(f"{kind}: waited {waited:.2f} s at start, {total:.2f} s in all")
    # bounded by our wait, not the libraries' own (W&B alone gave up after ~16 s): a loose bound, so a loaded
    # machine cannot fail it; the seconds themselves are printed above and reported in docs/training.md
    assert waited < 5 * timeout and total < 5 * timeout
    assert len(said) == 2 and all("training goes on and the metrics are still in" in s for s in said)
    assert not (tmp_path / "tracking.json").exists()
    if server:
        server.close()


def test_a_training_run_goes_on_when_no_service_answers(dist_pool, tmp_path):
    server = _silent_server()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    env = {"WANDB_MODE": "online", "WANDB_API_KEY": "x" * 40, "WANDB_BASE_URL": url, "WANDB_SILENT": "true"}
    run_dir = tmp_path / "run"
    overrides = [*_write_mixture(tmp_path), f"run.output_dir={run_dir}", f"metrics.mlflow_tracking_uri={url}",
                 "metrics.connect_timeout_s=2", "run.steps=4"]  # fmt: skip
    seconds = dist_pool(2).run(_train, overrides, env)[0]
    server.close()
    print(f"4 steps with both services silent: {seconds:.1f} s")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=_refuse) for line in lines]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [2, 4]
    assert not (run_dir / "tracking.json").exists()
