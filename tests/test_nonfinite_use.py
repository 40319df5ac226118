"""A checkpoint that holds a NaN on disk is refused by the commands that use it, as a resume
refuses it: ``loongtrain export`` and ``loongtrain eval`` name the tensor and exit 2, writing
nothing (before, export "wrote 21 tensors" and eval reported loss nan, both exit 0);
``export --allow-nonfinite`` writes it anyway, for debugging. The checkpoint is a real one
(one training step on 2 ranks), the NaN is put into its files afterwards and its checksums
rewritten, as a NaN that reached the disk would be."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from loongtrain.config import load_config
from loongtrain.launch import RENDEZVOUS_ENV
from loongtrain.train.checkpoint import CHECKSUM_FILE, checksum_problems, file_sha256

pytest.importorskip("transformers")

PARAMETER = "layers.1.attention.wo.weight"  # as the checkpoint (and the trainer's messages) name it
HF_NAME = "model.layers.1.self_attn.o_proj.weight"  # the same tensor in the exported folder
BASE = [
    "run.log_every=100", "run.eval_batches=1", "run.tensorboard=false", "run.progress=off", "data.seq_len=64",
    "data.global_batch=4", "data.recall_queries=8", "optim.warmup_steps=0", "memory.activation_checkpoint=none",
]  # fmt: skip


def _train_one_step(run_dir: str) -> None:
    from loongtrain.train.trainer import preflight, train

    cfg = load_config(None, [*BASE, "run.steps=1", f"run.output_dir={run_dir}"])
    train(torch.device("cpu"), cfg, preflight(cfg, torch.distributed.get_world_size()))


def _put_a_nan_on_disk(step_dir: Path, parameter: str) -> None:
    """Rewrite the checkpoint with one NaN in ``parameter`` (via DCP's own one-process format
    converters), then its checksums, so that only the value is wrong."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    whole = step_dir.parent / "whole.pt"
    dcp_to_torch_save(step_dir, whole)
    state = torch.load(whole, weights_only=False)
    state["model"][parameter].view(-1)[3] = math.nan
    torch.save(state, whole)
    for file in [*step_dir.glob("*.distcp"), step_dir / ".metadata"]:
        file.unlink()
    torch_save_to_dcp(whole, step_dir)
    whole.unlink()
    names = sorted(p.name for p in step_dir.iterdir() if p.name != CHECKSUM_FILE)
    sums = {n: {"size": (step_dir / n).stat().st_size, "sha256": file_sha256(step_dir / n)} for n in names}
    (step_dir / CHECKSUM_FILE).write_text(json.dumps(sums))
    assert not checksum_problems(step_dir, names)


@pytest.fixture(scope="module")
def nan_run(dist_pool, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("nan") / "run"
    dist_pool(2).run(_train_one_step, str(run))
    _put_a_nan_on_disk(run / "checkpoints" / "step-1", PARAMETER)
    return run


def _command(argv: list[str], capsys) -> tuple[int, str, str]:
    from loongtrain.cli import main

    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.dist
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_refuses_a_nan_checkpoint_naming_the_tensor_unless_allowed(nan_run, tmp_path, capsys):
    from safetensors import safe_open

    out = tmp_path / "hf"
    code, _, err = _command(["export", str(nan_run), "-o", str(out)], capsys)
    print(f"\n[export] exit {code}: {err.strip()}")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(
        f"loongtrain export: checkpoint {nan_run / 'checkpoints' / 'step-1'} holds 1 non-finite value(s) (NaN or "
        f"infinity) in {PARAMETER}: "
    )
    assert "--allow-nonfinite" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "nothing written, no partial folder"

    code, stdout, err = _command(["export", str(nan_run), "-o", str(out), "--allow-nonfinite"], capsys)
    assert code == 0 and stdout.splitlines()[-1].startswith("wrote 21 tensors"), err
    assert f"in {PARAMETER}; written anyway (--allow-nonfinite)" in err
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:  # safetensors' own reader
        bad = {name: int((~torch.isfinite(f.get_tensor(name))).sum()) for name in f.keys()}
    assert {name: n for name, n in bad.items() if n} == {HF_NAME: 1}


@pytest.mark.dist
def test_eval_refuses_a_nan_checkpoint_naming_the_tensor(nan_run, tmp_path, capsys, monkeypatch):
    for key in RENDEZVOUS_ENV:  # one process runs the job in place: what it sets is undone after the test
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    out = tmp_path / "eval"
    argv = ["eval", str(nan_run), "--nproc", "1", "--out", str(out), "--eval.lengths", "64"]
    code, _, err = _command(argv, capsys)
    print(f"\n[eval] exit {code}: {err.strip()}")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(
        f"loongtrain eval: checkpoint {nan_run / 'checkpoints' / 'step-1'} holds non-finite weights (NaN or "
        f"infinity) in {PARAMETER}: every result computed from it would be NaN; evaluate an older checkpoint"
    )
    assert not out.exists()
