"""Long-context evaluation in one process: needle construction and placement, bucket edges,
the effective-context rule, the one forward against full logits, the outputs, and every
refusal (called directly: nothing is spawned)."""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from loongtrain.apply import materialize
from loongtrain.config import ConfigError, load_config, parse_lengths, to_toml
from loongtrain.data import TokenFileError, write_tokens
from loongtrain.data.recall import IGNORE_INDEX, RecallTask
from loongtrain.data.tokenizer import ByteTokenizer
from loongtrain.eval.cli import prepare
from loongtrain.eval.model import checkpoint_candidates
from loongtrain.eval.needles import (
    Prompt,
    RecallFormat,
    TextFormat,
    assemble,
    depth_grid,
    needle_offset,
    snap_back,
)
from loongtrain.eval.plan import NeedleBuilder, default_lengths, make_plan
from loongtrain.eval.positions import LossByPosition, bucket_edges, file_windows
from loongtrain.eval.report import (
    LossReport,
    NeedleOutcome,
    NeedleReport,
    effective_context,
    length_label,
    write_outputs,
)
from loongtrain.eval.runner import batches, needle_outcomes, score_batch
from loongtrain.model import ModelConfig, build_model
from loongtrain.train.checkpoint import CHECKSUM_FILE, STATE_FILE, CheckpointError

# -- placement ---------------------------------------------------------------------------


def test_depth_grid_and_offsets():
    assert depth_grid(5) == (0.0, 0.25, 0.5, 0.75, 1.0)
    assert depth_grid(1) == (0.5,)
    assert [needle_offset(100, d) for d in depth_grid(5)] == [0, 25, 50, 75, 100]
    assert needle_offset(7, 0.5) == 4  # round half to even: 3.5 -> 4
    with pytest.raises(ValueError):
        needle_offset(10, 1.5)


def test_snap_back_moves_to_the_start_of_a_line_only_nearby():
    filler = [1, 2, 9, 3, 4, 5, 6]  # 9 ends a line
    is_break = lambda t: t == 9  # noqa: E731
    assert snap_back(filler, 5, is_break) == 3  # just after the 9
    assert snap_back(filler, 3, is_break) == 3
    assert snap_back(filler, 6, is_break, window=2) == 6  # no break within 2 tokens: unchanged
    assert snap_back(filler, 2, is_break) == 0  # the start of the filler counts
    assert snap_back(filler, 5, None) == 5


def test_assemble_puts_every_piece_where_it_belongs():
    prompt = Prompt(
        head=[900], needles=[[901, 902], [903]], tail=[904, 905, 906], targets=[[(0, 77)], [(2, 78)]],
        keys=["a", "b"], values=["x", "y"],
    )  # fmt: skip
    ctx = assemble(prompt, lambda n: np.arange(n), length=20, depth=0.5, sample=0)
    room = 20 - prompt.fixed_tokens  # 13 filler tokens
    at = 1 + round(0.5 * room)
    expected = [900, *range(6), 901, 902, 903, *range(6, room), 904, 905, 906]
    assert ctx.tokens.tolist() == expected and at == 7
    assert [n.start for n in ctx.needles] == [7, 9]
    assert ctx.needles[0].scored == (17,) and ctx.needles[1].scored == (19,)
    assert {i: int(v) for i, v in enumerate(ctx.labels) if v != IGNORE_INDEX} == {17: 77, 19: 78}
    assert ctx.placed_depth == pytest.approx(6 / 13)
    with pytest.raises(ValueError, match="no room for filler"):
        assemble(prompt, lambda n: np.arange(n), length=prompt.fixed_tokens, depth=0.0, sample=0)


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_recall_needles_speak_the_recall_task(depth):
    fmt = RecallFormat(keys=8, values=8, filler=16)
    task = RecallTask(seq_len=64, keys=8, values=8, facts=4, queries=4, filler=16)
    assert fmt.vocab_size == task.vocab_size and fmt.chance == task.chance
    prompt = fmt.prompt(random.Random(3), 4)
    ctx = assemble(prompt, fmt.filler_tokens(1), 64, depth, 0)
    tokens, labels = ctx.tokens, ctx.labels
    assert (tokens[: ctx.needles[0].start] < 16).all()  # filler before the needles
    first = ctx.needles[0].start
    assert first == round(depth * (64 - 8))  # 4 fact tokens + 4 queries are not filler
    facts = tokens[first : first + 4]
    keys, values = (facts - 16) // 8, (facts - 16) % 8
    assert [str(int(k)) for k in keys] == [n.key for n in ctx.needles]
    assert len(set(keys.tolist())) == 4
    for needle, key, value in zip(ctx.needles, keys, values):
        (q,) = needle.scored
        assert q >= 60 and tokens[q] == task.query0 + key and labels[q] == task.answer0 + value
    assert (labels != IGNORE_INDEX).sum() == 4


