"""Training on a mixture of sources, then a new stage from its checkpoint.

On 4 gloo ranks with packed documents: each step's per-source losses, weighted by their target
tokens, are the step's loss, and their target and token counts are those of the drawn samples
(counted here from the source's own samples). A new stage (``checkpoint.init_from``) at another
length, layout, mixture and RoPE base starts from exactly the previous stage's final weights
(and optimizer state, when asked). In process: the refusals of a stage whose checkpoint holds
another model, and of a resume on changed data."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from loongtrain.config import ConfigError, load_config
from loongtrain.data import IGNORE_INDEX, write_tokens
from loongtrain.train.checkpoint import CheckpointError

EOS, VOCAB = 255, 256
WEIGHTS = {"code": 0.3, "books": 0.3, "short": 0.4}
#: each source's token ids and median document length
SOURCES = {"code": ((0, 80), 300), "books": ((80, 160), 400), "short": ((160, 240), 40)}
BASE = [
    "run.log_every=100", "run.eval_batches=1", "run.tensorboard=false", "run.progress=off", "data.source=tokens",
    "data.pack=true", "data.global_batch=4", "optim.warmup_steps=0", "memory.activation_checkpoint=sc++",
]  # fmt: skip


def _write_sources(folder: Path) -> dict[str, Path]:
    files = {}
    for i, (name, ((lo, hi), median)) in enumerate(SOURCES.items()):
        rng = np.random.default_rng(i)
        lengths = np.maximum(2, rng.lognormal(np.log(median), 1.0, 400).astype(np.int64))
        tokens = rng.integers(lo, hi, int(lengths.sum()))
        tokens[np.cumsum(lengths) - 1] = EOS
        files[name] = folder / f"{name}.tok"
        write_tokens(files[name], tokens, vocab_size=VOCAB, eos=EOS)
    return files


def _mixture(files: dict[str, Path], weights: dict[str, float]) -> list[str]:
    out = []
    for name, path in files.items():
        out += [f"data.sources.{name}.path={path}", f"data.sources.{name}.weight={weights[name]}"]
    return out


_START: dict = {}


def _capture_start(run, done, reporter, beat) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    if done == 0:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        _START["model"] = {k: v.clone() for k, v in get_model_state_dict(run.model, options=options).items()}
        optim = run.optimizer.state
        _START["optim_steps"] = sorted({float(s["step"]) for s in optim.values()}) if optim else []
        if optim:  # (reading it as a state dict before the first step would initialise it with a step)
            state = get_optimizer_state_dict(run.model, run.optimizer, options=options)
            _START["optim"] = copy.deepcopy(state)  # its plain tensors (AdamW's step) are the live ones


def _train(overrides: list[str], capture: bool = False) -> dict:
    from loongtrain.train.trainer import preflight, train

    _START.clear()
    cfg = load_config(None, BASE + overrides)
    result = train(torch.device("cpu"), cfg, preflight(cfg, torch.distributed.get_world_size()),
                   after_step=_capture_start if capture else None)  # fmt: skip
    return {"losses": result.losses, "start": dict(_START) if torch.distributed.get_rank() == 0 else None}


def _refuse(constant: str):
    raise ValueError(f"metrics.jsonl holds {constant}, which strict JSON parsers reject")


def _records(run_dir: Path, kind: str) -> list[dict]:
    """``metrics.jsonl`` read strictly (no NaN or Infinity): a source absent from a step has no loss/NAME."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in (json.loads(line, parse_constant=_refuse) for line in lines) if r["kind"] == kind]


def _tensors(checkpoint: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, checkpoint.parent / "as_torch.pt")
    return torch.load(checkpoint.parent / "as_torch.pt", weights_only=False)


