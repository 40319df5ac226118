"""The ``loongtrain`` model type of lm-evaluation-harness on 4 ranks against lm-eval's own
``hf`` model type, on the same weights and custom tasks over local JSONL (nothing downloaded):
``loglikelihood`` (multiple choice), ``loglikelihood_rolling`` (perplexity over texts longer
than the context: several windows) and ``generate_until`` (a stop string: a space, so each
answer is the first generated word). Needs the optional
``lm-eval`` extra (``pip install -e '.[lm-eval]'``); skipped without it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

pytestmark = pytest.mark.e2e

TASKS = {
    "lt_mc": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
             "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
    "lt_gen": "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
              "generation_kwargs:\n  until: [' ']\n  max_gen_toks: 8\n  do_sample: false\n"
              "metric_list:\n  - metric: exact_match\n",
    "lt_ppl": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
              "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n",
}  # fmt: skip


def _files(root: Path) -> None:
    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(3, 96)}" for _ in range(n))

    records = {
        "lt_mc": [{"question": words(rng.randrange(5, 30)), "choices": [words(3), words(2), words(4)],
                   "label": rng.randrange(3)} for _ in range(10)],
        "lt_gen": [{"prompt": words(rng.randrange(5, 20)), "answer": words(2)} for _ in range(5)],
        "lt_ppl": [{"text": words(rng.randrange(100, 400))} for _ in range(3)],  # the context is 256 tokens
    }  # fmt: skip
    (root / "tasks").mkdir()
    for name, rows in records.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / name}.jsonl\n"
        (root / "tasks" / f"{name}.yaml").write_text(head + "test_split: test\n" + TASKS[name])


def _evaluate(model: str, args: dict, root: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    import loongtrain.tools.lm_eval_model  # noqa: F401 - registers the loongtrain model type

    manager = TaskManager(include_path=str(root / "tasks"))
    return lm_eval.simple_evaluate(model=model, model_args=args, tasks=list(TASKS), task_manager=manager,
                                   log_samples=True, device="cpu")  # fmt: skip


def test_the_loongtrain_model_type_on_four_ranks_scores_as_hf(tmp_path):
    from hf_tiny import add_tokenizer, make_hf_model

    folder = make_hf_model("llama", tmp_path / "tiny", seed=5, max_position_embeddings=256)
    add_tokenizer(folder, 96)
    _files(tmp_path)
    hf = _evaluate("hf", {"pretrained": str(folder), "dtype": "float32"}, tmp_path)
    ours = _evaluate("loongtrain", {"path": str(folder), "nproc": 4, "hp": 2, "cp": 2}, tmp_path)
    for task in TASKS:
        ref, got = hf["samples"][task], ours["samples"][task]
        assert len(ref) == len(got) > 0
        for a, b in zip(ref, got):
            if task == "lt_gen":
                assert b["resps"] == a["resps"], (a["resps"], b["resps"])
                continue
            for (ra,), (rb,) in zip(a["resps"], b["resps"]):
                la, lb = (ra[0], rb[0]) if isinstance(ra, tuple | list) else (ra, rb)
                assert abs(la - lb) <= 1e-5 * abs(la), f"{task}: loglikelihood {lb} vs hf {la}"
                if isinstance(ra, tuple | list):
                    assert ra[1] == rb[1]  # is_greedy
    for task, metrics in hf["results"].items():
        for key, value in metrics.items():
            if isinstance(value, float):
                assert ours["results"][task][key] == pytest.approx(value, rel=1e-5), (task, key)
    texts = [s["resps"][0][0] for s in ours["samples"]["lt_gen"]]
    assert all(t and " " not in t for t in texts)  # cut at the stop string (a space): one word each


def test_an_unsupported_generation_request_is_refused_before_any_rank_starts(tmp_path):
    from lm_eval.api.instance import Instance

    from loongtrain.config import ConfigError
    from loongtrain.tools.lm_eval_model import LoongtrainLM

    from hf_tiny import add_tokenizer, make_hf_model

    folder = make_hf_model("llama", tmp_path / "tiny", seed=5, max_position_embeddings=256)
    add_tokenizer(folder, 96)
    lm = LoongtrainLM(path=str(folder), nproc=4, cp=4)

    def request(**gen_kwargs) -> Instance:
        return Instance("generate_until", {}, ("w3 w4", {"until": [" "], **gen_kwargs}), 0)

    with pytest.raises(ConfigError, match=r"does not support \['num_beams'\]"):
        lm.generate_until([request(), request(num_beams=4)])  # the good one first: nothing runs
    with pytest.raises(ConfigError, match="top_p=0.0"):
        lm.generate_until([request(do_sample=True, temperature=1.0, top_p=0.0)])
    assert lm._server is None  # no rank was started
