"""The pieces of ``scripts/smollm2.py`` and ``scripts/make_chat_data.py`` that need neither
the 93 MB wheel nor a network: the conversion's rebuild-and-save step on a tiny random
Llama, and the chat-data generator on small Python sources."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- scripts/smollm2.py: rebuild a plain Llama, load strictly, save, reload -------------------------------------


def _tiny_llama(tie: bool):
    transformers = pytest.importorskip("transformers", reason="the conversion needs transformers (the hf extra)")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tie,
        rms_norm_eps=float(torch.tensor(1e-5, dtype=torch.float32)),  # as GGUF stores it: 9.999999747378752e-06
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.2 * torch.randn_like(p))
    # what the GGUF loader leaves in the config: a quantisation entry and the file's model name
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf", "dequantize": False}
    model.config._model_name_or_path = "Tiny 1K"
    return model


def _tiny_tokenizer():
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 64)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    return fast


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_rebuild_save_reload_gives_identical_logits(tmp_path, tie):
    smollm2 = _script("smollm2")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = _tiny_llama(tie)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    out = smollm2.write_plain_folder(model, _tiny_tokenizer(), tmp_path / "plain", check_tokens=tokens)

    assert out == tmp_path / "plain" and not (tmp_path / "plain.partial").exists()
    assert smollm2.is_complete(out)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and "_model_name_or_path" not in config
    assert config["rms_norm_eps"] == 1e-05 and config["dtype"] == "float32"
    assert config["tie_word_embeddings"] is tie and config["architectures"] == ["LlamaForCausalLM"]
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(reloaded).__name__ == "LlamaForCausalLM"
    assert getattr(reloaded.config, "quantization_config", None) is None
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=tokens).logits, model(input_ids=tokens).logits)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template and tokenizer.eos_token == "</s>"


def test_rebuild_is_strict(tmp_path):
    smollm2 = _script("smollm2")
    model = _tiny_llama(tie=True)
    model.config.num_hidden_layers = 1  # the config no longer describes the weights: layer 1 is unexpected
    with pytest.raises(RuntimeError, match="Unexpected key"):
        smollm2.write_plain_folder(model, None, tmp_path / "plain")
    assert not (tmp_path / "plain").exists()


def test_loongtrain_importer_accepts_the_rebuilt_folder(tmp_path):
    smollm2 = _script("smollm2")
    from loongtrain.hf.load import inspect_folder

    out = smollm2.write_plain_folder(_tiny_llama(tie=True), None, tmp_path / "plain")
    cfg, _ = inspect_folder(out)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.tie_embeddings) == (32, 2, 4, 2, True)
