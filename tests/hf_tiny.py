"""Tiny random Hugging Face models written to local folders (config only, random init,
``save_pretrained``; nothing is downloaded), and their logits as the reference."""

from __future__ import annotations

from pathlib import Path

import torch

SMALL = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
)  # fmt: skip
FAMILY_KWARGS = {
    "llama": {},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
    "mistral": {"sliding_window": None},
    "mistral-window": {"sliding_window": 5},  # a sliding window on every layer
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"head_dim": 32},  # 4 heads x 32 != hidden 64
    # a window on layer 1 only (max_window_layers), no longer refused
    "qwen2-window": {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
    # layer 1 without RoPE and with a window (SmolLM3 makes its NoPE layers the sliding ones)
    "smollm3": {"no_rope_layers": [1, 0], "use_sliding_window": True, "sliding_window": 5, "pad_token_id": None,
                "bos_token_id": 1, "eos_token_id": 2},
    # OLMo 3: norms after attention and the MLP, q/k norms over the projections; a sliding layer with its
    # own RoPE beside a full one with YaRN
    "olmo3": {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"],
              "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 2.0,
                                                     "original_max_position_embeddings": 32, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "truncate": True}},
              "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2},
    # Gemma 3 text: a sliding layer (base 10K) beside a full one (base 1M, linear x8); head_dim 32 != 64 / 4,
    # query_pre_attn_scalar other than head_dim, tied embeddings
    "gemma3_text": {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"], "head_dim": 32,
                    "query_pre_attn_scalar": 24,
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}},
                    # no padding row: transformers' embedding would not train a pad token's row
                    "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2},
}  # fmt: skip
FAMILIES = tuple(FAMILY_KWARGS)


def hf_config(family: str, **overrides):
    import transformers

    model_type = {"llama3": "llama", "mistral-window": "mistral", "qwen2-window": "qwen2"}.get(family, family)
    kwargs = {**SMALL, **FAMILY_KWARGS[family], **overrides}
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def make_hf_model(family: str, folder: Path, seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    """A random model of ``family`` saved to ``folder`` (weights with std 0.2 so that
    every layer matters for the logits)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    model.to(dtype).save_pretrained(folder)
    return Path(folder)


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm()).item()


def add_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` entries saved into ``folder`` (tokenizer files)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def import_and_checkpoint(folder: str, run_dir: str) -> None:
    """The trainer's import (init_weights) on a 2D layout, then a checkpoint, no training."""
    import dataclasses

    from loongtrain.apply import parallelize
    from loongtrain.config import ModelSection
    from loongtrain.model import build_model
    from loongtrain.train.checkpoint import CheckpointManager
    from loongtrain.train.model_setup import init_weights, model_config_for

    from dist_pool import cached_state

    state = cached_state(hp=2, cp=2)
    section = ModelSection(init_from=folder)
    cfg = model_config_for(section)
    model = build_model(cfg)
    parallelize(model, state, zero="dp_sp")
    init_weights(model, torch.device("cpu"), folder, run_dir, seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    CheckpointManager(Path(run_dir) / "checkpoints", 1).save(
        0, model, optimizer, {"model_shape": dataclasses.asdict(cfg)}
    )
