"""The pieces of ``scripts/smollm2.py`` and ``scripts/make_chat_data.py`` that need neither
the 93 MB wheel nor a network: the conversion's rebuild-and-save step on a tiny random
Llama, and the chat-data generator on small Python sources."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _script(name: str):
    """``scripts/<name>.py`` as a module (registered in sys.modules, which its dataclasses need)."""
    key = f"loongtrain_scripts_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, REPO / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


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
    from loongtrain.hf.load import read_folder

    out = smollm2.write_plain_folder(_tiny_llama(tie=True), None, tmp_path / "plain")
    cfg = read_folder(out).model
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.tie_embeddings) == (32, 2, 4, 2, True)


# --- scripts/make_chat_data.py: long-context retrieval chats from Python sources ---------------------------------

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SHORT = dict(min_tokens=600, max_tokens=2048)

SAMPLE = '''"""A sample module."""
import os

LIMIT = 10
TWICE = 1
TWICE = 2
lower = 3
LONG = (1,
        2)


def plain(a, b=1):
    """Add ``a`` and ``b``, plainly."""
    return a + b


def wrapped(a,
            b):
    """Escaped\\ttab first line."""


class Box:
    """A box of things."""

    def __init__(self, size):
        self.size = size

    @property
    def size(self):
        """The size."""

    @size.setter
    def size(self, value):
        pass


if os.name == "nt":
    def platform():
        pass
else:
    def platform():
        pass'''


@pytest.fixture(scope="module")
def chat():
    return _script("make_chat_data")


def _answer(record: dict) -> str:
    return record["completion"] if "completion" in record else record["messages"][-1]["content"]


def _files_in(record: dict) -> list[str]:
    text = record["prompt"] if "prompt" in record else record["messages"][1]["content"]
    return re.findall(r"^=== File \d+ of \d+: ([^,=]+?)(?:, lines \d+-\d+ of \d+)? ===$", text, flags=re.M)


def test_questions_of_a_module(chat, tmp_path):
    (tmp_path / "sample.py").write_text(SAMPLE)
    module = chat.parse_module(tmp_path, "sample.py")
    got = {(q.kind, q.name): q.answer for q in module.questions}
    assert got == {
        ("constant", "LIMIT"): "LIMIT = 10",  # TWICE (assigned twice), lower, LONG (two lines) are not asked
        ("signature", "plain"): "def plain(a, b=1):",
        ("docstring", "plain"): "Add ``a`` and ``b``, plainly.",  # wrapped: signature on two lines, escaped doc
        ("docstring", "Box"): "A box of things.",
        ("signature", "Box.__init__"): "def __init__(self, size):",  # size: getter and setter, ambiguous
    }  # platform: defined twice
    # the blocks are the top-level statements, covering the file; every question's block holds its answer
    assert module.blocks[0][0] == 0 and module.blocks[-1][1] == len(module.lines)
    assert all(a[1] == b[0] for a, b in zip(module.blocks, module.blocks[1:]))
    for q in module.questions:
        assert q.answer in module.text(q.block, q.block + 1)


def test_records_are_valid_chats_with_verbatim_answers(chat, tmp_path):
    counter = chat.TokenCounter(None)
    records = chat.generate(STDLIB, "train", 12, seed=0, counter=counter, **SHORT)
    out = tmp_path / "train.jsonl"
    chat.write_jsonl(records, out, keep_meta=False)
    lines = out.read_text().splitlines()
    assert len(lines) == 12 and not (tmp_path / "train.jsonl.partial").exists()
    for line, record in zip(lines, records):
        written = json.loads(line)
        assert set(written) == {"messages"}
        roles = [m["role"] for m in written["messages"]]
        assert roles == ["system", "user", "assistant"]
        assert all(isinstance(m["content"], str) and m["content"] for m in written["messages"])
        user, answer = written["messages"][1]["content"], written["messages"][2]["content"]
        assert answer in user and "\n" not in answer and len(answer) <= chat.MAX_ANSWER_CHARS
        assert record["meta"]["file"] in _files_in(record) and _files_in(record) == record["meta"]["files"]
        assert SHORT["min_tokens"] <= counter.record(written) == record["meta"]["tokens"] <= SHORT["max_tokens"]
    assert {r["meta"]["kind"] for r in records} == set(chat.KINDS)


def test_train_and_eval_modules_are_disjoint(chat):
    paths = chat.source_files(STDLIB)
    splits = {p: chat.split_of(p) for p in paths}
    assert 0 < sum(s == "eval" for s in splits.values()) < len(paths) / 5
    assert not any(part in chat.SKIPPED_DIRS for p in paths for part in p.split("/")[:-1])
    counter = chat.TokenCounter(None)
    used = {}
    for split, seed in (("train", 0), ("eval", 0), ("eval", 1)):
        records = chat.generate(STDLIB, split, 8, seed=seed, counter=counter, **SHORT)
        files = {f for r in records for f in _files_in(r)}
        assert files and all(splits[f] == split for f in files)
        used.setdefault(split, set()).update(files)
    assert not used["train"] & used["eval"]


def test_deterministic_by_seed(chat, tmp_path):
    counter = chat.TokenCounter(None)

    def written(seed: int, fmt: bool = False) -> str:
        out = tmp_path / f"{seed}-{fmt}.jsonl"
        records = chat.generate(STDLIB, "train", 6, seed=seed, counter=counter, prompt_completion=fmt, **SHORT)
        chat.write_jsonl(records, out, keep_meta=True)
        return out.read_text()

    assert written(3) == written(3)
    assert written(3) != written(4)
    # the prompt-completion variant holds the same records
    chats = [json.loads(line) for line in written(3).splitlines()]
    pcs = [json.loads(line) for line in written(3, fmt=True).splitlines()]
    for c, pc in zip(chats, pcs):
        assert set(pc) == {"prompt", "completion", "meta"}
        assert pc["prompt"] == f"{c['messages'][0]['content']}\n\n{c['messages'][1]['content']}"
        assert pc["completion"] == _answer(c) and pc["completion"] in pc["prompt"]


def test_lengths_measured_by_a_tokenizer(chat, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    sources = [(STDLIB / p).read_text() for p in ("json/decoder.py", "textwrap.py", "bisect.py")]
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(sources, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))

    counter = chat.TokenCounter(str(path))
    records = chat.generate(STDLIB, "eval", 6, min_tokens=1500, max_tokens=3000, seed=0, counter=counter)
    for r in records:
        ids = [len(tok.encode(m["content"]).ids) for m in r["messages"]]
        assert 1500 <= sum(ids) + 5 * len(ids) == r["meta"]["tokens"] <= 3000


def test_cli_writes_and_reports(chat, tmp_path, capsys):
    out = tmp_path / "short.jsonl"
    chat.main(["-o", str(out), "--count", "5", "--max-tokens", "2048", "--seed", "1", "--format", "prompt-completion"])
    printed = capsys.readouterr().out
    assert "records: 5; tokens (estimated" in printed and "distinct modules" in printed
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 5 and all(set(r) == {"prompt", "completion"} for r in records)
    with pytest.raises(SystemExit, match="--min-tokens <= --max-tokens"):
        chat.main(["-o", str(out), "--min-tokens", "3000", "--max-tokens", "2048"])