def test_text_needles_in_bytes_place_and_score_the_value():
    fmt = TextFormat(ByteTokenizer(), chat=False)
    prompt = fmt.prompt(random.Random(0), 3)
    filler = fmt.repeat_filler()
    ctx = assemble(prompt, filler, 1024, 0.5, 0, fmt.is_break)
    text = bytes(ctx.tokens.tolist()).decode()
    tokens = ctx.tokens
    assert text.startswith("Some special magic numbers are hidden")
    for needle in ctx.needles:
        line = f"\nOne of the special magic numbers for {needle.key} is: {needle.value}.\n"
        assert bytes(tokens[needle.start : needle.start + len(line)].tolist()).decode() == line
        assert len(needle.value) == 7 and needle.value.isdigit()
        answer = bytes(int(ctx.labels[p]) for p in needle.scored).decode()
        assert answer == needle.value  # the value's tokens are scored, the space before it is only given
        assert tokens[needle.scored[0]] == ord(" ")
        # the label at p predicts token p + 1: teacher forcing puts the answer in the sequence
        assert all(int(tokens[p + 1]) == int(ctx.labels[p]) for p in needle.scored)
        assert needle.scored[0] > needle.start
    assert ctx.needles[0].start - 1 >= 0 and tokens[ctx.needles[0].start - 1] == ord("\n")  # snapped to a line start
    room = 1024 - prompt.fixed_tokens
    assert 0.5 - 64 / room <= ctx.placed_depth <= 0.5  # snapped back at most 64 tokens
    assert "What are all the special magic numbers for" in text and text.count(" and ") >= 1


class _ChatBytes(ByteTokenizer):
    chat_template = "user/assistant"

    def render_chat(self, messages, add_generation_prompt=False):
        return "<u>" + messages[0]["content"] + "</u><a>"


def test_text_needles_in_a_chat_template():
    fmt = TextFormat(_ChatBytes(), chat=True)
    prompt = fmt.prompt(random.Random(1), 1)
    ctx = assemble(prompt, fmt.repeat_filler(), 512, 0.0, 0, fmt.is_break)
    text = bytes(ctx.tokens.tolist()).decode()
    assert text.startswith("<u>A special magic number is hidden")
    assert "mentioned in the provided text?</u><a>The special magic number for" in text
    assert text.endswith(f"is: {ctx.needles[0].value}")


