"""Generated long-context tasks (``eval.generated``): RULER's prompts placed in the grid's
contexts (pure), the scoring, the plan's refusals, and the tasks on 1 and 4 ranks giving the
same outputs (the generation itself equals transformers': tests/test_generate.py)."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from loongtrain.config import ConfigError, load_config
from loongtrain.data.tokenizer import ByteTokenizer
from loongtrain.eval.generated import (
    GENERATED_TASKS,
    RecallFormat,
    TextFormat,
    place,
    recall_prompt,
    score,
    text_prompt,
)
from loongtrain.eval.plan import NeedleBuilder, make_plan
from loongtrain.model import ModelConfig


def _text(ids) -> str:
    return bytes(int(t) for t in ids if t < 256).decode()


@pytest.mark.parametrize("task", GENERATED_TASKS)
def test_text_prompts_hold_their_answers_and_ask_for_them(task):
    fmt = TextFormat(ByteTokenizer(), chat=False)
    prompt = text_prompt(fmt, task, random.Random(1), 4)
    filler = fmt.repeat_filler()
    ctx = place(prompt, filler, 2000, 0.3, task, 0, fmt.is_break)
    text = _text(ctx.tokens)
    assert len(ctx.tokens) == 2000
    for answer in ctx.answers:
        assert answer in text[: -len(_text(prompt.tail))]  # in the haystack, before the question
    if task == "vt":
        value = re.search(r"assigned the value (\d+) in the text above", text).group(1)
        names = ctx.answers
        assert f"VAR {names[0]} = {value}" in text and len(names) == 5
        for a, b in zip(names, names[1:]):
            assert f"VAR {b} = VAR {a}" in text
        # the chain starts at the depth and spreads to the filler's end, in order
        at = [text.index(f"VAR {n} =") for n in names]
        assert at == sorted(at) and at[-1] - at[0] > 800  # 4/5 of the filler after the depth
        assert text.endswith(f"5 variables are assigned the value {value}, they are: ")
    else:
        asked = re.search(r"special magic numbers? for (\S+) mentioned", text.split("\nWhat")[-1]).group(1)
        for value in ctx.answers:
            assert f"One of the special magic numbers for {asked} is: {value}." in text
        keys = set(re.findall(r"One of the special magic numbers for (\S+) is", text))
        assert len(keys) == {"niah_single": 1, "niah_multikey": 4, "niah_multivalue": 1}[task]
        assert len(ctx.answers) == (4 if task == "niah_multivalue" else 1)
        assert text.endswith("mentioned in the provided text is" if len(ctx.answers) == 1 else "text are")


def test_the_same_needles_at_every_depth_and_the_depth_moves_them():
    cfg = load_config(None, ["eval.lengths=2048", "eval.max_len=2048", "eval.depths=3", "eval.needles=2",
                             "eval.generated=all", "eval.task=text", "eval.tokenizer=bytes"])  # fmt: skip
    plan = make_plan(cfg, ModelConfig(vocab_size=257), 1, 1)
    builder = NeedleBuilder(plan)
    for task in plan.generated:
        ctxs = [builder.generated_context(task, 2048, d, 0) for d in plan.depths]
        assert len({c.answers for c in ctxs}) == 1
        assert [c.first_insert for c in ctxs] == sorted(c.first_insert for c in ctxs)
        assert all(c.length == 2048 and len(c.tokens) == 2048 - plan.generated_tokens[task] for c in ctxs)


def test_recall_prompts_end_with_the_asked_key_s_query():
    fmt = RecallFormat(keys=8, values=8, filler=16)
    prompt = recall_prompt(fmt, "niah_multikey", random.Random(0), 4)
    ctx = place(prompt, fmt.filler_tokens(1), 64, 0.5, "niah_multikey", 0)
    query0 = 16 + 8 * 8
    (query,) = prompt.tail
    key = query - query0
    facts = [t for t in ctx.tokens if 16 <= t < query0]
    assert len(facts) == 4
    value = next((t - 16) % 8 for t in facts if (t - 16) // 8 == key)
    assert ctx.answers == (str(query0 + 8 + value),)


def test_scores_are_ruler_string_match_all():
    assert score(("1234567",), "The number is 1234567.") == 1.0
    assert score(("ABCDE", "FGHIJ"), "they are: abcde, KLMNO") == 0.5
    assert score(("1234567",), "123456") == 0.0


@pytest.mark.parametrize("value,message", [
    ("vt", "unknown task 'vt' (a model of the recall task's ids has the niah tasks only)"),
    ("niah_other", "unknown task 'niah_other'"),
])  # fmt: skip
def test_bad_generated_tasks_are_refused(value, message):
    cfg = load_config(None, [f"eval.generated={value}", "eval.task=recall", "eval.lengths=64"])
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_plan(cfg, ModelConfig(), 1, 1)


def test_no_room_for_the_answer_is_refused():
    cfg = load_config(None, ["eval.generated=niah_single", "eval.task=text", "eval.tokenizer=bytes",
                             "eval.lengths=1024", "eval.max_len=1024", "eval.needles=1",
                             "eval.generated_tokens=800"])  # fmt: skip
    with pytest.raises(ConfigError, match="eval.generated niah_single: its needles, question and 800 new tokens"):
        make_plan(cfg, ModelConfig(vocab_size=257), 1, 1)


def _run_generated(folder: str, config: dict, tokenizer: str) -> list:
    from loongtrain.apply import parallelize
    from loongtrain.eval.runner import run_generated
    from loongtrain.hf.load import load_weights, read_folder
    from loongtrain.model import build_model

    from dist_pool import cached_state

    state = cached_state(**config)
    hf = read_folder(folder)
    model = build_model(hf.model)
    parallelize(model, state, zero="dp_sp")
    model.to_empty(device="cpu")
    load_weights(model, hf)
    cfg = load_config(None, [f"model.init_from={folder}", "eval.lengths=192", "eval.depths=2",
                             "eval.needles=2", "eval.generated=all", f"eval.tokenizer={tokenizer}",
                             "eval.generated_tokens=6", "eval.task=text"])  # fmt: skip
    plan = make_plan(cfg, hf.model, state.hp, state.cp)
    return [[(o.generated, o.score) for o in r.outcomes] for r in run_generated(model, state, plan)]


@pytest.mark.dist
def test_generated_tasks_give_the_same_outputs_on_one_and_four_ranks(dist_pool, tmp_path):
    pytest.importorskip("transformers")
    from hf_tiny import add_tokenizer, make_hf_model

    folder = make_hf_model("llama", tmp_path / "tiny", seed=3, max_position_embeddings=512, vocab_size=300)
    add_tokenizer(folder, 300)
    one = dist_pool(1).run(_run_generated, str(folder), {}, str(folder))[0]
    four = dist_pool(4).run(_run_generated, str(folder), {"hp": 2, "cp": 2}, str(folder))
    assert len(one) == 4 and all(len(task) == 2 for task in one)  # 4 tasks x 1 length x 2 depths
    assert all(rank == one for rank in four)
    assert all(np.isfinite(s) for task in one for _, s in task)
