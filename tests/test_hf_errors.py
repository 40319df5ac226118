"""Bad input to import and export: a clear one-line error naming the problem and the fix,
raised before any process group exists, and no partial output folder left behind."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from loongtrain.config import ConfigError, load_config
from loongtrain.hf.folder import HFFormatError
from loongtrain.hf.load import read_folder
from loongtrain.train.export import export_checkpoint
from loongtrain.train.trainer import preflight

from hf_tiny import import_and_checkpoint, make_hf_model

pytest.importorskip("transformers")


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _case_no_config(folder: Path) -> None:
    (folder / "config.json").unlink()


def _case_model_type(folder: Path) -> None:
    _edit_config(folder, model_type="gpt2")


def _case_shape(folder: Path) -> None:
    _edit_config(folder, intermediate_size=128)


def _case_missing_shard(folder: Path) -> None:
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()


def _case_dtype(folder: Path) -> None:
    _edit_config(folder, dtype="bfloat16")  # the tensors are float32


def _case_extra_tensor(folder: Path) -> None:
    _edit_config(folder, model_type="qwen2")  # Llama weights: the q/k/v biases are missing


def _case_unknown_tensor(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)  # weights config.json does not describe
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _case_layer_types(folder: Path) -> None:  # a layer kind loongtrain does not compute (Llama 4's)
    _edit_config(folder, model_type="qwen2", use_sliding_window=True, sliding_window=16,
                 layer_types=["full_attention", "chunked_attention"], attention_bias=False)  # fmt: skip


def _case_softcapping(folder: Path) -> None:
    _edit_config(folder, attn_logit_softcapping=50.0)


def _case_window_beyond_positions(folder: Path) -> None:
    _edit_config(folder, model_type="mistral", sliding_window=128)  # max_position_embeddings = 64


def _case_rope_type(folder: Path) -> None:
    _edit_config(folder, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})


def _case_truncated(folder: Path) -> None:  # an interrupted copy: the header is intact, the data is not
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])


CASES = {
    "no-config": (_case_no_config, "has no config.json: point model.init_from at a folder written by"),
    "model-type": (_case_model_type, re.escape("model_type 'gpt2' is not supported; supported model types: "
                                                  "['gemma3_text', 'llama', 'mistral', 'olmo3', 'qwen2', 'qwen3', "
                                                  "'smollm3']")),
    "shape": (_case_shape, r"has shape \[96, 64\] but config.json implies \[128, 64\]"),
    "missing-shard": (_case_missing_shard, r"shard file\(s\) \['model-000\d+-of-\d+.safetensors'\] listed in "
                      r"model.safetensors.index.json are missing"),
    "dtype": (_case_dtype, "is float32 but config.json declares dtype 'bfloat16'"),
    "tensors": (_case_extra_tensor, "tensor.* that config.json implies are missing"),
    "unknown-tensor": (_case_unknown_tensor, r"hold 1 tensor\(s\) the config.json model does not have, e.g. "
                       r"\['model.layers.0.self_attn.o_proj.bias'\]"),
    "layer-types": (_case_layer_types, re.escape("layer_types entries ['chunked_attention'] is not supported")),
    "softcapping": (_case_softcapping, r"attn_logit_softcapping=50.0 \(softcapping of the attention scores\)"),
    "window": (_case_window_beyond_positions, "sliding_window=128 larger than max_position_embeddings=64"),
    "rope-type": (_case_rope_type, "rope_type 'dynamic' is not supported"),
    "truncated": (_case_truncated, r"model.safetensors is truncated: its header describes \d+ bytes but the file has "
                  r"\d+ \(an interrupted copy or download\?\); copy the file again"),
}  # fmt: skip


def test_a_file_given_as_the_model_folder_is_said_to_be_one(tmp_path):
    weights = tmp_path / "model" / "model.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(b"{}")
    for path, message in [
        (weights, f"is a file, not a folder; give the folder that holds config.json and the \\*.safetensors "
                  f"\\(e.g. '{weights.parent}'\\)"),
        (tmp_path / "nope", "does not exist$"),
    ]:  # fmt: skip
        cfg = load_config(None, [f"model.init_from={path}", f"run.output_dir={tmp_path / 'run'}"])
        with pytest.raises(ConfigError, match=f"Hugging Face model folder '{path}' {message}"):
            preflight(cfg, 1)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_folder_is_refused_before_start_up(tmp_path, case):
    folder = tmp_path / "model"
    make_hf_model("llama", folder)
    if case == "missing-shard":
        import transformers

        transformers.AutoModelForCausalLM.from_pretrained(folder).save_pretrained(
            tmp_path / "sharded", max_shard_size="40KB"
        )
        folder = tmp_path / "sharded"
    edit, message = CASES[case]
    edit(folder)
    with pytest.raises(HFFormatError, match=message) as info:
        read_folder(folder)
    assert "\n" not in str(info.value)
    run = tmp_path / "run"
    cfg = load_config(None, [f"model.init_from={folder}", f"run.output_dir={run}"])
    with pytest.raises(ConfigError, match=message):
        preflight(cfg, 1)  # what `loongtrain train` runs before any process starts
    assert not run.exists(), "a refused import must not create the run folder"


def test_quantised_weights_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = make_hf_model("llama", tmp_path / "model")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int8)
    save_file(tensors, str(folder / "model.safetensors"))
    _edit_config(folder, dtype=None)
    with pytest.raises(HFFormatError, match="has dtype int8; only unquantised float weights"):
        read_folder(folder)


@pytest.mark.dist
def test_export_refuses_existing_target_and_leaves_nothing_on_failure(dist_pool, tmp_path):
    folder = make_hf_model("qwen3", tmp_path / "model")
    run = tmp_path / "run"
    dist_pool(4).run(import_and_checkpoint, str(folder), str(run))
    step = run / "checkpoints" / "step-0"

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(HFFormatError, match="already exists; choose a new folder"):
        export_checkpoint(step, existing)
    assert [p.name for p in existing.iterdir()] == ["keep.txt"]

    with pytest.raises(HFFormatError, match="does not exist; pass <run>/checkpoints/step-N"):
        export_checkpoint(run / "checkpoints" / "step-9", tmp_path / "out0")
    with pytest.raises(HFFormatError, match="export dtype 'int8'"):
        export_checkpoint(step, tmp_path / "out1", dtype="int8")

    for data in step.glob("*.distcp"):
        data.write_bytes(b"")  # the weights are gone: the checksums say so before anything is written
    out = tmp_path / "out2"
    with pytest.raises(HFFormatError, match=r"checkpoint .*step-0 is damaged: file __\d_0.distcp has 0 bytes"):
        export_checkpoint(step, out, max_shard_bytes=20_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing", "model", "run"], "no partial folder"


def test_export_cli_error_is_one_line(tmp_path, capsys):
    from loongtrain.cli import main

    with pytest.raises(SystemExit) as info:
        main(["export", str(tmp_path / "nothing"), "-o", str(tmp_path / "out")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("loongtrain export: checkpoint folder") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e
def test_core_imports_without_the_hf_extra(tmp_path):
    """transformers and safetensors are optional: the library, the trainer and the CLI
    import without them, and init_from then says how to install them."""
    code = (
        "import sys\n"
        "sys.modules['transformers'] = None\n"
        "sys.modules['safetensors'] = None\n"
        "import loongtrain, loongtrain.train.trainer, loongtrain.hf.attention, loongtrain.train.export\n"
        "from loongtrain.cli import build_parser\n"
        "build_parser()\n"
        "from loongtrain.config import ConfigError, load_config\n"
        "from loongtrain.train.model_setup import model_config_for\n"
        "try:\n"
        "    model_config_for(load_config(None, ['model.init_from=FOLDER_PLACEHOLDER']).model)\n"
        "except ConfigError as e:\n"
        "    print(e)\n"
    )
    folder = make_hf_model("llama", tmp_path / "m")
    code = code.replace("FOLDER_PLACEHOLDER", str(folder))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'loongtrain[hf]'" in proc.stdout


@pytest.mark.unit
def test_a_rope_base_on_the_full_layers_is_refused_not_swapped():
    """OLMo 3 and Gemma 3 state a RoPE of their own for the sliding layers only: a model whose
    full layers carry the other base is refused (it was written with the two bases swapped)."""
    import dataclasses

    from loongtrain.hf.families import layer_kinds_to_hf
    from loongtrain.model.config import PRESETS, LayerKind

    gemma = PRESETS["gemma3-4b"]
    assert layer_kinds_to_hf(gemma, "gemma3_text")["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    swapped = tuple(LayerKind(0, rope_theta=5e5) if not k.sliding_window else LayerKind(k.sliding_window)
                    for k in gemma.kinds)  # fmt: skip
    with pytest.raises(HFFormatError, match="RoPE bases of their own; gemma3_text states one"):
        layer_kinds_to_hf(dataclasses.replace(gemma, layer_kinds=swapped), "gemma3_text")
