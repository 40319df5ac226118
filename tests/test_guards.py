"""The trainer never trains on bad numbers (``[guard]``, :mod:`loongtrain.train.guard`).

Unit: the spike rule against statistics computed here, the verdicts, the parameter digest,
which ranks are replicas, which samples a microbatch holds (read from the loader itself).
On two gloo ranks, each fault injected for real and the outcome checked against a run that
never met it: a learning rate so large that the loss overflows (stop; skip), a spike made by
corrupting the data under a resumed run (rollback: equal to a run that never saw those
batches), a replica whose weights were altered, a checkpoint holding a NaN.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from loongtrain.config import ConfigError, load_config
from loongtrain.options import GuardOptions
from loongtrain.train.guard import (
    GuardStop,
    SpikeDetector,
    StepGuard,
    microbatch_samples,
    parameter_digest,
    replica_groups,
)

# -- unit ------------------------------------------------------------------------------------


def test_the_spike_threshold_is_mean_plus_k_sd_of_the_window():
    rng = np.random.default_rng(0)
    losses = list(3.0 + 0.1 * rng.standard_normal(40))
    det = SpikeDetector(window=16, sigma=4.0, min_history=10)
    for step, loss in enumerate(losses[:9], 1):
        det.add(step, loss)
        assert det.threshold() is None  # no history yet: nothing is a spike
    for step, loss in enumerate(losses[9:], 10):
        det.add(step, loss)
    window = np.array(losses[-16:])
    assert det.threshold() == pytest.approx(window.mean() + 4.0 * window.std(), rel=1e-12)
    det.forget_after(36)  # a rollback to step 36: the window (steps 25..40) keeps 25..36
    kept = np.array(losses[24:36])
    assert [s for s, _ in det.history] == list(range(25, 37))
    assert det.threshold() == pytest.approx(kept.mean() + 4.0 * kept.std(), rel=1e-12)
    det.forget_after(30)
    assert det.threshold() is None  # 6 steps left, fewer than min_history


def test_a_flat_loss_needs_a_real_rise_to_be_a_spike():
    det = SpikeDetector(window=8, sigma=6.0, min_history=4)
    for step in range(1, 9):
        det.add(step, 2.0)
    assert det.threshold() == pytest.approx(2.0 * 1.02)  # sd 0: the 2% floor


@pytest.mark.parametrize("spike", ["off", "warn", "skip", "rollback"])
def test_verdicts(spike):
    guard = StepGuard(GuardOptions(spike=spike, spike_window=8, spike_min_history=4, max_skips=2))
    for step in range(1, 5):
        verdict = guard.judge(2.0 + 0.01 * step, 1.0)
        assert verdict.applied
        guard.record(step, 2.0 + 0.01 * step, verdict)
    big = guard.judge(9.0, 1.0)
    assert (big.action, big.reason) == {
        "off": ("apply", ""), "warn": ("apply", "spike"), "skip": ("skip", "spike"), "rollback": ("rollback", "spike"),
    }[spike]  # fmt: skip
    assert guard.judge(2.03, 1.0).applied  # a normal loss is applied under every policy
    nan = guard.judge(math.nan, 1.0)
    assert (nan.action, nan.reason) == ("stop", "loss")
    assert guard.judge(2.0, math.inf).reason == "gradients"


def test_skips_in_a_row_are_bounded():
    guard = StepGuard(GuardOptions(nonfinite="skip", max_skips=2))
    actions = []
    for step in range(1, 5):
        verdict = guard.judge(math.nan, math.nan)
        actions.append(verdict.action)
        guard.record(step, math.nan, verdict)
    assert actions == ["skip", "skip", "stop", "stop"]
    guard.record(5, 2.0, guard.judge(2.0, 1.0))
    assert guard.judge(math.inf, 1.0).action == "skip"  # an applied step resets the count


def test_guard_options_are_checked_in_the_config():
    assert load_config(None, ["guard.spike=rollback"]).guard.options().spike == "rollback"
    with pytest.raises(ConfigError, match=r"guard.spike='sometimes'; choose one of"):
        load_config(None, ["guard.spike=sometimes"])
    with pytest.raises(ConfigError, match="spike_min_history=200 exceeds spike_window=128"):
        load_config(None, ["guard.spike_min_history=200"])
    with pytest.raises(ConfigError, match="guard.spike_sigma=0.0 must be positive"):
        load_config(None, ["guard.spike_sigma=0"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_digest_changes_with_any_one_element(dtype):
    x = torch.randn(1000, dtype=torch.float64).to(dtype)
    base = parameter_digest(x)
    assert parameter_digest(x.clone()) == base
    for i in (0, 1, 500, 999):
        y = x.clone()
        y[i] = torch.nextafter(y[i].float(), torch.tensor(math.inf)).to(dtype) if dtype == torch.float32 else -y[i]
        assert parameter_digest(y) != base, i
    swapped = x.clone()
    swapped[[3, 4]] = x[[4, 3]]
    assert x[3] != x[4] and parameter_digest(swapped) != base  # positions count, not just values


def test_the_digest_is_the_same_in_chunks(monkeypatch):
    import loongtrain.train.guard as guard

    x = torch.randn(10_000)
    whole = parameter_digest(x)
    monkeypatch.setattr(guard, "DIGEST_CHUNK", 777)
    assert parameter_digest(x) == whole


def test_replica_groups_are_the_ranks_holding_the_same_shard():
    # 8 ranks, dp = 2 replicas of sp = 4 (global rank = d * sp + local)
    assert replica_groups(8, 2, "dp_sp") == ()  # every rank a different shard
    assert replica_groups(8, 2, "sp") == ((0, 4), (1, 5), (2, 6), (3, 7))  # shards across sp, copies across dp
    assert replica_groups(8, 2, "dp") == ((0, 1, 2, 3), (4, 5, 6, 7))  # shards across dp, copies within sp
    assert replica_groups(8, 2, "none") == (tuple(range(8)),)


class _IndexSource:
    seq_len = 4

    def sample(self, index: int, split: str = "train"):
        return torch.full((4,), index), torch.full((4,), index)


def test_microbatch_samples_are_those_the_loader_hands_out():
    from loongtrain.data import BatchLoader

    gb, dp, micro = 12, 2, 3
    first = 5 * gb
    for m in range(micro):
        held = set()
        for d in range(dp):
            loader = BatchLoader(_IndexSource(), gb, micro, dp, d, next_index=first)
            held |= set(loader.next()[m].tokens[:, 0].tolist())
        assert held == set(microbatch_samples(first, m, dp, gb // (dp * micro)))


def test_nonfinite_init_from_weights_are_refused_before_spawning(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from loongtrain.train.preflight import preflight

    from hf_tiny import make_hf_model

    folder = make_hf_model("llama", tmp_path / "hf")
    shard = next(folder.glob("*.safetensors"))
    tensors = load_file(shard)
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = math.nan
    save_file(tensors, shard, metadata={"format": "pt"})
    overrides = [f"model.init_from={folder}", "data.seq_len=64", "data.recall_queries=8"]
    cfg = load_config(None, [*overrides, f"run.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"tensor model.layers.1.mlp.up_proj.weight holds 1 non-finite value"):
        preflight(cfg, 1)


# -- on two gloo ranks -----------------------------------------------------------------------

BASE = [
    "run.log_every=100", "run.eval_batches=1", "run.tensorboard=false", "run.progress=off", "data.seq_len=64",
    "data.global_batch=4", "data.recall_queries=8", "optim.warmup_steps=0", "memory.activation_checkpoint=none",
    "checkpoint.keep=20",
]  # fmt: skip
_CAPTURED: dict[int, dict] = {}


def _full_state(run) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(run.model, options=options),
        "optim": get_optimizer_state_dict(run.model, run.optimizer, options=options),
    }


def _capture(run, done, reporter, beat) -> None:
    import copy

    if done:  # (before the first step, reading the optimizer's state would initialise it with a step)
        _CAPTURED[done] = copy.deepcopy(_full_state(run))  # CPU tensors are returned as they are: copy them


def _poison_before_save(run, done, reporter, beat) -> None:
    if done == 1:
        with torch.no_grad():
            weight = dict(run.model.named_parameters())["layers.1.attention.wo.weight"]
            (weight.to_local() if hasattr(weight, "to_local") else weight).fill_(math.nan)


def _alter_one_replica(run, done, reporter, beat) -> None:
    if done == 1 and torch.distributed.get_rank() == 1:
        with torch.no_grad():
            weight = dict(run.model.named_parameters())["layers.0.feed_forward.w3.weight"]
            (weight.to_local() if hasattr(weight, "to_local") else weight).view(-1)[7] += 1e-3


def _poison_moment_before_save(run, done, reporter, beat) -> None:
    if done == 2:
        norm = dict(run.model.named_parameters())["norm.weight"]
        moment = run.optimizer.state[norm]["exp_avg_sq"]
        with torch.no_grad():
            (moment.to_local() if hasattr(moment, "to_local") else moment).fill_(math.nan)


def _poison_weight_at_2(run, done, reporter, beat) -> None:
    if done == 2:
        _poison_before_save(run, 1, reporter, beat)





def _train(overrides: list[str], hook: str | None = None) -> dict:
    """Train on this rank; the losses and, if the guard stopped it, its message."""
    import contextlib
    import io

    from loongtrain.train.checkpoint import CheckpointError
    from loongtrain.train.trainer import preflight, train

    _CAPTURED.clear()
    cfg = load_config(None, BASE + overrides)
    spec = preflight(cfg, torch.distributed.get_world_size())
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            result = train(torch.device("cpu"), cfg, spec, after_step=_HOOKS.get(hook))
        out = {"losses": result.losses, "stopped": None}
    except (GuardStop, CheckpointError) as e:
        out = {"losses": None, "stopped": f"{type(e).__name__}: {e}"}
    print(said.getvalue(), end="")
    out["captured"] = dict(_CAPTURED) if torch.distributed.get_rank() == 0 else None
    out["said"] = said.getvalue()  # what rank 0 printed
    return out


def _checkpoint_tensors(folder: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, folder.parent / f"{folder.name}.pt")
    return torch.load(folder.parent / f"{folder.name}.pt", weights_only=False)


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flat(value, f"{prefix}{key}/")
    elif isinstance(tree, torch.Tensor):
        yield prefix, tree


def _bit_equal(a: dict, b: dict) -> bool:
    fa, fb = dict(_flat(a)), dict(_flat(b))
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def _refuse(constant: str):
    raise ValueError(f"metrics.jsonl holds {constant}, which strict JSON parsers reject")


def _records(run_dir: Path) -> list[dict]:
    """``metrics.jsonl`` read as a strict parser (Node's JSON.parse) reads it: no NaN or Infinity."""
    return [json.loads(line, parse_constant=_refuse) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


#: the plain path, and a layout per microbatch on packed documents with every offload (sc++)
PATHS = {
    "plain": [],
    "per-batch-offload": [
        "parallel.cp=2", "parallel.layout=per_batch", "data.pack=true", "memory.activation_checkpoint=sc++",
        "memory.offload_activations=true", "memory.offload_states=true",
    ],
}  # fmt: skip


@pytest.mark.parametrize("path", PATHS)
def test_an_overflowing_loss_stops_before_anything_is_applied_or_saved(dist_pool, tmp_path, path):
    pool = dist_pool(2)
    run_dir = tmp_path / "run"
    common = ["optim.lr=1e30", *PATHS[path]]
    out = pool.run(_train, [*common, "run.steps=4", "checkpoint.every=1", f"run.output_dir={run_dir}"])
    message = out[0]["stopped"]
    print(message)
    assert message == out[1]["stopped"] and message.startswith("GuardStop: step 2: the ")
    what = r"the loss is nan in the step's only microbatch \(samples 4..7\)|the gradient norm is nan"
    assert re.search(what, message), message
    assert "first parameter with a non-finite gradient: tok_embeddings.weight" in message
    # step 2 trained from step 1's weights: step-1 produced the failure, so it is not called good, and it is
    # set aside so that the printed resume does not load it again
    assert "no good checkpoint was saved (step-1.failed holds the weights the failing step trained from" in message
    assert "start again after you lower optim.lr" in message
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-1.failed"]  # nothing from step 2
    assert [r["step"] for r in _records(run_dir) if r["kind"] == "train"] == [1]
    # the checkpoint set aside is the state after step 1, finite, as a run that stopped there saved it
    ref_dir = tmp_path / "ref"
    pool.run(_train, [*common, "run.steps=1", f"run.output_dir={ref_dir}"])
    saved = _checkpoint_tensors(run_dir / "checkpoints" / "step-1.failed")
    reference = _checkpoint_tensors(ref_dir / "checkpoints" / "step-1")
    assert all(torch.isfinite(t).all() for _, t in _flat(saved["model"]))
    assert _bit_equal(saved["model"], reference["model"]) and _bit_equal(saved["optim"], reference["optim"])


def test_skipped_steps_leave_weights_and_optimizer_untouched(dist_pool, tmp_path):
    # packed documents, two microbatches and sc++: the guard reads only what every path reduces
    pool = dist_pool(2)
    run_dir = tmp_path / "run"
    overrides = [
        "run.steps=6", "optim.lr=1e30", "guard.nonfinite=skip", "guard.max_skips=2", "data.pack=true",
        "data.micro_batches=2", "memory.activation_checkpoint=sc++", f"run.output_dir={run_dir}",
    ]  # fmt: skip
    out = pool.run(_train, overrides, "capture")[0]
    print(out["stopped"])
    assert out["stopped"].startswith("GuardStop: step 4: the loss is nan in microbatch 0 of 2 (samples 12..13)")
    assert "3 steps in a row would be skipped, more than guard.max_skips=2" in out["stopped"]
    assert "no checkpoint was saved yet: start again after you lower optim.lr" in out["stopped"]
    captured = out["captured"]
    assert sorted(captured) == [1, 2, 3]  # after_step ran after the good step and the two skipped ones
    assert _bit_equal(captured[2], captured[1]) and _bit_equal(captured[3], captured[1])
    assert int(captured[1]["optim"]["state"]["tok_embeddings.weight"]["step"]) == 1  # AdamW's count too
    records = [r for r in _records(run_dir) if r["kind"] == "train"]
    skipped = "skipped: non-finite loss"
    assert {r["step"]: r["guard"] for r in records} == {1: "", 2: skipped, 3: skipped}
    assert [r["loss"] is None for r in records] == [False, True, True]  # the NaN losses are null, strict JSON
    stop = _records(run_dir)[-1]  # the stop itself, for metrics.jsonl's readers and the tracked runs
    assert stop["kind"] == "stop" and stop["step"] == 3 and stop["message"].startswith("step 4: the loss is nan")


def _counting_tokens(path: Path, sequences: int, seq: int, seed: int = 0) -> None:
    """A learnable stream: each token is the previous plus one (mod 64), restarting at a random
    token every 16 to 48 tokens."""
    from loongtrain.data import write_tokens

    rng = np.random.default_rng(seed)
    out, n = [], sequences * seq + 1
    while sum(map(len, out)) < n:
        out.append((rng.integers(64) + np.arange(rng.integers(16, 48))) % 64)
    write_tokens(path, np.concatenate(out)[:n], vocab_size=64)


def _corrupt_samples(path: Path, indices: range, seq: int, seed: int) -> None:
    """Overwrite, in the token file, the sequences that these training samples read (found by
    their tokens) with random tokens: the model, trained to count, is far from them."""
    from loongtrain.data import TokenFile, TokenFileSource

    source = TokenFileSource(TokenFile(path), seq, seed)
    tokens = np.array(TokenFile(path).tokens)
    rng = np.random.default_rng(1)
    for index in indices:
        inputs, labels = source.sample(index)
        want = np.concatenate([inputs.numpy(), labels.numpy()[-1:]])
        windows = range(len(tokens) // seq)
        (start,) = [w * seq for w in windows if np.array_equal(tokens[w * seq : w * seq + seq + 1], want)]
        tokens[start + 1 : start + seq] = rng.integers(64, size=seq - 1)
    with open(path, "r+b") as f:
        f.seek(64)  # the header's size; the ids are uint16 (a vocabulary of 64)
        f.write(tokens.astype("<u2").tobytes())


def _move_data_position(checkpoint: Path, next_index: int) -> None:
    from loongtrain.train.checkpoint import CHECKSUM_FILE, STATE_FILE, file_sha256

    state = json.loads((checkpoint / STATE_FILE).read_text())
    state["data"]["next_index"] = next_index
    (checkpoint / STATE_FILE).write_text(json.dumps(state))
    sums = json.loads((checkpoint / CHECKSUM_FILE).read_text())
    written = checkpoint / STATE_FILE
    sums[STATE_FILE] = {"size": written.stat().st_size, "sha256": file_sha256(written)}
    (checkpoint / CHECKSUM_FILE).write_text(json.dumps(sums))


def test_a_spike_rolls_back_and_trains_as_a_run_that_never_saw_its_batch(dist_pool, tmp_path):
    pool = dist_pool(2)
    seq, gb, seed = 64, 4, 1234
    data = tmp_path / "count.tok"
    _counting_tokens(data, 100, seq)
    common = [
        "data.source=tokens", f"data.path={data}", f"data.seed={seed}", "checkpoint.every=1", "optim.lr=1e-2",
        "optim.min_lr_ratio=1",  # a constant learning rate: runs of other lengths share their steps
        "guard.spike=rollback", "guard.spike_window=3", "guard.spike_min_history=3", "guard.spike_sigma=3",
    ]  # fmt: skip
    run_dir, ref_dir = tmp_path / "run", tmp_path / "ref"
    pool.run(_train, [*common, "run.steps=6", f"run.output_dir={run_dir}"])
    _corrupt_samples(data, range(9 * gb, 10 * gb), seq, seed)  # the batch of step 10
    changed = "checkpoint.allow_data_change=true"  # the data changed under the run on purpose
    resumed = pool.run(_train, [*common, "run.steps=12", changed, f"run.output_dir={run_dir}"])[0]
    assert resumed["stopped"] is None, resumed["stopped"]
    rollback = [r for r in _records(run_dir) if r["kind"] == "rollback"]
    assert len(rollback) == 1, rollback
    assert rollback[0]["spike_step"] == 10 and rollback[0]["step"] == 9
    assert rollback[0]["skipped_samples"] == [9 * gb, 10 * gb]
    assert rollback[0]["loss"] > rollback[0]["threshold"]
    # the reference: trained to step 9 on the same data, its data position moved past step 10's batch
    pool.run(_train, [*common, "run.steps=9", f"run.output_dir={ref_dir}"])
    _move_data_position(ref_dir / "checkpoints" / "step-9", 10 * gb)
    reference = pool.run(_train, [*common, "run.steps=12", f"run.output_dir={ref_dir}"])[0]["losses"]
    print("after the rollback", resumed["losses"][-3:], "never saw the batch", reference)
    assert resumed["losses"][-3:] == reference  # steps 10, 11, 12 (bit-equal on CPU)
    steps = [r["step"] for r in _records(run_dir) if r["kind"] == "train"]
    assert steps == list(range(1, 13))  # the spiked step's record went with the rollback


def test_a_replica_that_disagrees_is_named(dist_pool, tmp_path):
    pool = dist_pool(2)  # zero=sp with dp=2: the two ranks hold the same copy
    overrides = ["run.steps=4", "parallel.zero=sp", "guard.replica_check_every=2", f"run.output_dir={tmp_path}"]
    out = pool.run(_train, overrides, "alter")[0]["stopped"]
    print(out)
    assert out.startswith("GuardStop: after step 2: parameter layers.0.feed_forward.w3.weight differs between ranks")
    assert "[0, 1]" in out


@pytest.mark.parametrize("where", ["weight", "moment"])
def test_a_checkpoint_of_nonfinite_values_is_never_written(dist_pool, tmp_path, where):
    # a NaN in a weight or in AdamW's second moment after step 2's update: step-2 is not written, the stop
    # names the tensor and step-1, from which the printed resume trains on
    pool = dist_pool(2)
    run_dir = tmp_path / "run"
    out = pool.run(_train, ["run.steps=3", "checkpoint.every=1", f"run.output_dir={run_dir}"], f"poison-{where}")
    stopped = out[0]["stopped"]
    print(stopped)
    tensor = {"weight": "layers.1.attention.wo.weight", "moment": "optimizer state exp_avg_sq of norm.weight"}[where]
    head = "GuardStop: after step 2: the update left non-finite values (NaN or infinity) in "
    assert stopped.startswith(f"{head}{tensor};")
    good = run_dir / "checkpoints" / "step-1"
    assert "checkpoint step-2 was not written (a checkpoint must be finite to be trusted); the last good " in stopped
    assert f"the last good checkpoint is {good}: resume from it after you lower optim.lr" in stopped
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-1"]
    resumed = pool.run(_train, ["run.steps=3", f"run.output_dir={run_dir}"])[0]
    assert resumed["stopped"] is None and len(resumed["losses"]) == 2  # steps 2 and 3 trained again


def _rewrite_checkpoint(folder: Path, edit) -> None:
    """Rewrite the DCP checkpoint ``folder`` with ``edit(state)`` applied to its full state (as a
    fault on disk would leave it), with checksums that match (so only the values are wrong)."""
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    from loongtrain.train.checkpoint import CHECKSUM_FILE, STATE_FILE, file_sha256

    state = _checkpoint_tensors(folder)
    edit(state)
    trainer_state = (folder / STATE_FILE).read_text()
    for path in folder.iterdir():
        path.unlink()
    torch.save(state, folder.parent / "edited.pt")
    torch_save_to_dcp(folder.parent / "edited.pt", folder)
    (folder.parent / "edited.pt").unlink()
    (folder / STATE_FILE).write_text(trainer_state)
    sums = {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in folder.iterdir()}
    (folder / CHECKSUM_FILE).write_text(json.dumps(sums))


def test_a_checkpoint_holding_a_nan_on_disk_is_set_aside_at_resume(dist_pool, tmp_path):
    pool = dist_pool(2)
    pool.run(_train, ["run.steps=2", "checkpoint.every=1", f"run.output_dir={tmp_path}"])
    step2 = tmp_path / "checkpoints" / "step-2"

    def poison(state):
        state["optim"]["state"]["layers.0.attention.wq.weight"]["exp_avg_sq"][0, 0] = math.inf

    _rewrite_checkpoint(step2, poison)
    stopped = pool.run(_train, ["run.steps=3", "checkpoint.on_damaged=stop", f"run.output_dir={tmp_path}"])[0]
    assert stopped["stopped"].startswith(f"CheckpointError: {step2} holds non-finite weights (NaN or infinity) in "
                                         "optimizer state exp_avg_sq of layers.0.attention.wq.weight")  # fmt: skip
    resumed = pool.run(_train, ["run.steps=3", f"run.output_dir={tmp_path}"])[0]
    assert resumed["stopped"] is None and len(resumed["losses"]) == 2  # from step-1: steps 2 and 3
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "step-2.nonfinite" in names and "step-3" in names


def test_finite_but_ruined_weights_never_become_the_last_good_checkpoint(dist_pool, tmp_path):
    # issue 56's case (its lr 1e38 is refused in preflight now; 3e37 is not): a huge learning rate on resume ruins
    # the weights at step 6 (finite), steps 7.. are not
    # finite and skipped; keep=2 must not lose step-4/step-5 to them, and the printed resume must train on
    pool = dist_pool(2)
    base = ["checkpoint.every=1", "checkpoint.keep=2", f"run.output_dir={tmp_path}"]
    pool.run(_train, [*base, "run.steps=5"])
    ruin = ["optim.lr=3e37", "guard.nonfinite=skip", "guard.max_skips=3", "run.steps=12"]
    stopped = pool.run(_train, [*base, *ruin])[0]["stopped"]
    print(stopped)
    assert stopped.startswith("GuardStop: step 10: the loss is nan"), stopped
    assert f"the last good checkpoint is {tmp_path / 'checkpoints' / 'step-5'} (step-6.failed holds the" in stopped
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-4", "step-5", "step-6.failed"], names  # no skipped step written, keep kept 4 and 5
    marks = {r["step"]: r["guard"] for r in _records(tmp_path) if r["kind"] == "train"}
    assert [marks[s] for s in (7, 8, 9)] == ["skipped: non-finite loss"] * 3
    resumed = pool.run(_train, [*base, "run.steps=7"])[0]  # the printed command, after lowering optim.lr
    assert resumed["stopped"] is None and len(resumed["losses"]) == 2 and all(map(math.isfinite, resumed["losses"]))


def _optimizer_settings(run, done, reporter, beat) -> None:
    from loongtrain.train.trainer import describe

    group = run.optimizer.param_groups[0]
    _CAPTURED[done] = {"betas": tuple(group["betas"]), "eps": group["eps"], "weight_decay": group["weight_decay"],
                       "describe": describe(run)}  # fmt: skip


def test_a_resume_applies_the_optimizer_settings_of_the_config(dist_pool, tmp_path):
    pool = dist_pool(2)
    pool.run(_train, ["run.steps=2", "checkpoint.every=1", f"run.output_dir={tmp_path}"])
    new = ["optim.weight_decay=0.5", "optim.beta2=0.5", "optim.eps=1e-3"]
    out = pool.run(_train, ["run.steps=3", *new, f"run.output_dir={tmp_path}"], "optimizer")[0]
    seen = out["captured"][3]
    assert seen["betas"] == (0.9, 0.5) and seen["eps"] == 1e-3 and seen["weight_decay"] == 0.5
    line = "optimizer settings from the config (the checkpoint held others): "
    assert line + "optim.beta2 0.95 -> 0.5, optim.eps 1e-08 -> 0.001, optim.weight_decay 0 -> 0.5" in seen["describe"]
    # a stage with init_optimizer: the same
    stage = ["run.steps=1", "checkpoint.init_optimizer=true", f"checkpoint.init_from={tmp_path}", *new,
             f"run.output_dir={tmp_path / 'stage'}"]  # fmt: skip
    seen = pool.run(_train, stage, "optimizer")[0]["captured"][1]
    assert seen["betas"] == (0.9, 0.5) and seen["eps"] == 1e-3 and seen["weight_decay"] == 0.5


def _gpu_check_row(lr: float) -> str:
    """A training row of the GPU check (``measure_training_step``) at a learning rate so large
    that the loss overflows: its error, or "" if it trained."""
    from loongtrain.config import OptimSection
    from loongtrain.model import model_config
    from loongtrain.parallel import ParallelConfig, init_parallel
    from loongtrain.tools.gpucheck.train import Peak, TrainCase, measure_training_step

    state = init_parallel(ParallelConfig(cp=2), device=torch.device("cpu"))
    try:
        measure_training_step(state, model_config("debug"), TrainCase(64, "none"), torch.float32,
                              torch.device("cpu"), steps=3, warmup=1, peak=Peak(1.0, "test"),
                              optim=OptimSection(lr=lr, warmup_steps=0))  # fmt: skip
    except GuardStop as e:
        return str(e)
    return ""


def test_the_gpu_checks_training_rows_stop_on_a_nonfinite_loss(dist_pool):
    out = dist_pool(2).run(_gpu_check_row, 1e30)[0]
    line = r"training step 2: the (loss|gradient norm) is nan; first parameter with a non-finite gradient: \S+"
    assert re.fullmatch(line + "; the step was not applied", out), out
    assert dist_pool(2).run(_gpu_check_row, 1e-3)[0] == ""


def _preflight_notices(overrides: list[str]) -> tuple[str, ...]:
    from loongtrain.train.preflight import preflight

    return preflight(load_config(None, BASE + overrides), 2).notices


def test_a_resume_onto_other_data_is_judged_by_the_history_before_it(dist_pool, tmp_path):
    # a model trained to count, resumed with allow_data_change onto random tokens: its first step is a spike
    # against the saved history (today's guard had no history after a resume: never judged)
    pool = dist_pool(2)
    seq = 64
    counting, noise = tmp_path / "count.tok", tmp_path / "noise.tok"
    _counting_tokens(counting, 60, seq)
    from loongtrain.data import write_tokens

    write_tokens(noise, np.random.default_rng(3).integers(64, size=60 * seq + 1), vocab_size=64)
    common = ["data.source=tokens", "optim.lr=1e-2", "optim.min_lr_ratio=1", "guard.spike_window=4",
              "guard.spike_sigma=3", "guard.spike_min_history=4", "checkpoint.every=4",
              f"run.output_dir={tmp_path / 'run'}"]  # fmt: skip
    pool.run(_train, [*common, f"data.path={counting}", "run.steps=12"])
    changed = [*common, f"data.path={noise}", "checkpoint.allow_data_change=true", "run.steps=14"]
    notices = _preflight_notices(changed)
    line = [n for n in notices if n.startswith("the data changed since step-12")]
    assert line and "(file content)" in line[0], notices
    out = pool.run(_train, changed)[0]
    assert out["stopped"] is None
    marks = {r["step"]: r["guard"] for r in _records(tmp_path / "run") if r["kind"] == "train"}
    assert marks[13] == "spike", marks  # warned at the first step after the change
    assert out["said"].count("on the changed data, beside the loss history before the change") == 2  # 13, 14
    with pytest.raises(Exception, match=r"other data .*file content"):
        _preflight_notices([*common, f"data.path={counting}", "run.steps=16"])  # back to counting: refused


def test_a_changed_recall_seed_or_length_is_named_at_resume(dist_pool, tmp_path):
    from loongtrain.train.checkpoint import CheckpointError

    dist_pool(2).run(_train, ["run.steps=1", f"run.output_dir={tmp_path}"])
    with pytest.raises(CheckpointError, match=r"other data .*: seed 1234 -> 1\)"):
        _preflight_notices(["run.steps=2", "data.seed=1", f"run.output_dir={tmp_path}"])
    notices = _preflight_notices(
        ["run.steps=2", "data.recall_queries=4", "checkpoint.allow_data_change=true", f"run.output_dir={tmp_path}"]
    )
    assert any("the data changed since step-1 (queries 8 -> 4)" in n for n in notices), notices


@pytest.mark.parametrize("policy", ["warn", "stop"])
def test_a_run_that_stopped_learning_is_said(dist_pool, tmp_path, policy):
    # issue 56: lr 1e4 saturates the model at once: the gradient norm is 0 and the loss ln(256) from then on
    overrides = ["optim.lr=1e4", "run.steps=8", "guard.stalled_steps=4", f"guard.stalled={policy}",
                 f"run.output_dir={tmp_path}"]  # fmt: skip
    out = dist_pool(2).run(_train, overrides)[0]
    records = [r for r in _records(tmp_path) if r["kind"] == "train"]
    stalled = [r for r in records if r["grad_norm"] == 0.0 or abs(r["loss"] - math.log(256)) <= 1e-3]
    began = stalled[0]["step"]
    assert [r["step"] for r in stalled] == list(range(began, 9 if policy == "warn" else began + 3))
    if policy == "warn":
        assert out["stopped"] is None
        marks = {r["step"]: r["guard"] for r in records if r["guard"]}
        assert marks == {began + 3: f"stalled since step {began}"}, marks
    else:
        assert out["stopped"].startswith(f"GuardStop: step {began + 3}: the run stopped learning at step {began}")
        assert "guard.stalled=stop" in out["stopped"]



_HOOKS = {
    "capture": _capture, "poison": _poison_before_save, "alter": _alter_one_replica,
    "poison-weight": _poison_weight_at_2, "poison-moment": _poison_moment_before_save,
    "optimizer": _optimizer_settings,
}  # fmt: skip
