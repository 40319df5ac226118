"""No silent mistakes on the fine-tuning path: what `loongtrain train` refuses (or notes) in
one line before any process starts, checked by calling ``preflight`` in this process; the
launcher's handling of failures on bad input; what `loongtrain export` says and verifies;
Ctrl-C at any moment of `loongtrain train`."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fault_tools import SMALL, Job, alive
from loongtrain.config import ConfigError, load_config
from loongtrain.data import TokenFileError, folder_tokenizer_fingerprint, write_tokens
from loongtrain.data.tokens import DOC_START, TARGET
from loongtrain.train.faults import FATAL, WorkerReport, input_error_cause
from loongtrain.train.preflight import preflight
from loongtrain.train.report import Reporter
from loongtrain.train.run_folder import discard_new_run, start_run

pytest.importorskip("transformers")

from hf_tiny import add_tokenizer, make_hf_model  # noqa: E402 - needs transformers


def _chat_file(
    path: Path, vocab: int, fingerprint: int | None, eos: int | None = 2, n: int = 4000, ids_below: int = 0
) -> Path:
    """A token file of short chats made with a tokenizer of ``vocab`` tokens (ids below
    ``ids_below`` if given): every fourth token a target, a document every 50."""
    ids = np.random.default_rng(0).integers(3, ids_below or vocab, n)
    flags = np.where(np.arange(n) % 4 == 0, TARGET, 0).astype(np.uint8)
    flags[::50] |= DOC_START
    write_tokens(path, ids, vocab, eos=eos, flags=flags, fingerprint=fingerprint)
    return path


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """A tiny HF Llama (vocabulary 96, pretrained context 64) with a tokenizer of 96 tokens."""
    folder = make_hf_model("llama", tmp_path_factory.mktemp("hf") / "model")
    add_tokenizer(folder, 96)
    return folder


def _tokens_cfg(tmp_path: Path, data: Path, *overrides: str):
    return load_config(
        None,
        [f"run.output_dir={tmp_path / 'runs' / 'run'}", "data.source=tokens", f"data.path={data}",
         "data.seq_len=64", "data.pack=true", *overrides],
    )  # fmt: skip


def test_token_file_of_another_tokenizer_is_refused(tmp_path, model_folder):
    other = tmp_path / "other"
    add_tokenizer(other, 90)  # another vocabulary: another fingerprint
    data = _chat_file(tmp_path / "chat.tok", 90, folder_tokenizer_fingerprint(other))
    with pytest.raises(TokenFileError) as info:
        preflight(_tokens_cfg(tmp_path, data, f"model.init_from={model_folder}"), 1)
    line = str(info.value)
    print(f"\n{line}")
    assert line.startswith(f"{data} was made with another tokenizer than {model_folder}: the file's has fingerprint ")
    assert "vocabulary 90" in line and "vocabulary 96" in line and "\n" not in line
    assert f"loongtrain prepare --tokenizer {model_folder}" in line
    assert not (tmp_path / "runs").exists(), "nothing is left behind"

    same = _chat_file(tmp_path / "same.tok", 96, folder_tokenizer_fingerprint(model_folder))
    spec = preflight(_tokens_cfg(tmp_path, same, f"model.init_from={model_folder}"), 1)
    assert spec.notices == ()
    assert not (tmp_path / "runs").exists(), "preflight's write probe leaves no folder"

    unchecked = _chat_file(tmp_path / "old.tok", 96, None)  # no fingerprint recorded: a notice, not silence
    (notice,) = preflight(_tokens_cfg(tmp_path, unchecked, f"model.init_from={model_folder}"), 1).notices
    assert "records no tokenizer fingerprint" in notice and str(model_folder) in notice


def test_token_file_of_a_larger_tokenizer_is_refused_for_a_preset(tmp_path):
    data = _chat_file(tmp_path / "bytes.tok", 257, 1234, eos=256, ids_below=200)  # a 257-token tokenizer's ids
    with pytest.raises(TokenFileError) as info:
        preflight(_tokens_cfg(tmp_path, data), 1)
    print(f"\n{info.value}")
    assert str(info.value) == (
        f"{data} was made with a tokenizer of 257 tokens, but the vocabulary of model.preset='debug' has 256; use "
        "the model's tokenizer (`loongtrain prepare --tokenizer ...`) or a model with model.vocab_size >= 257"
    )
    preflight(_tokens_cfg(tmp_path, data, "model.vocab_size=257"), 1)


def test_packing_takes_documents_from_the_flags_and_long_documents_is_a_key(tmp_path):
    data = _chat_file(tmp_path / "no-eos.tok", 256, None, eos=None)  # flags, but no end-of-document token
    preflight(_tokens_cfg(tmp_path, data), 1)
    with pytest.raises(ConfigError, match="data.long_documents='drop' applies to token files"):
        load_config(None, ["data.long_documents=drop"])
    with pytest.raises(ConfigError, match=r"data.long_documents='keep'; choose one of \['split', 'drop'\]"):
        load_config(None, ["data.source=tokens", f"data.path={data}", "data.long_documents=keep"])
    from loongtrain.train.spec import make_source

    flags = np.zeros(4000, dtype=np.uint8)
    flags[::4] |= TARGET
    flags[:2000:50] |= DOC_START  # 40 documents of 50 tokens, then 125 of 16
    flags[2000::16] |= DOC_START
    write_tokens(tmp_path / "mixed.tok", np.arange(4000) % 200, 256, flags=flags)
    source = make_source(_tokens_cfg(tmp_path, tmp_path / "mixed.tok", "data.seq_len=32", "data.long_documents=drop"))
    assert (source.dropped_documents, source.dropped_tokens) == (40, 2000)
    assert "long_documents=drop left out 40 document(s) (2,000 tokens) longer than 32" in source.describe()


def test_training_beyond_the_pretrained_context_needs_rope_scaling(tmp_path, model_folder):
    base = [f"run.output_dir={tmp_path / 'run'}", f"model.init_from={model_folder}", "data.seq_len=128"]
    with pytest.raises(ConfigError) as info:
        preflight(load_config(None, base), 1)
    print(f"\n{info.value}")
    assert str(info.value) == (
        f"data.seq_len=128 is longer than the context of {model_folder}: {model_folder} was pretrained for 64 "
        "tokens (max_position_embeddings) and model.rope_scaling='keep' keeps its RoPE; extend it with "
        'model.rope_scaling = "yarn" (or linear, llama3) and model.rope_factor = 2, or set '
        "model.allow_longer_context = true to train beyond it as it is"
    )
    with pytest.raises(ConfigError, match="model.rope_scaling='linear' with model.rope_factor=1.5 reaches 96 tokens"):
        preflight(load_config(None, [*base, "model.rope_scaling=linear", "model.rope_factor=1.5"]), 1)
    assert preflight(load_config(None, [*base, "model.rope_scaling=yarn", "model.rope_factor=2"]), 1).notices == ()
    assert preflight(load_config(None, [*base, "model.rope_theta=40000"]), 1).notices == ()  # a larger base
    (notice,) = preflight(load_config(None, [*base, "model.allow_longer_context=true"]), 1).notices
    assert notice == (
        "training at data.seq_len=128, beyond the 64 tokens the model's RoPE reaches "
        "(model.allow_longer_context = true)"
    )
    preflight(load_config(None, ["data.seq_len=4096"]), 1)  # a preset has no pretrained context


def test_failures_on_bad_input_name_no_resume_and_leave_no_run_folder(tmp_path):
    reports = [WorkerReport(0, FATAL, "bad token file", input_error=True), WorkerReport(1, "comm", "lost")]
    assert input_error_cause(reports) and not input_error_cause(reports, attempt=1)
    assert not input_error_cause([WorkerReport(0, FATAL, "checkpoint damaged")])
    fresh = tmp_path / "fresh"
    start_run(fresh, resume=True)
    discard_new_run(fresh, existed=False)
    assert not fresh.exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "data.tok").write_text("the user's")
    start_run(mine, resume=True)
    (mine / "config.toml").write_text("")
    discard_new_run(mine, existed=True)
    assert sorted(p.name for p in mine.iterdir()) == ["data.tok"]


def test_periodic_evaluations_reach_the_console_and_tensorboard_is_on(tmp_path, capsys):
    reporter = Reporter(
        tmp_path, enabled=True, total_steps=20, log_every=5, first_step=0, tensorboard=True, progress="off"
    )
    reporter.evaluation(10, 2.5, 0.25)
    assert capsys.readouterr().out == "step    10/20 held-out loss 2.5000 acc 0.250\n"
    assert reporter.tensorboard_status == f"TensorBoard logs in {tmp_path / 'tensorboard'}"  # installed by setup.sh
    reporter.close()
    off = Reporter(tmp_path, enabled=True, total_steps=2, log_every=1, first_step=0, tensorboard=False, progress="off")
    assert off.tensorboard_status == "off (run.tensorboard = false)"
    off.close()


# -- export --------------------------------------------------------------------------------


def _checkpoints_with_a_window(folder: str, run_dir: str) -> None:
    """The trainer's import of a Llama with a sliding window set by the run, two checkpoints."""
    import dataclasses

    from loongtrain.apply import parallelize
    from loongtrain.config import ModelSection
    from loongtrain.model import build_model
    from loongtrain.train.checkpoint import CheckpointManager
    from loongtrain.train.model_setup import init_weights, model_config_for

    from dist_pool import cached_state

    state = cached_state(cp=2)
    cfg = model_config_for(ModelSection(init_from=folder, sliding_window=5))
    model = build_model(cfg)
    parallelize(model, state, zero="dp_sp")
    init_weights(model, torch.device("cpu"), folder, run_dir, seed=0)
    optimizer = torch.optim.AdamW(model.parameters())
    manager = CheckpointManager(Path(run_dir) / "checkpoints", 2)
    for step in (1, 2):
        manager.save(step, model, optimizer, {"model_shape": dataclasses.asdict(cfg)})
    if state.rank == 0:
        (Path(run_dir) / "config.toml").write_text("[data]\nseq_len = 128\n")  # trained beyond the 64 of the source


