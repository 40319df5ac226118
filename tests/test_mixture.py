"""Mixtures of token files: which source each sample comes from, per-source length
upsampling, the loader's source ids, the config's [data.sources.NAME] tables and their
refusals, data-inspect, the loader benchmark. Every count of what was drawn is made from
the drawn tokens themselves: each synthetic source writes its documents with token ids of
its own range (long documents of the upsampled source with another), so a token says which
source and which kind of document it came from."""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from loongtrain.config import ConfigError, describe, load_config, to_toml
from loongtrain.data import BatchLoader, Microbatch, MixtureSource, TokenFile, TokenFileError, write_tokens
from loongtrain.data import tokens as tokens_module
from loongtrain.data.batch import pack_rows
from loongtrain.data.loader import TokenFileSource
from loongtrain.data.mixture import Interleaving
from loongtrain.data.recall import sample_seed
from loongtrain.data.tokens import DOC_START, TARGET
from loongtrain.parallel import ParallelConfig
from loongtrain.parallel.layout import RankLayout
from loongtrain.train.cli import split_overrides
from loongtrain.train.data_inspect import inspect_data
from loongtrain.train.data_inspect import main as inspect_main
from loongtrain.train.preflight import preflight
from loongtrain.train.spec import make_source

EOS, VOCAB, SEQ, LONG = 0, 1000, 8192, 4096
#: each source's token ids (documents of at least LONG tokens of "code": CODE_LONG)
IDS = {"code": (1, 100), "books": (200, 300), "short": (300, 400)}
CODE_LONG = (100, 200)
WEIGHTS = {"code": 0.3, "books": 0.3, "short": 0.4}


def write_source(path: Path, tokens: int, ids: tuple[int, int], *, median: int, seed: int, long_ids=None,
                 flags: bool = False, fingerprint: int | None = None) -> np.ndarray:  # fmt: skip
    """Documents of lognormal lengths (median ``median``, sigma 1.2, at least 2 tokens) ending
    in EOS, ids from ``ids`` (``long_ids`` for documents of at least LONG tokens); returns the
    document lengths."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(2, rng.lognormal(np.log(median), 1.2, 4 * tokens // median + 64).astype(np.int64))
    lengths = lengths[: int(np.searchsorted(np.cumsum(lengths), tokens)) + 1]
    doc = np.repeat(np.arange(len(lengths)), lengths)
    out = rng.integers(*ids, doc.size)
    if long_ids is not None:
        long = lengths[doc] >= LONG
        out[long] = rng.integers(*long_ids, int(long.sum()))
    ends = np.cumsum(lengths)
    out[ends - 1] = EOS
    marks = None
    if flags:
        marks = np.full(out.size, TARGET, dtype=np.uint8)
        marks[ends[:-1]] |= DOC_START
        marks[0] |= DOC_START
    write_tokens(path, out, VOCAB, eos=EOS, flags=marks, fingerprint=fingerprint)
    return lengths


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """Three sources of ~1.5M tokens: code (with flags; ~30% of its tokens in documents of at
    least LONG tokens) of median 600-token documents, books of 1,000-token ones, short of 200."""
    folder = tmp_path_factory.mktemp("mix")
    paths = {name: folder / f"{name}.tok" for name in IDS}
    write_source(paths["code"], 1_500_000, IDS["code"], median=600, seed=1, long_ids=CODE_LONG, flags=True)
    write_source(paths["books"], 1_500_000, IDS["books"], median=1000, seed=2)
    write_source(paths["short"], 1_500_000, IDS["short"], median=200, seed=3)
    return paths


def mixture_toml(path: Path, files: dict[str, Path], code_extra: str = "", seq_len: int = SEQ, **data) -> Path:
    text = f'[data]\nsource = "tokens"\nseq_len = {seq_len}\npack = true\nglobal_batch = 8\n'
    text += "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in data.items())
    for name, w in WEIGHTS.items():
        text += f'\n[data.sources.{name}]\npath = "{files[name]}"\nweight = {w}\n'
        text += code_extra if name == "code" else ""
    path.write_text(text)
    return path


UPSAMPLED = f"upsample_length = {LONG}\nupsample_share = 0.5\n"


def token_classes(tokens: np.ndarray) -> np.ndarray:
    """Each token's class from its id: 0 code, 1 code long, 2 books, 3 short; an EOS takes the
    class of the token before it (the document it ends), short at a sequence's start."""
    ranges = [IDS["code"], CODE_LONG, IDS["books"], IDS["short"]]
    cls = np.full(tokens.shape, -1)
    for c, (lo, hi) in enumerate(ranges):
        cls[(tokens >= lo) & (tokens < hi)] = c
    eos = tokens == EOS
    for row in range(tokens.shape[0]):  # an EOS after an EOS (a 2-token document's) gets resolved in turn
        for j in np.flatnonzero(eos[row]):
            cls[row, j] = cls[row, j - 1] if j else 3
    return cls


