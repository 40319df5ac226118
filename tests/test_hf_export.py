"""Export: import-then-export with no training gives back the original tensors bit for bit;
after a few training steps (the trainer, world 4, 2D layout, context extended) the exported
folder loads in transformers and its logits equal loongtrain's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from loongtrain.config import load_config
from loongtrain.hf.folder import INDEX_FILE
from loongtrain.hf.load import read_folder
from loongtrain.model import build_model
from loongtrain.train.export import export_checkpoint, model_config_of_checkpoint

from hf_tiny import FAMILIES, add_tokenizer, hf_logits, import_and_checkpoint, make_hf_model, rel_err

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _all_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(str(file)))
    return out


@pytest.mark.dist
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_import_then_export_is_bit_exact(dist_pool, tmp_path, dtype):
    pool = dist_pool(4)
    for i, family in enumerate(FAMILIES):
        source = make_hf_model(family, tmp_path / family, seed=10 + i, dtype=dtype)
        add_tokenizer(source, 96)
        run = tmp_path / f"run-{family}"
        pool.run(import_and_checkpoint, str(source), str(run))
        out = tmp_path / f"out-{family}"
        result = export_checkpoint(run / "checkpoints" / "step-0", out, max_shard_bytes=20_000)
        assert len(result.files) > 1 and (out / INDEX_FILE).is_file(), "small shards force an index"
        original, exported = _all_tensors(source), _all_tensors(out)
        if family in ("qwen2", "gemma3_text"):  # tied: transformers may store lm_head, the export does not
            original.pop("lm_head.weight", None)
        assert sorted(original) == sorted(exported)
        for name, tensor in original.items():
            assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (out / name).read_bytes() == (source / name).read_bytes(), name
        src_cfg, dst_cfg = (json.loads((p / "config.json").read_text()) for p in (source, out))
        for key in ("model_type", "hidden_size", "num_key_value_heads", "head_dim", "rope_parameters",
                    "tie_word_embeddings", "max_position_embeddings", "bos_token_id", "dtype"):  # fmt: skip
            assert dst_cfg.get(key) == src_cfg.get(key), key


def _train(overrides: list[str]) -> list[float]:
    from loongtrain.train.trainer import preflight, train

    cfg = load_config(None, overrides)
    return train(torch.device("cpu"), cfg, preflight(cfg, torch.distributed.get_world_size())).losses


EXTENSIONS = {
    "llama": ["model.rope_theta=40000"],
    "llama3": ["model.allow_longer_context=true"],  # keeps its llama3 scaling (64 tokens), trains at 128
    "mistral": ["model.rope_scaling=linear", "model.rope_factor=2"],
    "mistral-window": ["model.sliding_window=9", "model.rope_scaling=linear", "model.rope_factor=2"],  # window 5 -> 9
    "qwen2": ["model.rope_scaling=yarn", "model.rope_factor=4"],
    "qwen3": ["model.rope_scaling=llama3", "model.rope_factor=4", "model.max_positions=300"],
    # the sliding layer's window 5 -> 9, the full one stays full
    "qwen2-window": ["model.sliding_window=9", "model.rope_scaling=linear", "model.rope_factor=2"],
    "smollm3": ["model.rope_scaling=yarn", "model.rope_factor=4"],  # its RoPE layers scaled, the NoPE one not
    "olmo3": ["model.sliding_window=9", "model.allow_longer_context=true"],  # keeps its YaRN full layer
    # its full layer's RoPE scaled again (linear x8 -> x16), the sliding one keeps its 10K base
    "gemma3_text": ["model.rope_scaling=linear", "model.rope_factor=16"],
}


@pytest.mark.dist
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the test's own one-process DCP load
def test_export_after_training_loads_in_transformers(dist_pool, tmp_path):
    from loongtrain.data import write_tokens

    tokens_file = tmp_path / "data.tok"
    write_tokens(str(tokens_file), np.random.default_rng(0).integers(0, 96, 20_000), 96)
    pool = dist_pool(4)
    for i, family in enumerate(FAMILIES):
        source = make_hf_model(family, tmp_path / family, seed=20 + i)
        run = tmp_path / f"run-{family}"
        overrides = [
            f"model.init_from={source}", f"run.output_dir={run}", "run.steps=3", "run.log_every=100",
            "run.eval_batches=1", "run.tensorboard=false", "run.progress=off", "data.source=tokens",
            f"data.path={tokens_file}", "data.seq_len=128", "data.global_batch=4", "optim.lr=1e-2",
            "optim.warmup_steps=1", "parallel.hp=2", "parallel.cp=2", "memory.activation_checkpoint=sc++",
            *EXTENSIONS[family],
        ]  # fmt: skip
        losses = pool.run(_train, overrides)[0]
        assert len(losses) == 3 and all(np.isfinite(losses))
        step = run / "checkpoints" / "step-3"
        out = tmp_path / f"out-{family}"
        export_checkpoint(step, out)

        cfg = model_config_of_checkpoint(step)
        model = build_model(cfg)
        model.to_empty(device="cpu")
        state = model.state_dict()
        dcp.load({"model": state}, checkpoint_id=str(step), no_dist=True)
        model.load_state_dict(state)
        tokens = torch.randint(0, 96, (2, 128), generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            ours = model(tokens, torch.arange(128))
        theirs = hf_logits(out, tokens)
        err = rel_err(ours, theirs)
        assert err < 1e-5, f"{family}: rel err {err:.2e}"
        before = hf_logits(source, tokens)
        assert rel_err(before, theirs) > 1e-3, "training must have changed the model"
        written = json.loads((out / "config.json").read_text())["max_position_embeddings"]
        assert written == max(cfg.max_positions, 128), "the extended context, or the trained length if longer"
        exported_cfg = read_folder(out).model  # the export re-imports to the trained config
        assert exported_cfg == dataclasses.replace(cfg, max_positions=written)
