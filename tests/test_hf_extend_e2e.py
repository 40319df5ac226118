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


#: each shipped CPU miniature: its config, the tiny HF family it extends (and where the config reads it), and
#: what its export's config holds
MINIATURES = {
    "extend_cpu": ("llama", "runs/tiny-hf", {"max_position_embeddings": 512}),
    # a tiny OLMo 3 (3 sliding : 1 full, window 32), YaRN on its full layers
    "olmo3_extend_cpu": ("olmo3", "runs/tiny-olmo3", {
        "max_position_embeddings": 512, "model_type": "olmo3", "sliding_window": 32,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    }),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("name", MINIATURES)
def test_extend_cpu_config_end_to_end(tmp_path, name):
    """configs/NAME.toml as its header shows it: the tiny HF model, its tokenizer on local text,
    context x4 with YaRN, 2 steps on 4 processes, export, and plain transformers generating."""
    family, tiny, expected = MINIATURES[name]
    for entry in ("README.md", "docs", "src", "configs"):
        (tmp_path / entry).symlink_to(ROOT / entry)
    _run([sys.executable, str(ROOT / "examples" / "make_tiny_hf.py"), "-o", tiny, "--family", family], tmp_path)
    _run([str(BIN / "loongtrain"), "prepare", "README.md", "docs", "src", "-o", f"runs/{name}.tok",
          "--tokenizer", tiny], tmp_path)  # fmt: skip
    # two steps (each ~1 s on 4 processes): the round trip, not the learning, is the point here
    out = _run([str(BIN / "loongtrain"), "train", "--config", f"configs/{name}.toml", "--nproc", "4",
                "--run.steps", "2", "--run.progress", "off", "--run.tensorboard", "false"], tmp_path)  # fmt: skip
    assert "step     2/2" in out
    _run([str(BIN / "loongtrain"), "export", f"runs/{name}/checkpoints/step-2", "-o", f"runs/{name}/hf"],
         tmp_path)  # fmt: skip
    config = json.loads((tmp_path / f"runs/{name}/hf/config.json").read_text())
    assert {key: config[key] for key in expected} == expected
    rope = config["rope_parameters"].get("full_attention", config["rope_parameters"])  # per layer type (OLMo 3)
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == 128
    text = _run([sys.executable, str(ROOT / "examples" / "generate.py"), f"runs/{name}/hf", "--tokens", "8"],
                tmp_path)  # fmt: skip
    lines = text.strip().splitlines()
    assert "max_position_embeddings 512" in lines[0] and "'rope_type': 'yarn'" in lines[0]
    # 8 greedy tokens from transformers itself (their text depends on the machine's arithmetic)
    assert lines[-1].startswith("answer (") and lines[-1].split(": ", 1)[1] not in ("''", '""'), lines
