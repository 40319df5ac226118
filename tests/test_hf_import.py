"""Import of tiny random HF models (Llama, Llama-3 rope scaling, Mistral, Qwen2 with q/k/v
bias and tied embeddings, Qwen3 with q/k norm and head_dim != hidden/heads): logits equal
transformers' unsharded and under a 2D layout at world 4 (each rank reads its shards)."""

from __future__ import annotations

import pytest
import torch

from loongtrain.hf.load import load_weights, read_folder
from loongtrain.hf.weights import parameter_map
from loongtrain.model import build_model

from hf_tiny import FAMILIES, hf_logits, make_hf_model, rel_err

pytest.importorskip("transformers")
SEQ = 32


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {family: make_hf_model(family, root / family, seed=i) for i, family in enumerate(FAMILIES)}


def _tokens() -> torch.Tensor:
    return torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("family", FAMILIES)
def test_unsharded_logits_equal_transformers(folders, family):
    cfg = read_folder(folders[family]).model
    model = build_model(cfg)
    assert set(parameter_map(cfg)) == {n for n, _ in model.named_parameters()}
    model.to_empty(device="cpu")
    load_weights(model, read_folder(folders[family]))
    with torch.no_grad():
        ours = model(_tokens(), torch.arange(SEQ))
    err = rel_err(ours, hf_logits(folders[family], _tokens()))
    assert err < 1e-5, f"{family}: rel err {err:.2e}"


def test_bfloat16_source_loads_exactly(tmp_path):
    folder = make_hf_model("qwen3", tmp_path / "bf16", dtype=torch.bfloat16)
    hf = read_folder(folder)
    cfg, table = hf.model, hf.table
    assert table["model.norm.weight"].dtype == "bfloat16"
    model = build_model(cfg)
    model.to_empty(device="cpu")
    load_weights(model, read_folder(folder))
    with torch.no_grad():
        ours = model(_tokens(), torch.arange(SEQ))
    err = rel_err(ours, hf_logits(folder, _tokens()))  # transformers upcasts the same bf16 values to fp32
    assert err < 1e-5, f"rel err {err:.2e}"


def _sharded_logits(cfg, folder: str, tokens: torch.Tensor) -> torch.Tensor:
    from loongtrain.apply import parallelize
    from loongtrain.attention import unshard_sequence
    from loongtrain.data.batch import Microbatch
    from loongtrain.train.step import shard_microbatch

    from dist_pool import cached_state

    state = cached_state(hp=2, cp=2)
    model = build_model(cfg)
    parallelize(model, state, zero="dp_sp")
    model.to_empty(device="cpu")
    load_weights(model, read_folder(folder))  # this rank's rows only
    local_rows = model.layers[0].attention.wq.weight.to_local().shape[0]
    shard = shard_microbatch(Microbatch(tokens, tokens), state)
    with torch.no_grad():
        logits = unshard_sequence(model(shard.tokens, shard.positions), state)
    return logits, local_rows


@pytest.mark.dist
def test_2d_layout_world4_logits_equal_transformers(dist_pool, folders):
    pool = dist_pool(4)
    for family in FAMILIES:
        cfg = read_folder(folders[family]).model
        results = pool.run(_sharded_logits, cfg, str(folders[family]), _tokens())
        assert [rows for _, rows in results] == [cfg.n_heads * cfg.head_dim // 4] * 4, "weights must stay sharded"
        ref = hf_logits(folders[family], _tokens())
        for rank, (logits, _) in enumerate(results):
            err = rel_err(logits, ref)
            assert err < 1e-5, f"{family} rank {rank}: rel err {err:.2e}"