def test_contexts_are_a_function_of_the_plan(tmp_path):
    cfg = load_config(None, ["eval.lengths=128,256", "eval.depths=3", "eval.samples=2", "eval.needles=3"])
    plan = make_plan(cfg, ModelConfig(), 1, 1)
    a, b = NeedleBuilder(plan), NeedleBuilder(plan)
    for cell in plan.cells:
        ca, cb = a.context(*cell), b.context(*cell)
        assert torch.equal(ca.tokens, cb.tokens) and torch.equal(ca.labels, cb.labels)
    # the same filler, needles and question order at every depth of a (length, sample): only
    # where the needles are moves; other keys for another sample
    c0, c1 = a.context(128, 0.0, 0), a.context(128, 1.0, 0)
    assert c0.needles[0].start < c1.needles[0].start
    assert [(n.key, n.value) for n in c0.needles] == [(n.key, n.value) for n in c1.needles]
    assert torch.equal(c0.labels[c0.labels != IGNORE_INDEX], c1.labels[c1.labels != IGNORE_INDEX])
    assert [n.key for n in c0.needles] != [n.key for n in a.context(128, 0.0, 1).needles]


# -- buckets, loss, effective context ------------------------------------------------------


def test_bucket_edges_are_log_spaced():
    assert bucket_edges(8192, 14) == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
    for length, n in [(1000, 7), (64, 12), (5, 3), (1, 4)]:
        edges = bucket_edges(length, n)
        assert edges[0] == 0 and edges[-1] == length
        assert all(a < b for a, b in zip(edges, edges[1:])) and len(edges) <= n + 1
        assert edges[:2] == [0, 1] or length == 1


def test_loss_by_position_sums_per_bucket():
    acc = LossByPosition([0, 2, 4, 8, 16])
    loss = torch.arange(16, dtype=torch.float32)
    scored = torch.ones(16, dtype=torch.bool)
    scored[5] = False
    acc.add(loss, scored)
    acc.add(loss, scored)
    assert acc.edges == [0, 2, 4, 8, 16]
    assert acc.counts == [4, 4, 6, 16]
    assert acc.means() == [0.5, 2.5, (4 + 6 + 7) / 3, 11.5]
    assert acc.overall() == pytest.approx((loss.sum() - 5) / 15)


def test_effective_context_rule():
    assert effective_context({1024: 1.0, 2048: 0.95, 4096: 0.5, 8192: 0.95}) == 2048  # must stay above
    assert effective_context({1024: 0.89, 2048: 1.0}) == 0
    assert effective_context({256: 0.9}) == 256  # at the threshold counts
    assert effective_context({}) == 0


def test_parse_lengths_and_labels():
    assert parse_lengths("1K, 2048,4k") == (1024, 2048, 4096)
    assert parse_lengths("1M") == (1024**2,)
    for bad in ("", "1K,,2K", "x", "-4", "1K,1024"):
        with pytest.raises(ConfigError):
            parse_lengths(bad)
    assert [length_label(n) for n in (256, 1024, 1536, 16384, 2**20)] == ["256", "1K", "1.5K", "16K", "1M"]
    assert default_lengths(256, 8) == (32, 64, 128, 256)
    assert default_lengths(100, 8) == (8, 24, 48, 96)


# -- the forward against full logits -------------------------------------------------------


def _model(seed: int = 0, **shape) -> torch.nn.Module:
    cfg = ModelConfig(**{"init_std": 0.2, **shape})
    model = build_model(cfg)
    materialize(model, torch.device("cpu"), seed=seed)
    model.loss_chunk = 7  # chunks that do not divide the sequence
    return model


def test_score_batch_equals_full_logits_cross_entropy():
    model = _model()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (96,), generator=gen)
    labels = torch.randint(0, 256, (96,), generator=gen)
    labels[::5] = IGNORE_INDEX
    loss, correct = (r[0] for r in score_batch(model, None, tokens[None], labels[None]))
    with torch.no_grad():
        logits = model(tokens[None], torch.arange(96))[0]  # the reference: full [S, vocab] logits
    ref = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(correct, (logits.argmax(-1) == labels) & (labels != IGNORE_INDEX))
    # labels = the model's own argmax: every scored position is correct
    own = logits.argmax(-1)
    _, hit = (r[0] for r in score_batch(model, None, tokens[None], own[None]))
    assert hit.all()


