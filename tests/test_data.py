"""Token file format, prepare, the data sources and the stateful loader."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from loongtrain.config import ConfigError, load_config
from loongtrain.data import (
    IGNORE_INDEX,
    BatchLoader,
    LengthGroupedSource,
    Microbatch,
    PackedRecallTask,
    RecallTask,
    TokenFile,
    TokenFileError,
    TokenFileSource,
    write_tokens,
)
from loongtrain.data.batch import pack_rows
from loongtrain.data.prepare import prepare
from loongtrain.data.tokens import HEADER_BYTES
from loongtrain.train.spec import make_source


@pytest.mark.parametrize("vocab, width", [(257, 2), (2**16, 2), (128_256, 4)])
def test_token_file_round_trip(tmp_path, vocab, width):
    tokens = np.random.default_rng(0).integers(0, vocab, size=1000)
    path = tmp_path / "t.tok"
    write_tokens(path, tokens, vocab)
    f = TokenFile(path)
    assert (f.count, f.vocab_size, f.width) == (1000, vocab, width)
    assert np.array_equal(np.asarray(f.tokens), tokens)
    assert path.stat().st_size == HEADER_BYTES + 1000 * width


def test_a_folder_given_as_a_token_file_is_said_to_be_one(tmp_path):
    """A folder where the token file belongs: said (not "does not exist"), with the token files
    in it (found by their header) to choose from."""
    folder = tmp_path / "data"
    folder.mkdir()
    for name in ("train.tok", "val.tok"):
        write_tokens(folder / name, np.arange(10), 16)
    (folder / "notes.txt").write_text("LOONG but no token file")
    with pytest.raises(TokenFileError) as e:
        TokenFile(folder)
    assert str(e.value) == (
        f"token file {str(folder)!r} is a folder, not a token file; give one of the token files in it: train.tok, "
        f"val.tok"
    )
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenFileError, match=r"'.*empty' is a folder, not a token file; give the file `loongtrain "):
        TokenFile(tmp_path / "empty")
    # data.path of source=tokens, refused by preflight before any process starts
    from loongtrain.config import load_config
    from loongtrain.train.preflight import preflight

    cfg = load_config(None, ["data.source=tokens", f"data.path={folder}", f"run.output_dir={tmp_path / 'run'}"])
    with pytest.raises(TokenFileError, match=r"token file '.*data' is a folder, not a token file; give one of"):
        preflight(cfg, 1)


def test_token_file_errors(tmp_path):
    path = tmp_path / "t.tok"
    write_tokens(path, np.arange(100), 300)
    raw = path.read_bytes()
    (tmp_path / "trunc.tok").write_bytes(raw[:-10])
    with pytest.raises(TokenFileError, match="truncated: header says 100 tokens x 2 bytes"):
        TokenFile(tmp_path / "trunc.tok")
    (tmp_path / "long.tok").write_bytes(raw + b"xx")
    with pytest.raises(TokenFileError, match="longer than its header says"):
        TokenFile(tmp_path / "long.tok")
    (tmp_path / "bad.tok").write_bytes(b"NOTATOKENFILE" + raw[13:])
    with pytest.raises(TokenFileError, match="bad header"):
        TokenFile(tmp_path / "bad.tok")
    (tmp_path / "tiny.tok").write_bytes(b"LOONG")
    with pytest.raises(TokenFileError, match="bad header"):
        TokenFile(tmp_path / "tiny.tok")
    with pytest.raises(TokenFileError, match="does not exist"):
        TokenFile(tmp_path / "missing.tok")
    with pytest.raises(TokenFileError, match="token id 99 is beyond the model's vocabulary of 64"):
        TokenFile(path).check_vocab(64)
    TokenFile(path).check_vocab(100)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 10\)"):
        write_tokens(path, np.array([3, 12]), 10)


def test_prepare_bytes(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("héllo")
    (tmp_path / "docs" / "b.md").write_text("ok")
    info = prepare([str(tmp_path / "docs")], str(tmp_path / "out.tok"))
    f = TokenFile(tmp_path / "out.tok")
    expected = list("héllo".encode()) + [256] + list(b"ok") + [256]
    assert info["tokens"] == len(expected) and f.vocab_size == 257
    assert np.asarray(f.tokens).tolist() == expected
    with pytest.raises(FileNotFoundError, match="neither a file nor a folder"):
        prepare([str(tmp_path / "nope")], str(tmp_path / "x.tok"))


def test_token_source_windows(tmp_path):
    write_tokens(tmp_path / "t.tok", np.arange(1001), 2000)
    src = TokenFileSource(TokenFile(tmp_path / "t.tok"), seq_len=10, seed=1)
    assert (src.train_sequences, src.eval_sequences) == (99, 1)
    seen = set()
    for i in range(99):
        tokens, labels = src.sample(i)
        assert torch.equal(labels[:-1], tokens[1:])  # next-token labels
        seen.add(int(tokens[0]))
    assert len(seen) == 99  # one epoch visits every training window once
    assert torch.equal(src.sample(5)[0], src.sample(5)[0])
    ev, _ = src.sample(0, "eval")
    assert int(ev[0]) == 990  # the held-out tail
    with pytest.raises(TokenFileError, match="need at least 2"):
        TokenFileSource(TokenFile(tmp_path / "t.tok"), seq_len=600)


def test_recall_samples_are_answerable():
    task = RecallTask(seq_len=128, keys=8, values=8, facts=4, queries=16, filler=16, seed=3)
    tokens, labels = task.sample(11)
    body = tokens[: 128 - 16]
    facts = body[body >= task.filler]
    assert len(facts) == 4
    table = {int(f - task.filler) // task.values: int(f - task.filler) % task.values for f in facts}
    for t, lab in zip(tokens[-16:], labels[-16:]):
        key = int(t) - task.query0
        assert int(lab) - task.answer0 == table[key]
    assert (labels[:-16] == -100).all()
    assert torch.equal(task.sample(11)[0], tokens) and not torch.equal(task.sample(12)[0], tokens)
    assert not torch.equal(task.sample(11, "eval")[0], tokens)
    assert task.vocab_size == 16 + 64 + 8 + 8 and task.chance == 1 / 8


def test_loader_is_layout_independent_and_resumable():
    task = RecallTask(seq_len=32, queries=4, seed=0)
    single = BatchLoader(task, global_batch=8, micro_batches=2, dp=1, dp_rank=0)
    replicas = [BatchLoader(task, global_batch=8, micro_batches=2, dp=2, dp_rank=d) for d in range(2)]
    for _ in range(3):
        whole = torch.cat([mb.tokens for mb in single.next()])
        parts = [r.next() for r in replicas]
        # microbatch m of replica d holds rows of the same global sample range
        merged = torch.cat([torch.cat([parts[0][m].tokens, parts[1][m].tokens]) for m in range(2)])
        assert torch.equal(torch.sort(whole.sum(1)).values, torch.sort(merged.sum(1)).values)
    resumed = BatchLoader(task, global_batch=8, micro_batches=2, dp=1, dp_rank=0)
    resumed.load_state_dict(single.state_dict())
    assert torch.equal(resumed.next()[0].tokens, single.next()[0].tokens)
    with pytest.raises(ValueError, match="global_batch=6 is not divisible by dp\\*micro_batches = 2\\*2 = 4"):
        BatchLoader(task, global_batch=6, micro_batches=2, dp=2, dp_rank=0)


def test_prepare_with_a_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")  # a dev dependency: installed by scripts/setup.sh
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on the mat"] * 20, trainers.BpeTrainer(special_tokens=["<unk>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("the cat sat")
    info = prepare([str(tmp_path / "a.txt")], str(tmp_path / "out.tok"), str(tmp_path / "tokenizer.json"))
    ids = np.asarray(TokenFile(tmp_path / "out.tok").tokens).tolist()
    assert ids == tok.encode("the cat sat").ids + [tok.token_to_id("</s>")]
    assert info["vocab_size"] == tok.get_vocab_size()


def test_packed_recall_documents_conflict_and_are_scored_on_their_own_facts():
    task = PackedRecallTask(seq_len=256, doc_len=64, keys=4, values=8, facts=3, queries=4, seed=1)
    tokens, labels, cu = task.sample(5)
    bounds = cu.tolist()
    assert bounds[0] == 0 and bounds[-1] == 256 and len(bounds) >= 4
    assert all(32 <= b - a for a, b in zip(bounds, bounds[1:]))
    facts_by_doc = []
    for a, b in zip(bounds, bounds[1:]):
        doc, lab = tokens[a:b], labels[a:b]
        is_fact = (doc >= task.filler) & (doc < task.query0)
        facts = {int(f - task.filler) // task.values: int(f - task.filler) % task.values for f in doc[is_fact]}
        facts_by_doc.append(facts)
        assert len(facts) == 3
        asked = doc[-4:] - task.query0  # the queries end the document and ask its own keys
        assert (labels[a : b - 4] == IGNORE_INDEX).all()
        for key, answer in zip(asked.tolist(), (lab[-4:] - task.answer0).tolist()):
            assert facts[key] == answer
    conflicts = sum(
        1
        for i, x in enumerate(facts_by_doc)
        for y in facts_by_doc[i + 1 :]
        for key in x.keys() & y.keys()
        if x[key] != y[key]
    )
    assert conflicts > 0  # other documents state other values for the same keys


def test_token_windows_split_at_eos_and_ignore_cross_document_targets(tmp_path):
    eos = 9
    stream = np.array([1, 2, eos, 3, 4, 5, eos, 6, eos, 7, 8, 1, 2, 3, eos, 4, 5], dtype=np.int64)
    write_tokens(tmp_path / "t.tok", stream, 10, eos=eos)
    file = TokenFile(tmp_path / "t.tok")
    assert file.eos == eos
    source = TokenFileSource(file, seq_len=8, eos=file.eos)
    tokens, labels, cu = source._sequence(0)  # tokens 1 2 EOS 3 4 5 EOS 6 | next: EOS
    assert tokens.tolist() == [1, 2, eos, 3, 4, 5, eos, 6]
    assert cu.tolist() == [0, 3, 7, 8]
    assert labels.tolist() == [2, eos, -100, 4, 5, eos, -100, eos]
    batch = pack_rows([source._sequence(0), source._sequence(1)])
    assert batch.tokens.shape == (1, 16) and batch.cu_seqlens.tolist() == [0, 3, 7, 8, 9, 15, 16]
    assert batch.positions().tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0, 0, 1, 2, 3, 4, 5, 0]]


def test_old_token_files_have_no_eos_and_packing_asks_for_one(tmp_path):
    write_tokens(tmp_path / "t.tok", np.arange(50) % 7, 7)
    assert TokenFile(tmp_path / "t.tok").eos is None
    with pytest.raises(ConfigError, match="has no per-token flags and records no end-of-document.*set data.eos_id"):
        make_source(load_config(None, ["data.source=tokens", f"data.path={tmp_path / 't.tok'}", "data.pack=true"]))


def test_microbatch_rejects_packed_batches_of_several_rows():
    with pytest.raises(ValueError, match="one row"):
        Microbatch(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long), torch.tensor([0, 8]))


# --- format version 2: flags and the tokenizer fingerprint; version 1 still reads -------------


def test_token_file_v2_byte_layout(tmp_path):
    rng = np.random.default_rng(7)
    ids, flags = rng.integers(0, 70_000, 300), rng.integers(0, 4, 300).astype(np.uint8)
    write_tokens(tmp_path / "t.tok", ids, 70_000, eos=5, flags=flags, fingerprint=0xFEDCBA9876543210)
    raw = (tmp_path / "t.tok").read_bytes()
    assert len(raw) == 64 + 300 * 4 + 300
    magic, version, width, count, vocab, eos1, fp, features = struct.unpack_from("<8sIIQQQQI", raw)
    assert (magic, version, width, count, vocab, eos1, fp, features) == (
        b"LOONGTOK", 2, 4, 300, 70_000, 6, 0xFEDCBA9876543210, 3,
    )  # fmt: skip
    assert raw[52:64] == b"\0" * 12
    assert np.frombuffer(raw[64 : 64 + 1200], "<u4").tolist() == ids.tolist()
    assert list(raw[64 + 1200 :]) == flags.tolist()
    f = TokenFile(tmp_path / "t.tok")
    assert (f.version, f.count, f.eos, f.tokenizer_fingerprint) == (2, 300, 5, 0xFEDCBA9876543210)
    assert np.array_equal(f.tokens, ids) and np.array_equal(f.flags, flags)
    (tmp_path / "short.tok").write_bytes(raw[:-1])
    with pytest.raises(TokenFileError, match=r"truncated: header says 300 tokens x 4 bytes \+ 1 flag byte = 1564"):
        TokenFile(tmp_path / "short.tok")
    write_tokens(tmp_path / "plain.tok", ids, 70_000)  # no flags, no fingerprint
    plain = TokenFile(tmp_path / "plain.tok")
    assert plain.flags is None and plain.tokenizer_fingerprint is None and plain.eos is None
    assert struct.unpack_from("<I", (tmp_path / "plain.tok").read_bytes(), 48)[0] == 0
    with pytest.raises(ValueError, match="flags .* must match the ids"):
        write_tokens(tmp_path / "bad.tok", ids, 70_000, flags=flags[:-1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.tok", "short.tok", "t.tok"]


def _v1_file(path, tokens, vocab, eos):
    """A token file as loongtrain wrote it before version 2 (written here by hand)."""
    header = struct.pack("<8sIIQQQ", b"LOONGTOK", 1, 2, len(tokens), vocab, eos + 1).ljust(64, b"\0")
    path.write_bytes(header + np.asarray(tokens, "<u2").tobytes())


def test_version_1_files_still_read_and_pack_at_eos(tmp_path):
    eos = 9
    stream = [1, 2, eos, 3, 4, 5, eos, 6, eos, 7, 8, 1, 2, 3, eos, 4, 5]
    _v1_file(tmp_path / "v1.tok", stream, 10, eos)
    f = TokenFile(tmp_path / "v1.tok")
    assert (f.version, f.eos, f.flags, f.tokenizer_fingerprint) == (1, eos, None, None)
    assert np.asarray(f.tokens).tolist() == stream
    tokens, labels, cu = TokenFileSource(f, seq_len=8, eos=f.eos)._sequence(0)
    assert cu.tolist() == [0, 3, 7, 8]
    assert labels.tolist() == [2, eos, -100, 4, 5, eos, -100, eos]
    tokens, labels = TokenFileSource(f, seq_len=8)._sequence(0)  # not packed: every label counts
    assert labels.tolist() == stream[1:9]
    assert f.document_starts().tolist() == [0, 3, 7, 9, 15]


def _reference_windows(tokens, flags, eos, seq_len, pack, drop, lengths=(0, None)):
    """Windows by brute force over a Python list: documents, the kept stream (documents of
    ``lengths[0] <= length < lengths[1]``), labels, cu_seqlens."""
    n = len(tokens)
    if flags is not None:
        starts = sorted({0} | {i for i in range(n) if flags[i] & 2})
    else:
        starts = [0] + [i + 1 for i in range(n - 1) if tokens[i] == eos]
    docs = list(zip(starts, starts[1:] + [n]))
    lo, hi = lengths
    docs_in_range = [(a, b) for a, b in docs if b - a >= lo and (hi is None or b - a < hi)]
    kept = [(a, b) for a, b in docs_in_range if not drop or b - a <= seq_len]
    stream = [i for a, b in kept for i in range(a, b)]
    first = {a for a, _ in docs}
    out = []
    for w in range((len(stream) - 1) // seq_len):
        pos = stream[w * seq_len : w * seq_len + seq_len + 1]
        labels = []
        for j in range(seq_len):
            nxt = pos[j + 1]
            target = flags is None or bool(flags[nxt] & 1)
            labels.append(tokens[nxt] if target and not (pack and nxt in first) else -100)
        cu = [0] + [j for j in range(1, seq_len) if pos[j] in first] + [seq_len]
        out.append(([tokens[p] for p in pos[:-1]], labels, cu if pack else None))
    dropped = [(a, b) for a, b in docs_in_range if b - a > seq_len] if drop else []
    return out, len(dropped), sum(b - a for a, b in dropped)


@pytest.mark.parametrize("with_flags", [True, False], ids=["flags", "eos"])
@pytest.mark.parametrize("pack", [True, False], ids=["pack", "nopack"])
@pytest.mark.parametrize("policy", ["split", "drop"])
@pytest.mark.parametrize("lengths", [(0, None), (12, None), (0, 12)], ids=["all", "long", "rest"])
def test_loader_labels_documents_and_long_document_policy(tmp_path, with_flags, pack, policy, lengths):
    rng = np.random.default_rng(8)
    eos, seq_len, parts, flags = 50, 16, [], []
    for _ in range(120):
        length = int(rng.choice([rng.integers(1, 12), rng.integers(12, 40)]))
        doc = rng.integers(0, eos, length)
        doc[-1] = eos
        parts.append(doc)
        f = rng.integers(0, 2, length).astype(np.uint8)  # random targets
        f[0] |= 2
        flags.append(f)
    tokens, flags = np.concatenate(parts), np.concatenate(flags)
    write_tokens(tmp_path / "t.tok", tokens, 64, eos=eos, flags=flags if with_flags else None)
    file = TokenFile(tmp_path / "t.tok")
    # a mixture source's stream of long documents or of the rest: its name does not change its windows
    source = TokenFileSource(file, seq_len, eos=eos if pack else None, long_documents=policy, lengths=lengths,
                             name=None if lengths == (0, None) else "code")  # fmt: skip
    expected, dropped_docs, dropped_tokens = _reference_windows(
        tokens.tolist(), flags.tolist() if with_flags else None, eos, seq_len, pack, policy == "drop", lengths
    )
    assert source.train_sequences + source.eval_sequences + source.untargeted_sequences == len(expected)
    assert (source.dropped_documents, source.dropped_tokens) == (dropped_docs, dropped_tokens)
    if policy == "drop" and lengths != (0, 12):
        assert dropped_docs > 10
    for w, (inputs, labels, cu) in enumerate(expected):
        got = source._sequence(w)
        assert got[0].tolist() == inputs and got[1].tolist() == labels, w
        assert (got[2].tolist() if pack else None) == cu and len(got) == (3 if pack else 2)


def test_drop_needs_documents_and_counts_them_in_the_error(tmp_path):
    write_tokens(tmp_path / "t.tok", np.arange(100) % 7, 7)
    with pytest.raises(TokenFileError, match="no document boundaries .* set data.eos_id"):
        TokenFileSource(TokenFile(tmp_path / "t.tok"), seq_len=8, long_documents="drop")
    write_tokens(tmp_path / "e.tok", np.r_[np.ones(30), 0, np.ones(5), 0], 7, eos=0)
    with pytest.raises(TokenFileError, match="6 tokens after dropping 1 document.* make 0 sequence"):
        TokenFileSource(TokenFile(tmp_path / "e.tok"), seq_len=8, long_documents="drop")
    with pytest.raises(ValueError, match="long_documents='keep'"):
        TokenFileSource(TokenFile(tmp_path / "e.tok"), seq_len=8, long_documents="keep")


def _longest(sample) -> int:
    return int(sample[2].diff().max())


def test_length_grouping_keeps_each_epoch_and_groups_alike_steps(tmp_path):
    eos, seq, gb, window = 9, 16, 4, 3
    gen = np.random.default_rng(0)
    docs = [np.append(gen.integers(0, 9, int(n)), eos) for n in np.exp(gen.normal(1.8, 0.9, 400)).astype(int) + 1]
    write_tokens(tmp_path / "t.tok", np.concatenate(docs), 10, eos=eos)
    plain = TokenFileSource(TokenFile(tmp_path / "t.tok"), seq_len=seq, seed=3, eos=eos)
    grouped = LengthGroupedSource(TokenFileSource(TokenFile(tmp_path / "t.tok"), seq_len=seq, seed=3, eos=eos),
                                  window, gb)  # fmt: skip
    n = plain.train_sequences
    assert n % gb and n > 3 * window * gb  # windows of epoch 2 start off the step grid: partial steps

    def key(sample) -> bytes:
        return sample[0].numpy().tobytes() + sample[2].numpy().tobytes()

    seen = [grouped.sample(i) for i in range(2 * n)]
    for epoch in range(2):  # every sequence exactly once per epoch, as without grouping
        got = sorted(key(s) for s in seen[epoch * n : (epoch + 1) * n])
        assert got == sorted(key(plain.sample(i)) for i in range(epoch * n, (epoch + 1) * n))
    # within each window of one epoch, the loader's steps hold disjoint ranges of longest documents
    for epoch in range(2):
        for lo in range(epoch * n, (epoch + 1) * n, window * gb):
            hi = min(lo + window * gb, (epoch + 1) * n)
            edges = [lo, *range((lo // gb + 1) * gb, hi, gb), hi]
            steps = ([_longest(seen[i]) for i in range(a, b)] for a, b in zip(edges[:-1], edges[1:]))
            ranges = sorted((min(v), max(v)) for v in steps)
            assert all(prev[1] <= cur[0] for prev, cur in zip(ranges, ranges[1:])), ranges
    spread = lambda src: sum(  # noqa: E731
        max(v) - min(v) for v in ([_longest(src(i)) for i in range(k, k + gb)] for k in range(0, n - gb, gb))
    )
    assert spread(lambda i: seen[i]) < spread(plain.sample) / 2
    fresh = LengthGroupedSource(TokenFileSource(TokenFile(tmp_path / "t.tok"), seq_len=seq, seed=3, eos=eos), window,
                                gb)  # fmt: skip
    assert key(fresh.sample(n + 7)) == key(seen[n + 7])  # a function of the index: resumes anywhere
    assert key(grouped.sample(2, "eval")) == key(plain.sample(2, "eval"))
    with pytest.raises(ValueError, match="needs packed documents"):
        LengthGroupedSource(TokenFileSource(TokenFile(tmp_path / "t.tok"), seq_len=seq, pack=False), window, gb)
    with pytest.raises(ConfigError, match="data.group_by_length=2 groups a token file's packed sequences"):
        load_config(None, ["data.group_by_length=2"])