# --- which source sample i comes from ------------------------------------------------------


@pytest.mark.parametrize("weights", [(0.3, 0.3, 0.4), (0.07, 5.0, 1.3, 2.2, 0.01)])
def test_interleaving_keeps_every_window_at_the_weights(weights):
    mix = Interleaving(weights)
    w = np.asarray(weights) / sum(weights)
    n = 60_000
    parts = mix.parts(0, n)
    onehot = parts[:, None] == np.arange(len(w))
    counts = np.vstack([np.zeros(len(w)), np.cumsum(onehot, axis=0)])
    # after any n samples each part has had w * n draws to within (parts + 1) / 2
    assert np.abs(counts - np.arange(n + 1)[:, None] * w).max() <= (len(w) + 1) / 2
    for start in range(0, n - 1000, 311):  # any window of 1,000 samples: within 0.6 points
        share = (counts[start + 1000] - counts[start]) / 1000
        assert np.abs(share - w).max() < 0.006, (start, share)
    # locate(i) is (part, its running count), a pure function of i: a fresh object, any order
    fresh = Interleaving(weights)
    for i in [59_999, 0, 4095, 4096, 4097, 8191, 12_345, 1, 30_000]:
        d = int(parts[i])
        assert fresh.locate(i) == (d, int(counts[i, d]))
    assert np.array_equal(fresh.counts(n), counts[n])
    far = 10**9 + 7  # far past any run: counts stay exact and consistent with locate
    d, k = fresh.locate(far)
    assert fresh.counts(far)[d] == k and fresh.counts(far + 1)[d] == k + 1
    assert np.abs(fresh.counts(far) - far * w).max() <= (len(w) + 1) / 2
    with pytest.raises(ValueError, match="positive finite"):
        Interleaving([0.5, 0.0])


def test_a_single_file_keeps_its_order(tmp_path):
    """A single token file (no name) draws in the permutation it always has (resumes of runs
    made before mixtures see the same samples); a named source in its own."""
    write_source(tmp_path / "t.tok", 50_000, (1, 100), median=100, seed=0)
    plain = TokenFileSource(TokenFile(tmp_path / "t.tok"), 64, seed=5, eos=EOS)
    gen = torch.Generator().manual_seed(sample_seed("tokens", 5, 0))
    order = torch.randperm(plain.train_sequences, generator=gen)
    for i in (0, 1, 17, plain.train_sequences - 1):
        assert torch.equal(plain.sample(i)[0], plain._sequence(int(order[i]))[0])
    named = TokenFileSource(TokenFile(tmp_path / "t.tok"), 64, seed=5, eos=EOS, name="web")
    assert any(not torch.equal(named.sample(i)[0], plain.sample(i)[0]) for i in range(4))


# --- the done-when numbers ------------------------------------------------------------------