def test_rows_of_one_forward_score_as_alone():
    model = _model(seed=1)
    gen = torch.Generator().manual_seed(2)
    tokens, labels = torch.randint(0, 256, (3, 40), generator=gen), torch.randint(0, 256, (3, 40), generator=gen)
    loss, correct = score_batch(model, None, tokens, labels)
    for row in range(3):
        alone = [r[0] for r in score_batch(model, None, tokens[row : row + 1], labels[row : row + 1])]
        torch.testing.assert_close(loss[row], alone[0], rtol=1e-5, atol=1e-6)
        assert torch.equal(correct[row], alone[1])


def test_batches_group_consecutive_rows_of_one_length():
    items = [64, 64, 64, 64, 64, 128, 128, 256, 64]
    groups = batches(items, lambda n: n, 256)
    assert groups == [[64, 64, 64, 64], [64], [128, 128], [256], [64]]
    assert batches(items, lambda n: n, 10) == [[n] for n in items]  # longer than the budget: one each


def test_needle_outcomes_need_every_answer_token():
    fmt = TextFormat(ByteTokenizer(), chat=False)
    ctx = assemble(fmt.prompt(random.Random(0), 2), fmt.repeat_filler(), 600, 0.5, 0, fmt.is_break)
    correct = torch.zeros(600, dtype=torch.bool)
    first, second = ctx.needles
    correct[list(first.scored)] = True
    correct[list(second.scored)[:-1]] = True  # all but the last digit
    loss = torch.zeros(600)
    loss[list(first.scored)] = 0.5
    out = needle_outcomes(ctx, loss, correct)
    assert [o.correct for o in out] == [True, False]
    assert out[0].answer_loss == pytest.approx(0.5 * 7) and out[0].answer_tokens == 7  # the 7 digits


def test_reports_write_tables_json_and_pictures(tmp_path):
    outcomes = [
        NeedleOutcome(n, d, 0, "k", "v", 0, d, correct, 0.1, 1)
        for n in (256, 512) for d in (0.0, 1.0) for correct in (True, n == 256)
    ]  # fmt: skip
    needles = NeedleReport(outcomes, [256, 512], [0.0, 1.0], 2, 0.125, "recall")
    assert needles.by_length == {256: 1.0, 512: 0.5} and needles.effective_context == 256
    assert "effective context: 256" in needles.table()
    loss = LossReport([{"lo": 0, "hi": 2, "mean_loss": 3.0, "tokens": 2}], 2, 1, "x", 3.0, False)
    paths = write_outputs(tmp_path / "out", needles, loss, {"a": 1}, "t")
    data = json.loads(Path(paths["json"]).read_text())
    assert data["needles"]["effective_context"] == 256 and len(data["needles"]["outcomes"]) == 8
    assert Path(paths["needles"]).read_bytes()[:4] == b"\x89PNG"
    assert Path(paths["loss"]).read_bytes()[:4] == b"\x89PNG"


# -- refusals, in process -------------------------------------------------------------------


def test_plan_refuses_lengths_the_layout_does_not_allow():
    with pytest.raises(ConfigError, match="not a multiple of 2\\*hp\\*cp = 8"):
        make_plan(load_config(None, ["eval.lengths=100"]), ModelConfig(), 2, 2)
    with pytest.raises(ConfigError, match="exceeds the longest context .* 256"):
        make_plan(load_config(None, ["eval.lengths=512"]), ModelConfig(), 1, 1)
    make_plan(load_config(None, ["eval.lengths=512", "eval.max_len=512"]), ModelConfig(), 1, 1)  # allowed when raised


