"""configs/extend_cpu.toml end to end, as docs/training.md shows it: a tiny local HF Llama
(128-token context), its tokenizer on local text, context x4 with YaRN, training on 4
processes, export, and generation with plain transformers from the exported folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(args: list[str], cwd: Path) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=cwd)
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow
@pytest.mark.e2e
def test_extend_cpu_config_end_to_end(tmp_path):
    for name in ("README.md", "docs", "src"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    _run([sys.executable, str(ROOT / "examples" / "make_tiny_hf.py"), "-o", "runs/tiny-hf"], tmp_path)
    _run([str(BIN / "loongtrain"), "prepare", "README.md", "docs", "src", "-o", "runs/extend_cpu.tok",
          "--tokenizer", "runs/tiny-hf"], tmp_path)  # fmt: skip
    # two steps (each ~1 s on 4 processes): the round trip, not the learning, is the point here
    out = _run([str(BIN / "loongtrain"), "train", "--config", "configs/extend_cpu.toml", "--nproc", "4",
                "--run.steps", "2", "--run.progress", "off", "--run.tensorboard", "false"], tmp_path)  # fmt: skip
    assert "step     2/2" in out
    _run([str(BIN / "loongtrain"), "export", "runs/extend_cpu/checkpoints/step-2", "-o", "runs/extend_cpu/hf"],
         tmp_path)  # fmt: skip
    config = json.loads((tmp_path / "runs/extend_cpu/hf/config.json").read_text())
    assert config["max_position_embeddings"] == 512
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["factor"] == 4.0
    assert config["rope_parameters"]["original_max_position_embeddings"] == 128
    text = _run([sys.executable, str(ROOT / "examples" / "generate.py"), "runs/extend_cpu/hf", "--tokens", "8"],
                tmp_path)  # fmt: skip
    lines = text.strip().splitlines()
    assert "max_position_embeddings 512" in lines[0] and "'rope_type': 'yarn'" in lines[0]
    # 8 greedy tokens from transformers itself (their text depends on the machine's arithmetic)
    assert lines[-1].startswith("answer (") and lines[-1].split(": ", 1)[1] not in ("''", '""'), lines


@pytest.mark.slow
@pytest.mark.e2e
def test_olmo3_miniature_end_to_end(tmp_path):
    """configs/olmo3_extend_cpu.toml: a tiny OLMo 3 (3 sliding : 1 full) extended 4x, trained on 4
    processes, exported; transformers reads its layer types back and generates from it."""
    for name in ("README.md", "docs", "src", "configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    _run([sys.executable, str(ROOT / "examples" / "make_tiny_hf.py"), "-o", "runs/tiny-olmo3", "--family", "olmo3"],
         tmp_path)  # fmt: skip
    _run([str(BIN / "loongtrain"), "prepare", "README.md", "docs", "-o", "runs/olmo3_extend_cpu.tok",
          "--tokenizer", "runs/tiny-olmo3"], tmp_path)  # fmt: skip
    out = _run([str(BIN / "loongtrain"), "train", "--config", "configs/olmo3_extend_cpu.toml", "--nproc", "4",
                "--run.steps", "2", "--run.progress", "off", "--run.tensorboard", "false"], tmp_path)  # fmt: skip
    assert "step     2/2" in out
    _run([str(BIN / "loongtrain"), "export", "runs/olmo3_extend_cpu/checkpoints/step-2", "-o",
          "runs/olmo3_extend_cpu/hf"], tmp_path)  # fmt: skip
    config = json.loads((tmp_path / "runs/olmo3_extend_cpu/hf/config.json").read_text())
    assert config["model_type"] == "olmo3" and config["max_position_embeddings"] == 512
    assert config["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"] and config["sliding_window"] == 32
    assert config["rope_parameters"]["full_attention"]["rope_type"] == "yarn"
    text = _run([sys.executable, str(ROOT / "examples" / "generate.py"), "runs/olmo3_extend_cpu/hf", "--tokens", "8"],
                tmp_path)  # fmt: skip
    assert text.strip().splitlines()[-1].startswith("answer (")
