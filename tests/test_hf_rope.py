"""RoPE context extension: loongtrain's cos/sin against transformers' own rope functions
for every supported scaling type, the q/k row order, and the [model] rope keys."""

from __future__ import annotations

import pytest
import torch

from loongtrain.config import ConfigError, load_config
from loongtrain.hf.families import model_config_from_hf
from loongtrain.hf.weights import inverse_order, rope_row_order
from loongtrain.model import ModelConfig, RopeScaling, extend_context, model_config
from loongtrain.model.llama import apply_rope, rope_tables

transformers = pytest.importorskip("transformers")

ROPE_CASES = {
    "default": {"rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn-beta-attn": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 512, "beta_fast": 16,
                       "beta_slow": 2, "attention_factor": 1.3, "truncate": False},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 0.8,
                    "mscale_all_dim": 0.6},
}  # fmt: skip


def _hf_cos_sin(config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    return rotary(torch.zeros(1, dtype=torch.float32), positions)


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_cos_sin_equal_transformers(case):
    params = {"rope_theta": 10000.0, **ROPE_CASES[case]}
    hf = transformers.LlamaConfig(
        vocab_size=32, hidden_size=512, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
        num_hidden_layers=1, max_position_embeddings=4096 * 4, rope_parameters=params,
    )  # fmt: skip
    cfg = model_config_from_hf(hf)  # head_dim 128
    positions = torch.tensor([[0, 1, 2, 17, 1000, 4095, 8191, 16383]])
    hf_cos, hf_sin = _hf_cos_sin(hf, positions)
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    half = cfg.head_dim // 2
    # transformers repeats the d/2 frequencies twice (rotate_half), ours holds them once; bit-equal
    for ours, theirs in ((cos, hf_cos), (sin, hf_sin)):
        assert torch.equal(theirs[..., :half], theirs[..., half:])
        torch.testing.assert_close(ours, theirs[..., :half], rtol=0, atol=0)
    if case != "default":
        plain_cos, _ = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
        assert not torch.allclose(plain_cos, cos), "the scaling must change the tables"


def test_theta_override_and_extend_context_match_transformers():
    base = model_config("debug", dim=256, n_heads=2, n_kv_heads=2, max_positions=1024)
    extended = extend_context(base, rope_theta=50000.0, scaling="yarn", factor=4.0)
    assert extended.max_positions == 4096 and extended.rope_scaling.original_max_positions == 1024
    hf = transformers.LlamaConfig(
        vocab_size=32, hidden_size=256, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
        num_hidden_layers=1, max_position_embeddings=4096,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                         "original_max_position_embeddings": 1024},
    )  # fmt: skip
    positions = torch.arange(0, 4096, 97).unsqueeze(0)
    hf_cos, hf_sin = _hf_cos_sin(hf, positions)
    cos, sin = rope_tables(positions, extended.head_dim, extended.rope_theta, extended.rope_scaling)
    torch.testing.assert_close(cos, hf_cos[..., :64], rtol=0, atol=0)
    torch.testing.assert_close(sin, hf_sin[..., :64], rtol=0, atol=0)


def test_rope_row_order_by_hand_and_rotation_equivalence():
    # 2 heads of 4: loongtrain rows (0,1,2,3) of a head are HF rows (0,2,1,3)
    assert rope_row_order(2, 4).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    order = rope_row_order(3, 8)
    assert torch.equal(order[inverse_order(order)], torch.arange(24))
    # rotating interleaved pairs of the reordered vector == rotate_half of the HF vector, reordered
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = torch.randn(1, 5, 3, 8, dtype=torch.float64)  # [B, S, H, d] in HF's head layout
    positions = torch.arange(5).unsqueeze(0)
    cos, sin = rope_tables(positions, 8, 10000.0)
    ours = apply_rope(x[..., rope_row_order(1, 8)], cos.double(), sin.double())
    full_cos, full_sin = torch.cat((cos, cos), -1).double(), torch.cat((sin, sin), -1).double()
    theirs, _ = apply_rotary_pos_emb(x, x, full_cos, full_sin, unsqueeze_dim=2)
    torch.testing.assert_close(ours, theirs[..., rope_row_order(1, 8)])


def test_extend_context_rules():
    base = ModelConfig(max_positions=2048, rope_theta=10000.0)
    assert extend_context(base) == base
    assert extend_context(base, rope_theta=1e6).rope_theta == 1e6
    linear = extend_context(base, scaling="linear", factor=4.0)
    assert linear.rope_scaling == RopeScaling("linear", 4.0) and linear.max_positions == 8192
    assert extend_context(linear, scaling="none").rope_scaling is None
    assert extend_context(base, scaling="llama3", factor=2.0, max_positions=5000).max_positions == 5000
    with pytest.raises(ValueError, match="set model.rope_original_max_positions"):
        extend_context(ModelConfig(), scaling="yarn", factor=4.0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.rope_factor=4"], "has no effect with model.rope_scaling='keep'"),
        (["model.rope_scaling=yarn", "model.rope_factor=0.5"], "must be >= 1"),
        (["model.rope_scaling=ntk"], "choose one of"),
        (["model.rope_theta=-1"], "must not be negative"),
        (["model.init_from=x", "model.n_layers=4"], "remove model.n_layers"),
        (["model.rope_scaling=llama3", "model.rope_factor=8", "model.rope_low_freq_factor=4"], "must exceed"),
    ],
)
def test_model_section_checks(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_frequency_factors_are_checked_only_for_llama3_scaling():
    # yarn and linear do not read them: an order that llama3 would refuse is no error there
    for scaling in ("yarn", "linear"):
        load_config(None, [f"model.rope_scaling={scaling}", "model.rope_factor=4", "model.rope_low_freq_factor=4"])