def test_plan_refuses_needles_that_do_not_fit():
    with pytest.raises(ConfigError, match="no room for filler in a context of 8"):
        make_plan(load_config(None, ["eval.lengths=8", "eval.needles=4"]), ModelConfig(), 1, 1)
    with pytest.raises(ConfigError, match="no room for filler in a context of 64"):  # text needles are long
        make_plan(load_config(None, ["eval.lengths=64", "eval.task=text", "eval.tokenizer=bytes"]),
                  ModelConfig(vocab_size=257), 1, 1)  # fmt: skip
    with pytest.raises(ConfigError, match="eval.needles=9 needs as many distinct keys"):
        make_plan(load_config(None, ["eval.needles=9"]), ModelConfig(), 1, 1)


def test_plan_refuses_a_short_token_file_and_a_missing_tokenizer(tmp_path):
    path = tmp_path / "short.tok"
    write_tokens(path, np.arange(300) % 250, vocab_size=257)
    base = ["eval.task=text", "eval.tokenizer=bytes", "eval.lengths=1K", "eval.max_len=1024", "eval.needles=1"]
    base += ["eval.loss_windows=0"]
    with pytest.raises(TokenFileError, match="300 tokens, but the filler of a context of 1024 needs"):
        make_plan(load_config(None, [*base, f"eval.tokens={path}"]), ModelConfig(vocab_size=257), 1, 1)
    with pytest.raises(TokenFileError, match="cannot give eval.loss_windows=4"):
        make_plan(load_config(None, [*base[:-1], f"eval.tokens={path}", "eval.lengths=256"]),
                  ModelConfig(vocab_size=257), 1, 1)  # fmt: skip
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        make_plan(load_config(None, ["eval.task=text"]), ModelConfig(), 1, 1)
    with pytest.raises(ConfigError, match="has 257 ids, the model's vocabulary is 256"):
        make_plan(load_config(None, ["eval.task=text", "eval.tokenizer=bytes"]), ModelConfig(), 1, 1)


def _args(target, **kw) -> argparse.Namespace:
    base = dict(target=str(target), step=None, random_weights=False, tokens=None, out=None, config=None, nproc=1)
    return argparse.Namespace(**{**base, **kw})


