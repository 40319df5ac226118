"""``loongtrain generate``: bad input refused in one line before any process starts (in
process), the command on 4 ranks equal to transformers' ``generate``, and Ctrl-C during
decoding ending every process with one line."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pytest
import torch

from fault_tools import Job, alive
from loongtrain.config import ConfigError

from hf_tiny import add_tokenizer, make_hf_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama with a word-level tokenizer (w3 .. w95) and a 64-token context."""
    folder = make_hf_model("llama", tmp_path_factory.mktemp("gen") / "tiny", seed=5)
    add_tokenizer(folder, 96)
    return folder


def _args(target, *extra: str) -> tuple[argparse.Namespace, list[str]]:
    from loongtrain.generate.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_known_args([str(target), *extra])


def _prepare(target, *extra: str, world: int = 1):
    from loongtrain.generate.cli import prepare

    if "--max-new-tokens" not in extra:
        extra = (*extra, "--max-new-tokens", "8")
    args, rest = _args(target, *extra)
    return prepare(args, rest, world, world)


def test_prompts_are_encoded_as_transformers_encodes_them(tiny):
    from transformers import AutoTokenizer

    job = _prepare(tiny, "--prompt", "w5 w6 w7", "--prompt-ids", "9 10 11", "--max-new-tokens", "4")
    assert job.prompts == (tuple(AutoTokenizer.from_pretrained(tiny)("w5 w6 w7")["input_ids"]), (9, 10, 11))
    assert 2 in job.sampling.stop_ids  # the tokenizer's </s>
    assert 2 not in _prepare(tiny, "--prompt", "w5", "--ignore-eos", "--max-new-tokens", "4").sampling.stop_ids


@pytest.mark.parametrize("extra,message", [
    (["--prompt", "w5 w6 w7", "--max-new-tokens", "62"],
     "prompt 0 has 3 tokens and --max-new-tokens 62 asks for 65 positions, beyond the model's context of 64 "
     "(no RoPE scaling); shorten it, lower --max-new-tokens, or extend the context"),
    (["--prompt-ids", "1 2 96"], "prompt 0 has token id(s) [96] outside the model's vocabulary of 96"),
    ([], "no prompt: give --prompt TEXT, --prompts FILE or --prompt-ids"),
    (["--prompt", "w5", "--chat"], "has no chat template; drop --chat or use a chat model"),
    (["--prompt", "w5", "--parallel.hp", "3"], "does not fit"),
    (["--prompt", "w5", "--max-new-tokens", "0"], "max_new_tokens=0 must be a positive integer"),
])  # fmt: skip
def test_bad_input_is_refused_before_any_process(tiny, extra, message):
    with pytest.raises((ConfigError, ValueError)) as caught:
        _prepare(tiny, *extra, world=3 if "3" in extra else 1)
    assert message in str(caught.value)


def test_stop_strings_cut_the_completion(tiny):
    from loongtrain.generate.cli import cut_at_stop

    job = _prepare(tiny, "--prompt", "w5", "--stop", "w7 w8", "--stop", "\n\n", "--stop", "17")
    assert job.stop_strings == ("w7 w8", "\n\n") and 17 in job.sampling.stop_ids
    assert cut_at_stop("w1 w2 w7 w8 w9\n\nx", job.stop_strings) == ("w1 w2 ", True)
    assert cut_at_stop("w1 w2", job.stop_strings) == ("w1 w2", False)


def test_a_folder_without_a_tokenizer_needs_one_for_text(tmp_path, tiny):
    bare = make_hf_model("llama", tmp_path / "bare", seed=5)
    with pytest.raises(ConfigError, match="has no tokenizer .* pass --tokenizer FOLDER, or the prompts as --prompt-"):
        _prepare(bare, "--prompt", "w5")
    assert _prepare(bare, "--prompt", "w5", "--tokenizer", str(tiny)).prompts
    assert _prepare(bare, "--prompt-ids", "5 6").prompts == ((5, 6),)


def test_a_cache_larger_than_the_memory_is_refused(tiny, monkeypatch):
    import loongtrain.generate.cli as gen_cli

    monkeypatch.setattr(gen_cli, "device_memory_bytes", lambda device, local: (200_000, "test memory"))
    with pytest.raises(ConfigError, match=r"the K/V cache of 2 prompt\(s\) and 40 new tokens each needs .* than the "
                                          r"0.00 GiB of test memory; lower --max-new-tokens"):  # fmt: skip
        _prepare(tiny, "--prompt", "w5 w6", "--prompt", "w7", "--max-new-tokens", "40")


def _hf_greedy(folder, prompt: list[int], new: int) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                         pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.e2e
def test_the_command_on_four_ranks_generates_as_transformers(tiny, tmp_path):
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "loongtrain", "generate", str(tiny), "--prompt", "w5 w6 w7", "--prompt",
           "w10 w11 w12 w13 w14 w15 w16 w17 w18", "--max-new-tokens", "10", "--ignore-eos", "--nproc", "4",
           "--parallel.cp", "4", "--parallel.ring_window", "2", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    for record, prompt in zip(records, ("w5 w6 w7", "w10 w11 w12 w13 w14 w15 w16 w17 w18")):
        assert record["tokens"] == _hf_greedy(tiny, tok(prompt)["input_ids"], 10)
        assert f"[{record['prompt']}] {record['completion']}" in done.stdout
    assert "prefill 12 tokens in" in done.stdout and "tokens/s), decode 20 tokens in" in done.stdout


@pytest.mark.e2e
def test_ctrl_c_during_decoding_ends_every_process_in_one_line(tmp_path):
    folder = make_hf_model("llama", tmp_path / "long", seed=5, max_position_embeddings=1 << 20)
    add_tokenizer(folder, 96)
    job = Job([sys.executable, "-m", "loongtrain", "generate", str(folder), "--prompt", "w5 w6", "--ignore-eos",
               "--max-new-tokens", "200000", "--nproc", "2", "--parallel.cp", "2"], tmp_path / "log")  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(job.workers()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = list(job.workers().values())
        assert len(workers) == 2
        time.sleep(4)  # well into decoding (200,000 steps take minutes)
        t0 = time.monotonic()
        for pid in [job.proc.pid, *workers]:  # what a terminal's Ctrl-C does: every process of the job
            subprocess.run(["kill", "-INT", str(pid)], check=False)
        done = job.wait(since=t0, timeout=60)
    finally:
        job.kill()
    assert done.returncode == 130, done.stderr
    assert done.stderr_lines() == ["loongtrain generate: interrupted: every process was ended; nothing was written"]
    assert done.seconds < 15
    assert not any(alive(pid) for pid in workers)
