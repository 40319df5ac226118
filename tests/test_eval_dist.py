"""The long-context evaluation on 4 gloo ranks gives what one process gives: the same
needle outcomes and the loss by position within float32 noise, on a 2D layout
(hp=2 x cp=2, ring window 2), a double ring (cp=4, ring window 2) and two data-parallel
replicas (cp=2, dp=2); and the ``[eval]`` section runs inside training."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from loongtrain.apply import materialize, parallelize
from loongtrain.config import load_config
from loongtrain.data import write_tokens
from loongtrain.eval.plan import make_plan
from loongtrain.eval.runner import run_loss_by_position, run_needles, score_batch
from loongtrain.model import ModelConfig, build_model

from dist_pool import cached_state

SHAPE = dict(init_std=0.2, n_layers=2)  # a random model whose predictions depend on the context
SEED = 5
LAYOUTS = {
    "2d": dict(hp=2, cp=2, ring_window=2),
    "double_ring": dict(cp=4, ring_window=2),
    "dp2": dict(cp=2),
}


def _plan(token_file: str):
    cfg = load_config(None, ["eval.lengths=64,128,256", "eval.depths=3", "eval.samples=2", "eval.needles=4"])
    plan = make_plan(cfg, ModelConfig(**SHAPE), 2, 2)
    return dataclasses.replace(plan, loss_file=token_file, loss_len=256, loss_windows=3, buckets=9)


def _probe(seq: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence whose labels are the single-process model's own argmax (every one a hit there)."""
    tokens = torch.randint(0, 256, (seq,), generator=torch.Generator().manual_seed(1))
    model = build_model(ModelConfig(**SHAPE))
    materialize(model, torch.device("cpu"), seed=SEED)
    with torch.no_grad():
        labels = model(tokens[None], torch.arange(seq))[0].argmax(-1)
    return tokens, labels


def _evaluate(layout: dict | None, plan, probe) -> dict:
    state = None if layout is None else cached_state(**layout)
    model = build_model(ModelConfig(**SHAPE))
    if state is not None:
        parallelize(model, state, zero="dp_sp")
    materialize(model, torch.device("cpu"), seed=SEED)
    needles = run_needles(model, state, plan)
    loss = run_loss_by_position(model, state, plan)
    probe_loss, probe_hits = (r[0] for r in score_batch(model, state, probe[0][None], probe[1][None]))
    return {
        "correct": [o.correct for o in needles.outcomes],
        "keys": [(o.length, o.depth, o.sample, o.key, o.position) for o in needles.outcomes],
        "answer_loss": [o.answer_loss for o in needles.outcomes],
        "loss": [r["mean_loss"] for r in loss.rows],
        "tokens": [r["tokens"] for r in loss.rows],
        "probe_loss": probe_loss.tolist(),
        "probe_hits": probe_hits.tolist(),
    }


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("eval") / "text.tok"
    rng = np.random.default_rng(0)
    write_tokens(path, rng.integers(0, 256, 4000), vocab_size=256)
    return str(path)


@pytest.mark.dist
def test_every_layout_gives_the_single_process_grid(dist_pool, token_file):
    torch.set_num_threads(1)
    plan, probe = _plan(token_file), _probe()
    single = _evaluate(None, plan, probe)
    assert all(single["probe_hits"])  # every probe label is a hit in one process: any differing argmax shows
    pool = dist_pool(4)
    for name, layout in LAYOUTS.items():
        ranks = pool.run(_evaluate, layout, plan, probe)
        for rank, got in enumerate(ranks):
            assert got["keys"] == single["keys"], (name, rank)
            assert got["correct"] == single["correct"], (name, rank, "exact-match outcomes differ")
            assert got["probe_hits"] == single["probe_hits"], (name, rank, "an argmax differs from one process")
            assert got["tokens"] == single["tokens"], name
            np.testing.assert_allclose(got["loss"], single["loss"], rtol=2e-6, atol=2e-6, err_msg=name)
            np.testing.assert_allclose(got["answer_loss"], single["answer_loss"], rtol=1e-4, atol=1e-5, err_msg=name)
            np.testing.assert_allclose(got["probe_loss"], single["probe_loss"], rtol=1e-4, atol=1e-5, err_msg=name)


def _train_with_eval(out: str) -> list:
    from loongtrain.eval.training import after_step, check
    from loongtrain.train.trainer import preflight, train

    cfg = load_config(None, [
        f"run.output_dir={out}", "run.steps=2", "run.log_every=100", "run.eval_batches=1", "run.tensorboard=false",
        "run.progress=off", "data.seq_len=64", "data.global_batch=4", "data.recall_queries=8", "parallel.hp=2",
        "parallel.cp=2", "checkpoint.save_final=false", "eval.every=2", "eval.lengths=32,64", "eval.depths=2",
    ])  # fmt: skip
    spec = preflight(cfg, torch.distributed.get_world_size())
    check(cfg, spec, 4)
    train(torch.device("cpu"), cfg, spec, after_step=after_step)
    return sorted(p.name for p in (Path(out) / "eval").iterdir())


@pytest.mark.dist
def test_eval_section_runs_inside_training(dist_pool, tmp_path):
    out = tmp_path / "run"
    folders = dist_pool(4).run(_train_with_eval, str(out))[0]
    assert folders == ["progress.png", "step-0", "step-2"]  # before the first step and every eval.every steps
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "long_context"]
    assert [r["step"] for r in evals] == [0, 2]
    assert {"needle_accuracy", "effective_context", "needle_accuracy_32", "needle_accuracy_64"} <= set(evals[0])
    assert (out / "eval" / "step-2" / "needles.png").read_bytes()[:4] == b"\x89PNG"
    grid = json.loads((out / "eval" / "step-2" / "eval.json").read_text())["needles"]
    assert len(grid["outcomes"]) == 2 * 2 * 4 and grid["lengths"] == [32, 64]
