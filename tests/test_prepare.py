"""`loongtrain prepare`: inputs (text, JSONL, Parquet, datasets), chat and prompt/completion
target masks against independent references, tokenizer fingerprints, bad inputs (one line,
exit status 2, nothing left behind), determinism over workers, bounded memory."""

from __future__ import annotations

import json
import os
import random
import struct
import sys
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from loongtrain.cli import main as cli_main
from loongtrain.data import TokenFile, TokenFileError
from loongtrain.data import inputs as inputs_module
from loongtrain.data import prepare as prepare_module
from loongtrain.data import tokens as tokens_module
from loongtrain.data.encode import DocumentEncoder, PrepareError
from loongtrain.data.prepare import LengthStats, ordered_map, prepare
from loongtrain.data.tokenizer import (
    ByteTokenizer,
    check_same_tokenizer,
    folder_tokenizer_fingerprint,
    make_tokenizer,
    tokenizer_fingerprint,
)
from loongtrain.data.tokens import DOC_START, HEADER_BYTES, TARGET

tokenizers = pytest.importorskip("tokenizers")  # a dev dependency: installed by scripts/setup.sh

SMOL_TEMPLATE = (  # SmolLM2-135M-Instruct's chat template, verbatim
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (  # Meta-Llama-3-8B-Instruct's chat template, verbatim
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
GENERATION_TEMPLATE = (  # ChatML whose assistant output is marked with {% generation %}
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LOOKAHEAD_TEMPLATE = (  # marks the last message: a prefix of the conversation renders differently
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if loop.last %} END{% endif %}\n{% endfor %}"
)

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<s>", "</s>"]  # fmt: skip
WORDS = ("system user assistant tool the cat sat on mat a dog ran far why how what is it yes no maybe "
         "You are helpful AI named SmolLM , trained by Hugging Face . ! ? 1 2 3 ok fine done").split()  # fmt: skip
SPACES = ["\n", " ", "\n\n", "  ", " \n"]  # whitespace is tokens too: a mask must not take the turn's newline
VOCAB = {w: i for i, w in enumerate(["<unk>", *SPECIALS, *SPACES, *dict.fromkeys(WORDS)])}


def word_level(post: str | None = None):
    """A word-level tokenizer over WORDS with SPECIALS as special tokens; ``post``: a
    post-processor template such as ``"<s> $A"``."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s+|\w+|[^\w\s]+"), behavior="isolated")
    tok.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    if post:
        tok.post_processor = processors.TemplateProcessing(
            single=post, special_tokens=[(s, VOCAB[s]) for s in ("<s>", "</s>", "<|begin_of_text|>") if s in post]
        )
    return tok


def hf_folder(folder: Path, template: str | None, bos: str, eos: str, post: str | None = None,
              in_config: bool = False) -> Path:  # fmt: skip
    """A local HF tokenizer folder; the chat template in chat_template.jinja, or in
    tokenizer_config.json with ``in_config``."""
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=word_level(post), unk_token="<unk>", bos_token=bos, eos_token=eos
    )
    fast.save_pretrained(folder)
    if template is not None:
        if in_config:
            config = json.loads((folder / "tokenizer_config.json").read_text())
            config["chat_template"] = template
            (folder / "tokenizer_config.json").write_text(json.dumps(config))
        else:
            (folder / "chat_template.jinja").write_text(template)
    return folder


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice([" ", " ", "\n", "  "]) for _ in range(n)).strip()


def random_conversation(rng: random.Random) -> list[dict]:
    msgs = [{"role": "system", "content": random_text(rng, 4)}] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        msgs.append({"role": "user", "content": random_text(rng, rng.randint(1, 6))})
        reply = random_text(rng, rng.randint(0, 8))
        if reply and rng.random() < 0.3:
            reply += " \n"  # trailing whitespace (a leading one would merge with the header's newline)
        msgs.append({"role": "assistant", "content": reply})
        if rng.random() < 0.3:
            msgs.append({"role": "tool", "content": random_text(rng, 2)})
            msgs.append({"role": "assistant", "content": random_text(rng, 3)})
    return msgs


def reference_mask(ids: list[int], header: list[int], eot: int, messages: list[dict], trim: bool) -> list[bool]:
    """Targets found from the ids alone: after each assistant header, the assistant content's
    own tokens (word-level: context-free; ``trim``: as the template trims it) and the
    end-of-turn token."""
    plain = word_level()
    assistants = [m for m in messages if m["role"] == "assistant"]
    heads = [p for p in range(len(ids) - len(header) + 1) if ids[p : p + len(header)] == header]
    assert len(heads) == len(assistants)
    mask = [False] * len(ids)
    for p, m in zip(heads, assistants):
        body = plain.encode(m["content"].strip() if trim else m["content"], add_special_tokens=False).ids
        start = p + len(header)
        assert ids[start : start + len(body)] == body and ids[start + len(body)] == eot
        mask[start : start + len(body) + 1] = [True] * (len(body) + 1)
    return mask


def documents(path: Path) -> list[tuple[list[int], list[bool]]]:
    """(ids, targets) of each document of a token file, split at its DOC_START flags."""
    f = TokenFile(path)
    ids, flags = np.asarray(f.tokens).tolist(), np.asarray(f.flags)
    starts = np.flatnonzero(flags & DOC_START).tolist() + [f.count]
    assert starts[0] == 0
    return [(ids[a:b], ((flags[a:b] & TARGET) > 0).tolist()) for a, b in zip(starts, starts[1:])]


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    "template, header, eot, in_config",
    [
        (SMOL_TEMPLATE, ["<|im_start|>", "assistant", "\n"], "<|im_end|>", False),
        (LLAMA3_TEMPLATE, ["<|start_header_id|>", "assistant", "<|end_header_id|>", "\n\n"], "<|eot_id|>", True),
        (GENERATION_TEMPLATE, ["<|im_start|>", "assistant", "\n"], "<|im_end|>", False),
    ],
    ids=["smollm2", "llama3", "generation-marks"],
)
def test_chat_targets_are_the_assistant_turns(tmp_path, template, header, eot, in_config):
    llama = "eot_id" in eot
    bos, eos = ("<|begin_of_text|>", "<|eot_id|>") if llama else ("<|im_start|>", "<|im_end|>")
    post = "<|begin_of_text|> $A" if llama else None  # Llama-3 adds BOS in its post-processor too
    folder = hf_folder(tmp_path / "tok", template, bos, eos, post=post, in_config=in_config)
    rng = random.Random(0)
    convs = [random_conversation(rng) for _ in range(40)]
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in convs])
    prepare([str(tmp_path / "chat.jsonl")], str(tmp_path / "out.tok"), str(folder))
    docs = documents(tmp_path / "out.tok")
    assert len(docs) == len(convs)
    hf = make_tokenizer(str(folder))._tok
    for conv, (ids, targets) in zip(convs, docs):
        assert ids == hf.apply_chat_template(conv, tokenize=True, return_dict=False)  # the template decides
        assert targets == reference_mask(ids, [VOCAB[h] for h in header], VOCAB[eot], conv, trim=llama)
        if llama:
            assert ids[0] == VOCAB["<|begin_of_text|>"] and ids[1] != ids[0]  # one BOS, not two


def test_a_template_that_looks_ahead_is_refused(tmp_path):
    folder = hf_folder(tmp_path / "tok", LOOKAHEAD_TEMPLATE, "<s>", "</s>")
    conv = [{"role": "user", "content": "why"}, {"role": "assistant", "content": "yes"}] * 2
    with pytest.raises(PrepareError, match=r"c.jsonl line 1: the chat template renders messages\[:1\] differently"):
        prepare([str(write_jsonl(tmp_path / "c.jsonl", [{"messages": conv}]))], str(tmp_path / "o.tok"), str(folder))
    assert not list(tmp_path.glob("*.tok*")) and not list(tmp_path.glob(".o.tok*"))


@pytest.mark.parametrize("post", ["<s> $A", "<s> $A </s>", None])
def test_text_and_prompt_completion_follow_the_post_processor(tmp_path, post):
    transformers = pytest.importorskip("transformers")
    folder = hf_folder(tmp_path / "tok", None, "<s>", "</s>", post=post)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    eos = VOCAB["</s>"]
    rng = random.Random(1)
    texts = [random_text(rng, rng.randint(1, 20)) for _ in range(10)]
    pairs = [(random_text(rng, 5), random_text(rng, rng.randint(1, 5))) for _ in range(10)]
    write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "completion": c} for p, c in pairs])
    prepare([str(tmp_path / "t.jsonl"), str(tmp_path / "p.jsonl")], str(tmp_path / "o.tok"), str(folder))
    docs = documents(tmp_path / "o.tok")
    for text, (ids, targets) in zip(texts, docs[:10]):
        expected = hf(text, add_special_tokens=True)["input_ids"]
        expected += [] if expected[-1] == eos else [eos]  # every document ends with EOS
        assert ids == expected and all(targets)
    for (prompt, completion), (ids, targets) in zip(pairs, docs[10:]):
        head = hf(prompt, add_special_tokens=True)["input_ids"]
        if post and post.endswith("</s>"):
            head = head[:-1]  # the suffix goes after the completion
        tail = hf(completion, add_special_tokens=False)["input_ids"] + [eos]
        assert ids == head + tail
        assert targets == [False] * len(head) + [True] * len(tail)


def test_byte_tokenizer_records_and_summary(tmp_path):
    rng = random.Random(2)
    texts = ["x" * rng.randint(1, 300) for _ in range(200)] + [""]
    write_jsonl(tmp_path / "a.jsonl", [{"text": t, "id": i} for i, t in enumerate(texts)])
    info = prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "o.tok"), seq_len=100)
    lengths = np.array([len(t) + 1 for t in texts if t])  # bytes + EOS
    assert [ids for ids, _ in documents(tmp_path / "o.tok")] == [list(t.encode()) + [256] for t in texts if t]
    assert info["documents"] == 200 and info["tokens"] == lengths.sum() == info["targets"]
    assert info["empty_skipped"] == 1
    assert info["length_max"] == lengths.max()
    assert info["length_p50"] == np.percentile(lengths, 50, method="inverted_cdf")
    assert info["length_p99"] == np.percentile(lengths, 99, method="inverted_cdf")
    assert (info["longer_documents"], info["longer_tokens"]) == ((lengths > 100).sum(), lengths[lengths > 100].sum())
    f = TokenFile(tmp_path / "o.tok")
    assert f.tokenizer_fingerprint == ByteTokenizer().fingerprint and f.eos == 256


def test_length_stats_match_numpy_beyond_the_histogram():
    rng = np.random.default_rng(3)
    lengths = np.concatenate([rng.integers(1, 5000, 1000), rng.integers(65_000, 300_000, 30)])
    stats = LengthStats()
    for part in np.array_split(lengths, 7):
        stats.add(part)
    for q in (0.5, 0.97, 0.99, 1.0):
        assert stats.quantile(q) == np.percentile(lengths, 100 * q, method="inverted_cdf")
    assert stats.max == lengths.max() and stats.documents == lengths.size
    for n in (10, 4000, 70_000):
        assert stats.longer_than(n) == ((lengths > n).sum(), lengths[lengths > n].sum())


def test_parquet_and_datasets_give_the_jsonl_file(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    folder = hf_folder(tmp_path / "tok", SMOL_TEMPLATE, "<|im_start|>", "<|im_end|>")
    rng = random.Random(4)
    records = [{"messages": random_conversation(rng), "n": i} for i in range(30)]
    for r in records:  # a fixed schema for the table: every message has role and content only
        r["messages"] = [{"role": m["role"], "content": m["content"]} for m in r["messages"]]
    prepare([str(write_jsonl(tmp_path / "c.jsonl", records))], str(tmp_path / "j.tok"), str(folder))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "c.parquet", row_group_size=7)
    prepare([str(tmp_path / "c.parquet")], str(tmp_path / "p.tok"), str(folder))
    assert (tmp_path / "p.tok").read_bytes() == (tmp_path / "j.tok").read_bytes()
    datasets = pytest.importorskip("datasets", reason="the optional `datasets` package is not installed")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "ds"))
    prepare([str(tmp_path / "ds")], str(tmp_path / "d.tok"), str(folder))
    assert (tmp_path / "d.tok").read_bytes() == (tmp_path / "j.tok").read_bytes()
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(PrepareError, match=r"dd holds several splits \(train\); pass one split's folder"):
        prepare([str(tmp_path / "dd")], str(tmp_path / "dd.tok"), str(folder))


def test_text_files_in_pieces_tokenize_as_a_whole(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = Path(inputs_module.__file__).read_text() * 3  # real text with code indentation and blank lines
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([corpus], trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text(corpus)
    monkeypatch.setattr(inputs_module, "TEXT_PIECE", 700)  # many pieces
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "o.tok"), str(tmp_path / "tokenizer.json"))
    f = TokenFile(tmp_path / "o.tok")
    assert np.asarray(f.tokens).tolist() == tok.encode(corpus).ids + [tok.token_to_id("</s>")]
    assert np.flatnonzero(np.asarray(f.flags) & DOC_START).tolist() == [0]


def test_pieces_without_line_breaks_cut_between_characters(tmp_path, monkeypatch):
    text = "é€x" * 500 + "\n" + "ab\n" * 40  # no clean break in the first 3000 bytes
    (tmp_path / "a.txt").write_text(text)
    monkeypatch.setattr(inputs_module, "TEXT_PIECE", 16)
    monkeypatch.setattr(inputs_module, "TEXT_PIECE_MAX", 64)
    pieces = list(inputs_module.text_tasks(inputs_module.Input(tmp_path / "a.txt", "text", len(text))))
    assert len(pieces) > 20 and b"".join(p.data for p in pieces) == text.encode()
    assert [p.first for p in pieces].count(True) == 1 and pieces[-1].last
    assert all(p.offset == sum(len(q.data) for q in pieces[:i]) for i, p in enumerate(pieces))
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "o.tok"))
    assert np.asarray(TokenFile(tmp_path / "o.tok").tokens).tolist() == list(text.encode()) + [256]


def test_folders_are_searched_for_every_input_kind(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.md").write_text("bee")
    write_jsonl(tmp_path / "d" / "sub" / "a.jsonl", [{"text": "ay"}])
    pq.write_table(pa.table({"text": ["sea"]}), tmp_path / "d" / "c.parquet")
    (tmp_path / "d" / "image.png").write_bytes(b"\x89PNG\0")
    (tmp_path / "d" / "ds").mkdir()  # looks like a datasets folder: read as one, not as its .json files
    (tmp_path / "d" / "ds" / "state.json").write_text("{}")
    (tmp_path / "d" / "ds" / "dataset_info.json").write_text("{}")
    found = inputs_module.discover([str(tmp_path / "d")])
    assert [(i.path.relative_to(tmp_path / "d").as_posix(), i.kind) for i in found] == [
        ("b.md", "text"), ("c.parquet", "parquet"), ("ds", "dataset"), ("sub/a.jsonl", "jsonl"),
    ]  # fmt: skip
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(PrepareError, match=r"ds is a Hugging Face datasets folder; reading it needs the `datasets`"):
        prepare([str(tmp_path / "d")], str(tmp_path / "o.tok"))
    (tmp_path / "d" / "ds" / "state.json").unlink()
    (tmp_path / "d" / "ds" / "dataset_info.json").unlink()
    prepare([str(tmp_path / "d")], str(tmp_path / "o.tok"))
    assert [ids for ids, _ in documents(tmp_path / "o.tok")] == [[*s.encode(), 256] for s in ("bee", "sea", "ay")]


# --- bad inputs: one line, exit status 2, nothing left behind -----------------------------

CHAT = [{"role": "user", "content": "why"}, {"role": "assistant", "content": "yes"}]


def _bad_cases(tmp: Path) -> list[tuple[list[str], str]]:
    (tmp / "bin.txt").write_bytes(b"hello\nworld\x00\x01\x02")
    (tmp / "latin1.txt").write_bytes("line one\nligne deux: \xe9t\xe9\n".encode("latin-1"))
    (tmp / "empty.txt").write_bytes(b"")
    (tmp / "empty.jsonl").write_text("\n\n")
    (tmp / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    write_jsonl(tmp / "obj.jsonl", [{"text": "a"}, [1, 2]])
    (tmp / "malformed.jsonl").write_text('{"text": "a"}\n{"text": "b",}\n')
    write_jsonl(tmp / "missing.jsonl", [{"text": "a"}, {"txt": "b"}])
    write_jsonl(tmp / "number.jsonl", [{"text": "a"}, {"text": 3}])
    write_jsonl(tmp / "role.jsonl", [{"messages": CHAT}, {"messages": [{"role": "human", "content": "hi"}, *CHAT]}])
    write_jsonl(tmp / "noconv.jsonl", [{"messages": []}])
    write_jsonl(tmp / "content.jsonl", [{"messages": [CHAT[0], {"role": "assistant", "content": ["yes"]}]}])
    write_jsonl(tmp / "noassistant.jsonl", [{"messages": CHAT[:1]}])
    write_jsonl(tmp / "nofield.jsonl", [{"body": "a"}])
    write_jsonl(tmp / "completion.jsonl", [{"prompt": "a", "completion": ""}])
    tok = str(hf_folder(tmp / "tok", SMOL_TEMPLATE, "<|im_start|>", "<|im_end|>"))
    replace = "--errors replace decodes it with U+FFFD"
    template = "chat messages need a chat template"
    return [
        (["bin.txt"], "bin.txt: binary data (a NUL byte at byte offset 11, line 2), not text; "
                      "--errors replace reads it anyway"),
        (["latin1.txt"], f"latin1.txt: not UTF-8 at byte offset 21 (line 2): invalid continuation byte; {replace}"),
        (["empty.txt"], "empty.txt: empty file"),
        (["empty.jsonl"], "empty.jsonl: no records (the file is empty)"),
        (["latin1.jsonl"], f"latin1.jsonl: not UTF-8 at byte offset 28 (line 2): invalid continuation byte; {replace}"),
        (["obj.jsonl"], "obj.jsonl line 2: the record is a list, not an object with fields"),
        (["malformed.jsonl"], "malformed.jsonl line 2: malformed JSON: Expecting property name enclosed in double "
                              "quotes at column 14"),
        (["missing.jsonl"], "missing.jsonl line 2: no field 'text' (it has: txt)"),
        (["number.jsonl"], "number.jsonl line 2: field 'text' is a number, not a string"),
        (["role.jsonl", "--tokenizer", tok], "role.jsonl line 2: messages[0] has role 'human'; expected one of "
                                             "system, user, assistant, tool"),
        (["noconv.jsonl", "--tokenizer", tok], "noconv.jsonl line 1: empty conversation (field 'messages' is [])"),
        (["content.jsonl", "--tokenizer", tok], "content.jsonl line 1: messages[1] (assistant) content is a list, "
                                                "not a string"),
        (["noassistant.jsonl", "--tokenizer", tok], "noassistant.jsonl line 1: the conversation has no assistant "
                                                    "message (nothing to train on)"),
        (["role.jsonl"], f"role.jsonl: {template}, and the byte tokenizer has none; use a Hugging Face tokenizer "
                         "folder with chat_template in tokenizer_config.json or chat_template.jinja"),
        (["role.jsonl", "--tokenizer", f"{tok}/tokenizer.json"],
         f"role.jsonl: {template}, and tokenizer {tok}/tokenizer.json has none; pass the tokenizer's folder, not "
         "its tokenizer.json"),
        (["nofield.jsonl"], "nofield.jsonl line 1: no 'text', 'messages' or 'prompt'+'completion' field (it has: "
                            "body); name one with --field"),
        (["nofield.jsonl", "--field", "text"], "nofield.jsonl line 1: no field 'text' (it has: body)"),
        (["completion.jsonl"], "completion.jsonl line 1: empty completion (field 'completion' is ''): nothing to "
                               "train on"),
        (["latin1.txt", "--field", "text"], "latin1.txt: a text file is one document with no fields; --field "
                                            "applies to .jsonl, .parquet and datasets inputs"),
        (["nothere.txt"], "input 'nothere.txt' is neither a file nor a folder"),
    ]  # fmt: skip


def test_bad_inputs_say_one_line_and_leave_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.tok").write_bytes(b"previous contents")
    for args, message in _bad_cases(tmp_path):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["prepare", *args, "-o", "out/old.tok", "--workers", "1"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, (args, err)
        assert err == f"loongtrain prepare: {message}\n", args
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["old.tok"], args
        assert (tmp_path / "out" / "old.tok").read_bytes() == b"previous contents"
    cli_main(["prepare", "latin1.txt", "-o", "out/r.tok", "--errors", "replace", "--workers", "1"])
    assert "\ufffd" in bytes(np.asarray(TokenFile("out/r.tok").tokens)[:-1].astype(np.uint8)).decode()


def test_parquet_errors_name_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "t.parquet")
    with pytest.raises(PrepareError, match=r"^\S+t.parquet row 1: field 'text' is null, not a string$"):
        prepare([str(tmp_path / "t.parquet")], str(tmp_path / "o.tok"))
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "b.parquet")
    with pytest.raises(PrepareError, match=r"b.parquet: no field 'text' \(it has: body\)"):
        prepare([str(tmp_path / "b.parquet")], str(tmp_path / "o.tok"), field="text")
    (tmp_path / "x.parquet").write_bytes(b"not parquet")
    with pytest.raises(PrepareError, match="x.parquet: not a readable Parquet file"):
        prepare([str(tmp_path / "x.parquet")], str(tmp_path / "o.tok"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.parquet", "t.parquet", "x.parquet"]


def test_interrupt_leaves_nothing_behind(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "x" * 1000}] * 3000)  # several tasks
    calls = []
    real = prepare_module.encode_task

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(prepare_module, "encode_task", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "o.tok"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]


# --- tokenizer identity ----------------------------------------------------------------------


def test_fingerprints_identify_the_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    base = hf_folder(tmp_path / "base", SMOL_TEMPLATE, "<|im_start|>", "<|im_end|>")
    fp = folder_tokenizer_fingerprint(base)
    assert fp == make_tokenizer(str(base)).fingerprint  # transformers' view of the folder
    assert fp == folder_tokenizer_fingerprint(base / "tokenizer.json")  # the file, BOS/EOS from its folder
    assert fp == make_tokenizer(str(base / "tokenizer.json")).fingerprint
    assert fp == tokenizer_fingerprint(transformers.AutoTokenizer.from_pretrained(base))
    assert fp == folder_tokenizer_fingerprint(hf_folder(tmp_path / "again", None, "<|im_start|>", "<|im_end|>"))

    other_eos = hf_folder(tmp_path / "eos", None, "<|im_start|>", "</s>")
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    spec = json.loads((base / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["cat"], vocab["dog"] = vocab["dog"], vocab["cat"]  # same words and size, two ids exchanged
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    (swapped / "tokenizer_config.json").write_text((base / "tokenizer_config.json").read_text())
    extra = transformers.AutoTokenizer.from_pretrained(base)
    extra.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    extra.save_pretrained(tmp_path / "extra")
    others = [folder_tokenizer_fingerprint(p) for p in (other_eos, swapped, tmp_path / "extra")]
    assert len({fp, *others, ByteTokenizer().fingerprint}) == 5
    assert ByteTokenizer().fingerprint == 0xCC8BEC40C96B601E  # stable across versions: files record it

    write_jsonl(tmp_path / "a.jsonl", [{"text": "the cat"}])
    prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "a.tok"), str(base))
    assert TokenFile(tmp_path / "a.tok").tokenizer_fingerprint == fp
    check_same_tokenizer(tmp_path / "a.tok", base)
    check_same_tokenizer(TokenFile(tmp_path / "a.tok"), make_tokenizer(str(base)))
    with pytest.raises(TokenFileError) as e:
        check_same_tokenizer(tmp_path / "a.tok", swapped)
    assert str(e.value) == (
        f"{tmp_path / 'a.tok'} was made with another tokenizer than {swapped}: the file's has fingerprint "
        f"{fp:016x}, vocabulary {len(VOCAB)}, eos 2, {swapped}'s has fingerprint {others[1]:016x}, vocabulary "
        f"{len(VOCAB)}, eos 2; re-create the file with `loongtrain prepare --tokenizer {swapped}`"
    )
    with pytest.raises(TokenFileError, match="vocabulary 257, eos 256"):
        check_same_tokenizer(tmp_path / "a.tok", "bytes")
    old = tmp_path / "old.tok"  # a version 1 file records no fingerprint: nothing to check
    old.write_bytes(struct.pack("<8sIIQQQ", b"LOONGTOK", 1, 2, 3, 257, 0).ljust(HEADER_BYTES, b"\0") + b"\1\0" * 3)
    assert TokenFile(old).tokenizer_fingerprint is None
    check_same_tokenizer(old, swapped)


# --- determinism and memory ------------------------------------------------------------------


def test_ordered_map_keeps_input_order_and_bounds_work_in_flight():
    in_flight, peak, lock = [0], [0], threading.Lock()

    def slow(i):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        time.sleep(random.Random(i).random() * 0.004)
        with lock:
            in_flight[0] -= 1
        if i == 57:
            raise PrepareError("item 57")
        return i * i

    def items(n, fail_at=None):
        for i in range(n):
            if i == fail_at:
                raise PrepareError("producing item 80")
            yield i

    with ThreadPoolExecutor(4) as pool:
        assert list(ordered_map(slow, items(50), pool, 6)) == [i * i for i in range(50)]
        assert peak[0] <= 6
        got = []
        with pytest.raises(PrepareError, match="^item 57$"):  # the earlier error wins, as in order
            for r in ordered_map(slow, items(100, fail_at=80), pool, 30):
                got.append(r)
        assert got == [i * i for i in range(57)]


@pytest.mark.e2e
def test_two_worker_processes_write_the_same_file(tmp_path):
    folder = hf_folder(tmp_path / "tok", SMOL_TEMPLATE, "<|im_start|>", "<|im_end|>")
    rng = random.Random(5)
    write_jsonl(tmp_path / "c.jsonl", [{"messages": random_conversation(rng)} for _ in range(3000)])
    write_jsonl(tmp_path / "t.jsonl", [{"text": random_text(rng, 50)} for _ in range(3000)])
    args = [str(tmp_path / "c.jsonl"), str(tmp_path / "t.jsonl")]
    one = prepare(args, str(tmp_path / "one.tok"), str(folder), workers=1)
    two = prepare(args, str(tmp_path / "two.tok"), str(folder), workers=2)
    assert one["tokens"] == two["tokens"] > 0
    assert (tmp_path / "one.tok").read_bytes() == (tmp_path / "two.tok").read_bytes()


def _peak_bytes(tmp_path: Path, records: int) -> tuple[int, int]:
    """Peak traced memory of preparing ``records`` JSONL records, and the tokens written."""
    rng = random.Random(6)
    path = tmp_path / f"{records}.jsonl"
    with open(path, "w") as f:
        for _ in range(records):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(150))}) + "\n")
    tracemalloc.start()
    try:
        tokens = prepare([str(path)], str(tmp_path / "o.tok"))["tokens"]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak, tokens


def test_prepare_memory_does_not_grow_with_the_input(tmp_path, monkeypatch):
    monkeypatch.setattr(inputs_module, "TASK_BYTES", 1 << 17)  # small tasks and buffers: a small test
    monkeypatch.setattr(tokens_module, "COPY_CHUNK", 1 << 16)
    small, small_tokens = _peak_bytes(tmp_path, 1000)
    large, large_tokens = _peak_bytes(tmp_path, 8000)
    assert large_tokens > 7 * small_tokens
    assert large < 1.2 * small + (1 << 20), (small, large)  # flat, not 8x
    assert large < large_tokens * 5 / 4  # a fraction of holding all ids (4 B) and flags (1 B)


def test_document_encoder_needs_no_template_for_text():
    enc = DocumentEncoder(ByteTokenizer())
    ids, targets = enc.prompt_completion("ab", "c")
    assert ids.tolist() == [97, 98, 99, 256] and targets.tolist() == [False, False, True, True]


def test_default_workers_follow_cores_and_input_size():
    most = max(1, min(4, len(os.sched_getaffinity(0))))
    assert prepare_module.default_workers() == most
    assert prepare_module.default_workers(0) == 1  # small inputs: no processes to start
    assert prepare_module.default_workers(2 * prepare_module.WORKER_BYTES) == min(most, 2)
    assert prepare_module.default_workers(1 << 40) == most