def _fake_run(tmp_path: Path, steps: list[int], shape: dict | None = None) -> Path:
    """A run folder with complete-looking checkpoint folders (no weights: the refusals come first)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(load_config(None, [f"run.output_dir={run}"])))
    for step in steps:
        folder = run / "checkpoints" / f"step-{step}"
        folder.mkdir(parents=True)
        state = {"step": step, "model_shape": shape if shape is not None else {}}
        (folder / STATE_FILE).write_text(json.dumps(state))
        (folder / CHECKSUM_FILE).write_text("{}")
    return run


def test_cli_refuses_bad_targets_steps_and_shapes(tmp_path):
    with pytest.raises(ConfigError, match="neither a run folder"):
        prepare(_args(tmp_path), [], 1, 1)
    run = _fake_run(tmp_path, [])
    (run / "checkpoints").rmdir() if (run / "checkpoints").exists() else None
    with pytest.raises(CheckpointError, match="has no checkpoints"):
        prepare(_args(run), [], 1, 1)
    shutil.rmtree(run)
    run = _fake_run(tmp_path, [2, 4])
    with pytest.raises(CheckpointError, match="--step 3: .* has no step-3; it has step\\(s\\) 2, 4"):
        prepare(_args(run, step=3), [], 1, 1)
    job = prepare(_args(run), [], 1, 1)
    assert job.weights.steps == (4, 2) and job.out == str(run / "eval" / "step-4")
    assert prepare(_args(run, step=2), [], 1, 1).weights.steps == (2,)
    with pytest.raises(ConfigError, match="world size 1 is not divisible by sp"):
        prepare(_args(run), ["--parallel.hp", "2"], 1, 1)
    with pytest.raises(ConfigError, match="not a multiple of 2\\*hp\\*cp = 8"):
        prepare(_args(run), ["--parallel.cp", "4", "--eval.lengths", "100"], 4, 4)
    shutil.rmtree(run)
    run = _fake_run(tmp_path, [5], shape={"dim": 128, "n_layers": 2})
    with pytest.raises(CheckpointError, match="holds a model of another shape .*'dim': \\(128, 64\\)"):
        prepare(_args(run), [], 1, 1)
    # RoPE settings do not change the weights: another scaling is not a shape mismatch
    assert checkpoint_candidates(run / "checkpoints", None, ModelConfig(dim=128, rope_theta=5e5)) == (5,)


def test_file_windows_start_documents_and_refuse_short_files(tmp_path):
    path = tmp_path / "docs.tok"
    tokens = np.arange(1000) % 200
    flags = np.ones(1000, dtype=np.uint8)
    flags[[0, 100, 400, 450]] |= 2  # documents of 100, 300, 50, 550 tokens
    write_tokens(path, tokens, vocab_size=256, flags=flags)
    from loongtrain.data import TokenFile

    windows = file_windows(TokenFile(path), 256, 2, seed=0)
    assert sorted(w.start for w in windows) == [100, 450] and not any(w.crosses_documents for w in windows)
    assert torch.equal(windows[0].labels[:-1], windows[0].tokens[1:])
    windows = file_windows(TokenFile(path), 256, 3, seed=0)  # only two documents are long enough
    assert all(w.crosses_documents for w in windows)
    with pytest.raises(TokenFileError, match="cannot give 4 window"):
        file_windows(TokenFile(path), 256, 4, seed=0)


def test_eval_section_validation():
    for bad in ("eval.depths=0", "eval.needles=0", "eval.every=-1", "eval.task=other", "eval.lengths=1K,x"):
        with pytest.raises(ConfigError):
            load_config(None, [bad])
    cfg = load_config(None, ["eval.every=5", "eval.lengths=1K,2K"])
    assert cfg.eval.every == 5 and math.isfinite(cfg.eval.position_buckets)


def test_heldout_loss_windows_are_the_training_sources_eval_sequences(tmp_path):
    """A run on a token file scores loss by position on its own held-out sequences: each
    window is ``TokenFileSource.sample(i, "eval")``, tokens and labels, as training sees it."""
    from loongtrain.data.loader import TokenFileSource
    from loongtrain.data.tokens import TokenFile
    from loongtrain.eval.positions import heldout_windows

    rng = np.random.default_rng(0)
    write_tokens(tmp_path / "t.tok", rng.integers(1, 200, 40_000), 256, eos=0)
    source = TokenFileSource(TokenFile(tmp_path / "t.tok"), 128, seed=3)
    windows = heldout_windows(source, 3)
    assert len(windows) == min(3, source.eval_sequences) > 0
    for i, window in enumerate(windows):
        tokens, labels = source.sample(i, "eval")[:2]
        assert torch.equal(window.tokens, tokens) and torch.equal(window.labels, labels)
        assert window.start == (source.train_sequences + i) * 128 and not window.crosses_documents


def test_a_mixture_gives_the_text_needles_its_first_sources_filler_and_held_out_windows(tmp_path):
    pytest.importorskip("transformers")
    import numpy as np

    from loongtrain.data import write_tokens

    from hf_tiny import add_tokenizer

    add_tokenizer(tmp_path / "tok", 256)
    files = {}
    for name in ("books", "code"):
        files[name] = tmp_path / f"{name}.tok"
        write_tokens(files[name], np.arange(20_000) % 200 + 3, vocab_size=256, eos=2)
    overrides = [
        "data.source=tokens", "data.seq_len=128", "eval.task=text", f"eval.tokenizer={tmp_path / 'tok'}",
        "eval.lengths=128", "eval.needles=1", *(f"data.sources.{n}.path={p}" for n, p in files.items()),
    ]  # fmt: skip
    plan = make_plan(load_config(None, overrides), ModelConfig(), 1, 1)
    assert plan.filler == str(files["books"]) and plan.loss_file == str(files["books"])  # the first in the config