def test_a_mixture_trains_with_losses_per_source_then_a_stage_starts_from_it(dist_pool, tmp_path):
    from loongtrain.train.spec import make_source

    pool = dist_pool(4)
    files = _write_sources(tmp_path)
    stage1, stage2 = tmp_path / "stage1", tmp_path / "stage2"
    first = [*_mixture(files, WEIGHTS), "data.seq_len=128", "parallel.hp=2", "parallel.cp=2", "run.steps=3"]
    pool.run(_train, [*first, f"run.output_dir={stage1}"])
    steps = _records(stage1, "train")
    assert len(steps) == 3
    for r in steps:
        targets = [r[f"targets/{name}"] for name in WEIGHTS]
        weighted = sum(r[f"loss/{name}"] * r[f"targets/{name}"] for name in WEIGHTS if r[f"targets/{name}"])
        assert all((f"loss/{name}" in r) == bool(r[f"targets/{name}"]) for name in WEIGHTS)
        assert weighted / sum(targets) == pytest.approx(r["loss"], rel=1e-6)
        assert sum(r[f"tokens/{name}"] for name in WEIGHTS) == 4 * 128
    # the first step's counts, from the samples the source itself gives for indices 0..3
    source = make_source(load_config(None, BASE + first))
    tokens, targets = dict.fromkeys(WEIGHTS, 0), dict.fromkeys(WEIGHTS, 0)
    for i in range(4):
        d, k = source.locate(i)
        _, labels, _ = source.sample(i)
        tokens[source.names[d]] += labels.numel()
        targets[source.names[d]] += int((labels != IGNORE_INDEX).sum())
    assert {n: steps[0][f"tokens/{n}"] for n in WEIGHTS} == tokens
    assert {n: steps[0][f"targets/{n}"] for n in WEIGHTS} == targets
    final_eval = _records(stage1, "eval")[-1]
    assert all(np.isfinite(final_eval[f"loss/{name}"]) for name in WEIGHTS)

    # stage 2: twice the length, another layout, mixture and RoPE base; weights and AdamW from stage 1
    second = [
        *_mixture(files, {"code": 0.5, "books": 0.4, "short": 0.1}), "data.seq_len=256", "parallel.cp=4",
        "model.rope_theta=100000", "run.steps=1", f"checkpoint.init_from={stage1}", "checkpoint.init_optimizer=true",
    ]  # fmt: skip
    start = pool.run(_train, [*second, f"run.output_dir={stage2}"], True)[0]["start"]
    saved = _tensors(stage1 / "checkpoints" / "step-3")
    assert start["model"].keys() == saved["model"].keys()
    assert all(torch.equal(start["model"][k], saved["model"][k]) for k in saved["model"])
    assert start["optim_steps"] == [3.0]  # AdamW's step count goes on
    for name, state in saved["optim"]["state"].items():
        assert all(torch.equal(start["optim"]["state"][name][k], v) for k, v in state.items()), name
    record = _records(stage2, "train")[0]
    assert record["step"] == 1 and {f"targets/{n}" for n in WEIGHTS} <= record.keys()
    assert {f"loss/{n}" for n in WEIGHTS if record[f"targets/{n}"]} <= record.keys()
    # without init_optimizer: the same weights, a fresh AdamW
    fresh = pool.run(_train, [*second[:-1], f"run.output_dir={tmp_path / 'fresh'}"], True)[0]["start"]
    assert all(torch.equal(fresh["model"][k], saved["model"][k]) for k in saved["model"])
    assert fresh["optim_steps"] == []


def test_stage_and_resume_refusals(tmp_path):
    from loongtrain.train.checkpoint import STATE_FILE
    from loongtrain.train.preflight import preflight

    files = _write_sources(tmp_path)
    done = tmp_path / "done" / "checkpoints" / "step-5"
    done.mkdir(parents=True)
    shape = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, "ffn_dim": 176}
    (done / STATE_FILE).write_text(json.dumps({"step": 5, "model_shape": {**shape, "n_layers": 4}}))
    (done / "checksums.json").write_text("{}")
    common = [*BASE, *_mixture(files, WEIGHTS), "data.seq_len=128"]
    cfg = load_config(None, [*common, f"checkpoint.init_from={tmp_path / 'done'}", f"run.output_dir={tmp_path / 'r'}"])
    with pytest.raises(CheckpointError, match=r"another shape \(saved vs this stage: \{'n_layers': \(4, 2\)"):
        preflight(cfg, 1)
    cfg = load_config(None, [*common, f"checkpoint.init_from={tmp_path}", f"run.output_dir={tmp_path / 'r'}"])
    with pytest.raises(CheckpointError, match="is neither a run folder .* nor a checkpoint folder"):
        preflight(cfg, 1)
    for path, what in [(done / STATE_FILE, "is a file, not a run folder .* or a checkpoint folder"),
                       (tmp_path / "nope", "does not exist; give the previous stage's run.output_dir")]:  # fmt: skip
        cfg = load_config(None, [*common, f"checkpoint.init_from={path}", f"run.output_dir={tmp_path / 'r'}"])
        with pytest.raises(CheckpointError, match=f"checkpoint.init_from='.*' {what}"):
            preflight(cfg, 1)
    with pytest.raises(ConfigError, match="both give the initial weights: keep one"):
        load_config(None, [*common, f"checkpoint.init_from={tmp_path}", f"model.init_from={tmp_path}"])
    # a resume whose data changed: the checkpoint records the fingerprint of the data it was written on
    from loongtrain.train.spec import make_source, source_fingerprint

    written = source_fingerprint(make_source(load_config(None, common)))
    run = tmp_path / "run" / "checkpoints" / "step-2"
    run.mkdir(parents=True)
    state = {"step": 2, "model_shape": shape, "data": {"next_index": 8, "fingerprint": written}}
    (run / STATE_FILE).write_text(json.dumps(state))
    out = f"run.output_dir={tmp_path / 'run'}"
    preflight(load_config(None, [*common, out]), 1)  # the same data: resumes
    changed = [*BASE, *_mixture(files, {**WEIGHTS, "short": 0.5}), "data.seq_len=128", out]
    with pytest.raises(CheckpointError, match=rf"was written on other data \(fingerprint {written}, now "):
        preflight(load_config(None, changed), 1)
    preflight(load_config(None, [*changed, "checkpoint.allow_data_change=true"]), 1)