@pytest.mark.dist
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_takes_a_run_folder_verifies_checksums_and_says_when_it_changes_the_family(
    dist_pool, tmp_path, model_folder
):
    from loongtrain.hf.folder import HFFormatError
    from loongtrain.train.export import export_checkpoint

    run = tmp_path / "run"
    dist_pool(2).run(_checkpoints_with_a_window, str(model_folder), str(run))
    said: list[str] = []
    result = export_checkpoint(run, tmp_path / "out", say=said.append)
    assert result.checkpoint == run / "checkpoints" / "step-2"
    assert said == [
        'writing "model_type": "mistral" (the source is "llama"): the run trained with a sliding window of 5 tokens '
        "and Llama's config has no sliding window (Mistral is Llama with one)"
    ]
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "mistral" and config["sliding_window"] == 5
    assert config["max_position_embeddings"] == 128, "the context the run trained at (the source's is 64)"

    step2 = run / "checkpoints" / "step-2"
    shard = sorted(step2.glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, another checksum
    shard.write_bytes(bytes(data))
    with pytest.raises(HFFormatError) as info:
        export_checkpoint(step2, tmp_path / "out2", say=said.append)
    print(f"\n{info.value}")
    assert str(info.value).startswith(f"checkpoint {step2} is damaged: file {shard.name} does not match its checksum")
    assert not (tmp_path / "out2").exists()
    said.clear()
    assert export_checkpoint(run, tmp_path / "out3", say=said.append).checkpoint.name == "step-1"
    assert said[0] == (
        f"checkpoint {step2} is damaged (file {shard.name} does not match its checksum (corrupted)); trying an "
        "older one"
    )
    assert step2.is_dir(), "export only reads"


# -- Ctrl-C --------------------------------------------------------------------------------


def _interrupt(tmp_path: Path, name: str, when) -> tuple[int, list[str], float]:
    """Start a 2-process training, wait for ``when(job)``, Ctrl-C the terminal's process group;
    returns (exit code, stderr lines, seconds from the Ctrl-C to the end of every process)."""
    run = tmp_path / name
    args = ["--nproc", "2", *SMALL, "--run.steps", "1000", "--run.output_dir", str(run)]
    job = Job.train(args, tmp_path / f"{name}-log")
    try:
        when(job, run)
        workers = list(job.workers().values())
        t0 = time.monotonic()
        os.killpg(job.proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        done = job.wait(since=t0, timeout=60)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in workers), "every worker ended"
    finally:
        job.kill()
    return done.returncode, done.stderr_lines(), done.seconds


def _when_workers_exist(job: Job, run: Path) -> None:
    deadline = time.monotonic() + 120
    while not job.workers() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # they are importing torch and loongtrain


@pytest.mark.e2e
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds workers through /proc")
def test_ctrl_c_at_any_moment_prints_one_line(tmp_path):
    moments = {
        "launcher starting": lambda job, run: time.sleep(0.5),
        "workers importing": _when_workers_exist,
        "training": lambda job, run: job.wait_for_step(run, 1),
    }
    for name, when in moments.items():
        code, lines, seconds = _interrupt(tmp_path, name.replace(" ", "-"), when)
        print(f"\n[{name}] exit {code} after {seconds:.1f} s: {lines}")
        # 130, or ended by the SIGINT itself (-2): the shell shows 130 for either
        assert code in (130, -signal.SIGINT) and len(lines) == 1, (name, code, lines)
        assert lines[0].startswith(("loongtrain train: stopped by SIGINT", "loongtrain train: interrupted")), lines