def _draw(cfg, samples: int):
    source = make_source(cfg)
    loader = BatchLoader(source, cfg.data.global_batch, 1, 1, 0)
    rows, tags = [], []
    for _ in range(samples // cfg.data.global_batch):
        (mb,) = loader.next()
        rows.append(mb.tokens.view(cfg.data.global_batch, -1))
        tags.append(mb.sources.view(cfg.data.global_batch, -1))
    return source, torch.cat(rows).numpy(), torch.cat(tags).numpy()


@pytest.mark.parametrize("upsampled", [False, True], ids=["as-they-come", "upsampled"])
def test_shares_over_1000_sequences_of_8192_and_what_inspect_says(tmp_path, files, upsampled):
    cfg = load_config(mixture_toml(tmp_path / "c.toml", files, UPSAMPLED if upsampled else ""), ["run.steps=125"])
    source, tokens, tags = _draw(cfg, 1000)
    cls = token_classes(tokens)
    assert (cls >= 0).all()
    by_source = np.select([cls <= 1, cls == 2, cls == 3], [0, 1, 2])  # code (short and long), books, short
    for row in range(len(tokens)):  # a sequence holds documents of one source, and is tagged with it
        assert (by_source[row] == by_source[row, 0]).all() and (tags[row] == by_source[row, 0]).all()
    drawn = {name: float((by_source[:, 0] == d).mean()) for d, name in enumerate(source.names)}
    for name, w in WEIGHTS.items():
        assert abs(drawn[name] - w) < 0.01, (name, drawn)
    code = cls[by_source[:, 0] == 0]
    long_share = float((code == 1).mean())
    natural = float(code.size and (code == 1).mean())
    if upsampled:
        assert abs(long_share - 0.5) < 0.02, long_share
    # what data-inspect reports over the same 1,000 sequences
    report = inspect_data(cfg, steps=125, long_length=0 if upsampled else LONG)  # default: upsample_length
    rows = {r.name: r for r in report.sources}
    for name in WEIGHTS:
        assert rows[name].sequences == int((by_source[:, 0] == source.names.index(name)).sum())
        assert rows[name].target == pytest.approx(WEIGHTS[name])
    assert abs(rows["code"].long_drawn - long_share) < 0.02 and rows["code"].long_length == LONG
    assert rows["code"].long_target == (0.5 if upsampled else None)
    line = next(x for x in report.table().splitlines() if x.startswith("code "))
    words = line.split()
    assert words[1:3] == ["30.0%", f"{100 * rows['code'].drawn:.1f}%"] and abs(float(words[2][:-1]) - 30) < 1
    assert abs(float(words[6][:-1]) / 100 - long_share) < 0.02
    assert words[5] == ("50.0%" if upsampled else "-")
    if not upsampled:
        assert natural < 0.4  # upsampling raises it to one half


def test_upsampled_streams_hold_exactly_their_documents(tmp_path, files):
    """The long stream is the file's documents of at least LONG tokens end to end, the rest the
    others, each in the file's order (read from the file directly)."""
    cfg = load_config(mixture_toml(tmp_path / "c.toml", files, UPSAMPLED))
    code = make_source(cfg).source("code")
    raw = np.asarray(TokenFile(files["code"]).tokens)
    ends = np.flatnonzero(raw == EOS) + 1
    docs = np.split(raw, ends[:-1])
    for stream, keep in ((code.long, lambda n: n >= LONG), (code.rest, lambda n: n < LONG)):
        expected = np.concatenate([d for d in docs if keep(len(d))])
        assert stream.stream_tokens == expected.size
        for w in (0, 3, stream.train_sequences - 1):
            tokens, labels, cu = stream._sequence(w)
            window = expected[w * SEQ : w * SEQ + SEQ + 1]
            assert np.array_equal(tokens.numpy(), window[:-1])
            assert cu.tolist() == [0, *(np.flatnonzero(window[:-2] == EOS) + 1).tolist(), SEQ]


# --- layouts, resume, held-out --------------------------------------------------------------


def _global_order(batches: dict[int, list[Microbatch]], dp: int) -> Microbatch:
    """The replicas' packed microbatches of one step in global sample order, as one row."""
    parts = [batches[d][m] for m in range(len(batches[0])) for d in range(dp)]
    rows = []
    for mb in parts:
        cu = mb.cu_seqlens
        rows.append((mb.tokens[0], mb.labels[0], cu))
    joined = pack_rows(rows)
    return Microbatch(joined.tokens, joined.labels, joined.cu_seqlens, True, torch.cat([p.sources for p in parts], 1))


def _same(a: Microbatch, b: Microbatch) -> bool:
    return all(torch.equal(x, y) for x, y in zip((a.tokens, a.labels, a.cu_seqlens, a.sources),
                                                 (b.tokens, b.labels, b.cu_seqlens, b.sources)))  # fmt: skip


def test_the_same_step_on_every_layout_and_after_a_resume(tmp_path, files):
    cfg = load_config(mixture_toml(tmp_path / "c.toml", files, UPSAMPLED, seq_len=512))
    gb = cfg.data.global_batch
    single = BatchLoader(make_source(cfg), gb, 1, 1, 0)
    reference = [single.next()[0] for _ in range(3)]
    assert reference[0].sources.unique().numel() > 1  # the steps mix sources
    for dp, hp, cp in [(1, 1, 1), (2, 1, 2), (1, 2, 2)]:
        layout = RankLayout.build(ParallelConfig(hp=hp, cp=cp), dp * hp * cp)
        loaders = {r: BatchLoader(make_source(cfg), gb, 2, dp, layout.coords(r).dp) for r in range(dp * hp * cp)}
        for step in range(3):
            got = {r: loader.next() for r, loader in loaders.items()}
            replicas = {}
            for r, batches in got.items():  # every rank of a replica gets the same sequences
                first = replicas.setdefault(layout.coords(r).dp, batches)
                assert all(_same(a, b) for a, b in zip(first, batches))
            assert _same(_global_order(replicas, dp), reference[step]), (dp, hp, cp, step)
    # resumed from the state: on one replica, and on two replicas of another layout
    state = BatchLoader(make_source(cfg), gb, 1, 1, 0)
    state.next()
    resumed = BatchLoader(make_source(cfg), gb, 1, 1, 0)
    resumed.load_state_dict(state.state_dict())
    assert _same(resumed.next()[0], reference[1]) and _same(resumed.next()[0], reference[2])
    halves = [BatchLoader(make_source(cfg), gb, 1, 2, d) for d in range(2)]
    for half in halves:
        half.load_state_dict(state.state_dict())
    assert _same(_global_order({d: h.next() for d, h in enumerate(halves)}, 2), reference[1])
    assert _same(single.step_batch(1)[0], reference[1])  # any step, without moving the loader
    shipped = pickle.loads(pickle.dumps(make_source(cfg)))  # as the spec travels to the workers
    assert _same(BatchLoader(shipped, gb, 1, 1, 0).step_batch(2)[0], reference[2])
    assert single.state_dict() == {"next_index": 3 * gb}


def test_held_out_samples_are_each_sources_tail_in_the_mix(tmp_path, files):
    cfg = load_config(mixture_toml(tmp_path / "c.toml", files, seq_len=512))
    source = make_source(cfg)
    train = {source.sample(i)[0].numpy().tobytes() for i in range(600)}
    held = [source.tagged_sample(i, "eval") for i in range(1000)]
    assert not train & {s[0].numpy().tobytes() for _, s in held}
    ids = np.array([d for d, _ in held])
    for d, name in enumerate(source.names):
        assert abs((ids == d).mean() - WEIGHTS[name]) < 0.01
        raw, part = np.asarray(TokenFile(files[name]).tokens), source.parts[d]
        first = part.train_sequences  # held out: the file's last windows of 512 tokens, read from it directly
        tail = {raw[w * 512 : (w + 1) * 512].tobytes() for w in range(first, first + part.eval_sequences)}
        mine = {s[0].numpy().astype(raw.dtype).tobytes() for tag, s in held if tag == d}
        assert mine == tail
    eval_batch = BatchLoader(source, 8, 1, 1, 0).eval_batch(0)[0]
    assert eval_batch.sources is not None and eval_batch.sources.shape == eval_batch.labels.shape


def test_unpacked_mixtures_tag_rows_and_microbatches_carry_sources(tmp_path, files):
    cfg = load_config(mixture_toml(tmp_path / "c.toml", files, seq_len=256), ["data.pack=false"])
    (mb,) = BatchLoader(make_source(cfg), 8, 1, 1, 0).next()
    assert mb.cu_seqlens is None and mb.sources.shape == mb.labels.shape == (8, 256)
    cls = token_classes(mb.tokens.numpy())
    assert (np.select([cls <= 1, cls == 2], [0, 1], 2) == mb.sources.numpy()).all()
    moved = mb.to(torch.device("cpu"))
    assert moved.sources.dtype == torch.int64 and torch.equal(moved.sources, mb.sources)
    with pytest.raises(ValueError, match="sources .* must be shaped like the labels"):
        Microbatch(mb.tokens, mb.labels, sources=mb.sources[:, :-1])


# --- identity of a mixture ------------------------------------------------------------------


def test_fingerprint_and_order_follow_the_data_not_the_path_or_the_table_order(tmp_path, files):
    base = load_config(mixture_toml(tmp_path / "a.toml", files, UPSAMPLED, seq_len=512))
    source = make_source(base)
    copied = {n: tmp_path / f"copy-{n}.tok" for n in files}
    for n, p in files.items():
        shutil.copyfile(p, copied[n])
    moved = make_source(load_config(mixture_toml(tmp_path / "b.toml", copied, UPSAMPLED, seq_len=512)))
    assert moved.fingerprint() == source.fingerprint()  # the same data elsewhere
    reordered = load_config(None)
    reordered.data = base.data
    reordered.data.sources = dict(reversed(list(base.data.sources.items())))
    flipped = make_source(reordered)
    assert flipped.names == ("short", "books", "code") and flipped.fingerprint() == source.fingerprint()
    for i in range(40):  # the table order changes no sample
        assert torch.equal(flipped.sample(i)[0], source.sample(i)[0])
    for change in ("data.seed=7", "data.seq_len=1024", "data.sources.code.weight=0.5",
                   "data.sources.code.upsample_share=0.4", "data.sources.books.long_documents=drop"):  # fmt: skip
        other = load_config(mixture_toml(tmp_path / "a.toml", files, UPSAMPLED, seq_len=512), [change])
        assert make_source(other).fingerprint() != source.fingerprint(), change
    # a source's own order does not depend on the others: adding one leaves it alone
    two = load_config(mixture_toml(tmp_path / "a.toml", files, UPSAMPLED, seq_len=512))
    del two.data.sources["short"]
    fewer = make_source(two)
    for k in range(20):
        assert torch.equal(fewer.source("books").sample(k)[0], source.source("books").sample(k)[0])
    other = tmp_path / "other.tok"
    write_source(other, 1_500_000, IDS["books"], median=1000, seed=9)
    changed = load_config(mixture_toml(tmp_path / "a.toml", {**files, "books": other}, UPSAMPLED, seq_len=512))
    assert make_source(changed).fingerprint() != source.fingerprint()


# --- the config ------------------------------------------------------------------------------


def test_mixture_config_overrides_round_trip_and_help(tmp_path, files):
    path = mixture_toml(tmp_path / "c.toml", files, UPSAMPLED + 'long_documents = "drop"\n')
    cfg = load_config(path, split_overrides(["--data.sources.code.weight", "0.4", "--data.sources.books.weight=2"]))
    assert list(cfg.data.sources) == ["code", "books", "short"]
    code = cfg.data.sources["code"]
    assert (code.weight, code.upsample_length, code.upsample_share, code.long_documents) == (0.4, LONG, 0.5, "drop")
    assert cfg.data.sources["books"].weight == 2.0 and cfg.data.path == ""
    saved = tmp_path / "resolved.toml"
    saved.write_text(to_toml(cfg))
    assert load_config(saved) == cfg
    assert "[data.sources.code]" in saved.read_text()
    extra = load_config(path, ["data.sources.extra.path=x.tok"])  # a source added from the command line
    assert extra.data.sources["extra"].weight == 1.0
    text = describe()
    assert "[data.sources.NAME]" in text and "need not sum to 1" in text and "upsample_share = 0.0" in text


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.path=x.tok"], r"data.path='x.tok' and \[data.sources.\*\] \(code, books, short\) are both set"),
        (["data.sources.code.weight=0"], r"data.sources.code.weight=0.0 must be positive"),
        (["data.sources.code.weight=-1"], r"data.sources.code.weight=-1.0 must be positive"),
        (["data.sources.code.weight=nan"], r"data.sources.code.weight=nan must be finite"),
        (["data.sources.code.weight=inf"], r"data.sources.code.weight=inf must be finite"),
        (["data.sources.code.upsample_length=10", "data.sources.code.upsample_share=1"],
         r"data.sources.code.upsample_share=1.0 must be in \(0, 1\)"),
        (["data.sources.code.upsample_share=0.3"], r"upsample_share=0.3 needs data.sources.code.upsample_length"),
        (["data.sources.code.upsample_length=99999", "data.sources.code.upsample_share=0.3",
          "data.long_documents=drop"], r"upsample_length=99999 exceeds data.seq_len=8192.*no document that long"),
        (["data.sources.code.wieght=1"], r"unknown key data.sources.code.wieght; keys of a source are"),
        (["data.sources.co.de.weight=1"], r"a source's key is data.sources.NAME.KEY"),
        (["data.sources.c$.weight=1"], r"source name 'c\$' may hold only letters"),
        (["data.sources.code.long_documents=keep"], r"data.sources.code.long_documents='keep'; choose one of"),
        (["data.sources.code.path="], r"data.sources.code.path is empty: set it"),
        (["data.group_by_length=2"], r"a mixture \(\[data.sources\]\) is not grouped: set data.group_by_length=0"),
        (["data.source=recall"], r"but data.source='recall': set data.source='tokens'"),
        (["data.sources.code.weight=abc"], r"'abc' is not a valid float"),
    ],
)  # fmt: skip
def test_mixture_config_refusals(tmp_path, files, overrides, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(mixture_toml(tmp_path / "c.toml", files), overrides)
    assert "\n" not in str(e.value)


def _preflight(tmp_path: Path, files: dict[str, Path], *overrides: str, code_extra: str = ""):
    cfg = load_config(mixture_toml(tmp_path / "c.toml", files, code_extra, seq_len=1024),
                      [f"run.output_dir={tmp_path / 'run'}", "model.vocab_size=1024", *overrides])  # fmt: skip
    return preflight(cfg, 1)


def test_file_refusals_name_the_source_before_any_process(tmp_path, files, monkeypatch):
    def refused(match: str, *overrides: str, code_extra: str = "", sources=None):
        with pytest.raises(TokenFileError, match=match) as e:
            _preflight(tmp_path, sources or files, *overrides, code_extra=code_extra)
        assert "\n" not in str(e.value)

    spec = _preflight(tmp_path, files, "run.steps=10")
    assert isinstance(spec.source, MixtureSource) and spec.source.names == ("code", "books", "short")
    missing = f"data.sources.books.path={tmp_path}/nope.tok"
    refused(r"data.sources.books.path: token file '.*nope.tok' does not exist", missing)
    refused(r"data.sources.books.path: token file '.*' is a folder, not a token file; give one of the token files in "
            r"it: ", f"data.sources.books.path={files['books'].parent}")  # fmt: skip
    locked = tmp_path / "locked.tok"
    shutil.copyfile(files["books"], locked)
    locked.chmod(0)
    if os.geteuid() == 0:  # root reads any file: the open fails as it would for a user
        real_open = open

        def no_access(path, *args, **kwargs):
            if Path(path) == locked:
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(tokens_module, "open", no_access, raising=False)
    refused(r"data.sources.books.path='.*locked.tok' cannot be read \(Permission denied\); fix the path or the "
            r"file's permissions", f"data.sources.books.path={locked}")  # fmt: skip
    monkeypatch.undo()
    tiny = tmp_path / "tiny.tok"
    write_source(tiny, 1500, IDS["books"], median=100, seed=4)
    refused(r"data.sources.books: .*tiny.tok: 15\d\d tokens make 1 sequence\(s\) of 1024\+1 tokens; need at least 2",
            sources={**files, "books": tiny})  # fmt: skip
    refused(r"data.sources.code: no document has upsample_length=300000 tokens or more \(the longest has \d+\).*; "
            r"lower data.sources.code.upsample_length to at most \d+", code_extra="upsample_length = 300000\n"
            "upsample_share = 0.5\n")  # fmt: skip
    few = tmp_path / "few-long.tok"  # 4,000 documents of 50 tokens and one of 1,500: one sequence of long ones
    lengths = np.array([50] * 2000 + [1500] + [50] * 2000)
    stream = np.ones(lengths.sum(), dtype=np.int64)
    stream[np.cumsum(lengths) - 1] = EOS
    write_tokens(few, stream, VOCAB, eos=EOS)
    refused(r"data.sources.code \(upsampling\): .*few-long.tok: 1500 tokens in documents of at least 1000 tokens "
            r"make 1 sequence\(s\) of 1024\+1 tokens; need at least 2 .*; or lower data.sources.code.upsample_length",
            code_extra="upsample_length = 1000\nupsample_share = 0.5\n", sources={**files, "code": few})  # fmt: skip
    tokenizers = {n: tmp_path / f"fp-{n}.tok" for n in files}
    for seed, (n, fp) in enumerate(zip(files, (0xAB, 0xAB, 0xCD))):
        write_source(tokenizers[n], 200_000, IDS[n], median=500, seed=seed, fingerprint=fp)
    refused(r"data.sources.short \(.*fp-short.tok\) was tokenized with another tokenizer than data.sources.code "
            r"\(.*\): fingerprint 00000000000000cd, vocabulary 1000, EOS 0 vs fingerprint 00000000000000ab",
            sources=tokenizers)  # fmt: skip
    beyond = r"data.sources.code: .*code.tok: token id 199 is beyond the model's vocabulary of 150"
    refused(beyond, "model.vocab_size=150")
    notes = _preflight(tmp_path, files, "run.steps=4000").notices  # 4,000 x 8 sequences of 1,024: repeats
    windows = (TokenFile(files["short"]).count - 1) // 1024
    train = windows - max(1, int(windows * 0.01))
    epochs = 0.4 * 32_000 / train
    assert (
        epochs > 4
        and (
            f"data.sources.short: its {train:,} training sequences are drawn {epochs:.1f} times over the run's 32,000 "
            f"sequences (more than 4 epochs); add {epochs / 4:.1f}x the data, or lower its weight"
        )
        in notes
    ), notes


def test_data_inspect_says_when_upsampling_downsamples_and_when_sequences_are_skipped(tmp_path, files):
    import re

    # code's own share of tokens in documents of at least LONG, from the file's EOS positions
    ids = np.asarray(TokenFile(files["code"]).tokens)
    lengths = np.diff(np.concatenate([[-1], np.flatnonzero(ids == EOS)]))
    natural = lengths[lengths >= LONG].sum() / lengths.sum()
    assert 0.2 < natural < 0.5
    extra = f"upsample_length = {LONG}\nupsample_share = 0.1\n"
    cfg = load_config(mixture_toml(tmp_path / "c.toml", files, extra), ["run.steps=10"])
    (note,) = [w for w in inspect_data(cfg).warnings if "downsampled" in w]
    assert note.startswith(f"source code: upsample_share=0.1 is below the share of its tokens in documents of at "
                           f"least {LONG:,} tokens")  # fmt: skip
    assert abs(float(re.search(r"\(([\d.]+)%\)", note).group(1)) / 100 - natural) < 0.001
    at_half = load_config(mixture_toml(tmp_path / "d.toml", files, UPSAMPLED), ["run.steps=10"])
    assert not [w for w in inspect_data(at_half).warnings if "downsampled" in w]  # 0.5 is above: upsampled

    # a file whose first half holds no loss target: those sequences are skipped, and said so
    seq, n = 512, 40 * 512 + 1
    flags = np.zeros(n, dtype=np.uint8)
    flags[n // 2 :] = TARGET
    flags[0] |= DOC_START
    write_tokens(tmp_path / "half.tok", np.arange(n) % 250 + 1, VOCAB, eos=EOS, flags=flags)
    no_target = sum(not (flags[w * seq + 1 : (w + 1) * seq + 1] & TARGET).any() for w in range((n - 1) // seq))
    cfg = load_config(None, ["data.source=tokens", f"data.path={tmp_path / 'half.tok'}", f"data.seq_len={seq}",
                             "data.global_batch=2", "run.steps=2"])  # fmt: skip
    assert f"data.path: {no_target:,} of its 40 sequences of 512 tokens have no loss target" in " ".join(
        inspect_data(cfg).warnings
    )


def test_data_inspect_command_writes_the_table_and_the_plot(tmp_path, files, capsys):
    path = mixture_toml(tmp_path / "c.toml", files, UPSAMPLED)
    out = tmp_path / "inspect"
    inspect_main(argparse.Namespace(config=str(path), steps=None, out=str(out), long=0),
                 ["--run.steps", "2000", "--data.sources.short.weight", "0.4"])  # fmt: skip
    printed = capsys.readouterr().out
    assert "16,000 sequences of 8,192 tokens (2,000 steps x 8 sequences)" in printed
    assert (out / "data_inspect.txt").read_text() in printed and (out / "document_lengths.png").stat().st_size > 5000
    assert "warning: source code (long documents): its sequences repeat" in printed
    assert "   4,096-8,191 " in printed  # a row of the length histogram
    with pytest.raises(SystemExit):
        inspect_main(argparse.Namespace(config=str(path), steps=None, out="", long=0), ["--data.sources.x.weight=1"])
    assert "data.sources.x.path is empty" in capsys.readouterr().out


def test_loader_benchmark_prints_its_table(tmp_path, capsys):
    from loongtrain.tools.bench import data as bench

    for seed, name in enumerate(bench.SOURCES):
        bench.write_source(tmp_path / f"{name}.tok", 40_000, median=300, seed=seed)
    rows = bench.run(tmp_path, seq=2048, batch=4, steps=2)
    assert [r["case"] for r in rows] == ["one file", "mixture of 3", "mixture, upsampled"]
    assert all(0 < r["ms_per_128k"] < 1e4 for r in rows)
    assert "ms per 128K seq" in capsys.readouterr().out
