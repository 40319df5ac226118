"""The activation-checkpoint policy per layer: only the first k layers checkpointed (recompute
counted against the unsharded model's gradients), and ``auto``, the least recompute whose
predicted peak fits a budget. No process group."""

from __future__ import annotations

import pytest
import torch

from loongtrain.apply import checkpointed_layers
from loongtrain.apply.activation_checkpoint import apply_activation_checkpoint
from loongtrain.config import ConfigError, load_config
from loongtrain.model import ModelConfig, build_model, model_config
from loongtrain.options import MemoryOptions, checkpoint_label, checkpointed_count
from loongtrain.parallel import ParallelConfig
from loongtrain.planner import Candidate, PlanError, Workload, search_layouts
from loongtrain.planner.memory import memory_bytes
from loongtrain.planner.policy import auto_policy, choose_checkpoint_policy, recompute_flops
from loongtrain.planner.specs import cluster_spec
from loongtrain.train.preflight import preflight

GiB = 2**30
# the GPU check's 1.1B Llama, bf16, one sequence on one device
M = ModelConfig(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=4, ffn_dim=8192)
AUTO = MemoryOptions(activation_checkpoint="auto")


def _auto(seq: int, budget_gib: float):
    w = Workload(M, seq, batch=1, micro_batch=1, dtype_bytes=2)
    return w, auto_policy(w, ParallelConfig(dp=1), "dp_sp", AUTO, budget_gib * GiB)


def _peak(w: Workload, mode: str, layers: int) -> float:
    x = Candidate.of(dp=1, activation_checkpoint=mode, activation_checkpoint_layers=layers % M.n_layers)
    return memory_bytes(w, x).total


def test_the_first_layers_are_checkpointed():
    assert list(checkpointed_layers(16, "sc++", 1, 6)) == list(range(6))
    assert list(checkpointed_layers(16, "full", 4)) == [0, 4, 8, 12]
    assert list(checkpointed_layers(16, "none")) == []
    assert checkpointed_count(MemoryOptions(activation_checkpoint="sc++", activation_checkpoint_layers=5), 16) == 5
    assert checkpointed_count(MemoryOptions(activation_checkpoint="full", activation_checkpoint_every=3), 16) == 6
    label = checkpoint_label(MemoryOptions(activation_checkpoint="sc++", activation_checkpoint_layers=5), 16)
    assert label == "sc++ on the first 5 of 16 layers"


@pytest.mark.parametrize("mode", ["full", "sc++"])
def test_the_first_layers_recompute_and_the_gradients_equal_no_checkpointing(mode):
    """float64, one device: full / sc++ on the first 2 of 4 layers; only those run their
    forward again in backward, and loss and every gradient equal the unchekpointed model's."""
    cfg = model_config("debug", n_layers=4)
    torch.manual_seed(0)
    plain = build_model(cfg).to_empty(device="cpu").double()
    for p in plain.parameters():
        torch.nn.init.normal_(p, std=0.05)
    ckpt = build_model(cfg).to_empty(device="cpu").double()
    ckpt.load_state_dict(plain.state_dict())
    apply_activation_checkpoint(ckpt, mode, layers=2)
    calls = [0] * cfg.n_layers
    for i, layer in enumerate(ckpt.layers):
        layer.feed_forward.register_forward_pre_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (plain, ckpt):
        loss, _ = model(tokens[:, :-1], torch.arange(32), labels=tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
    assert calls == [2, 2, 1, 1]  # the first two layers recomputed their MLP in backward
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(activation_checkpoint="none", activation_checkpoint_layers=2), "needs activation_checkpoint 'full' or"),
        (dict(activation_checkpoint="sc++", activation_checkpoint_layers=2, activation_checkpoint_every=2), "every=2"),
        (dict(activation_checkpoint="auto", activation_checkpoint_layers=2), "got 'auto'"),
        (dict(activation_checkpoint="auto", activation_checkpoint_every=2), "chooses which layers to checkpoint"),
        (dict(activation_checkpoint="sc++", device_memory_gib=24.0), "device_memory_gib=24.0 is the budget of"),
        (dict(activation_checkpoint="sc++", activation_checkpoint_layers=-1), "must be 0 .every layer. or a positive"),
    ],
)
def test_policy_options_refuse_what_cannot_apply(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MemoryOptions(**kwargs)


def test_unresolved_auto_and_too_many_layers_are_refused():
    with pytest.raises(ValueError, match="the model has 16 layers; use at most 16"):
        checkpointed_count(MemoryOptions(activation_checkpoint="sc++", activation_checkpoint_layers=17), 16)
    with pytest.raises(ValueError, match="resolve it before pricing or applying"):
        checkpointed_count(AUTO, 16)
    with pytest.raises(PlanError, match="not a layout to price"):
        Candidate.of(dp=1, activation_checkpoint="auto")
    # on CPU there is no device total to fill: the budget must be given (before any process starts)
    with pytest.raises(ConfigError, match="set memory.device_memory_gib"):
        preflight(load_config(None, ["memory.activation_checkpoint=auto", "run.device=cpu"]), 1)
    cfg = load_config(None, ["memory.activation_checkpoint=auto", "memory.device_memory_gib=24"])
    assert cfg.memory.options().device_memory_gib == 24.0
    # more layers than the model has: refused before any process starts
    with pytest.raises(ConfigError, match="activation_checkpoint_layers=5 but the model has 2 layers"):
        preflight(load_config(None, ["memory.activation_checkpoint_layers=5"]), 1)
    # a layout per microbatch changes what fits: auto is refused there
    with pytest.raises(ConfigError, match="parallel.layout='per_batch' runs microbatches on other splits"):
        load_config(None, ["memory.activation_checkpoint=auto", "parallel.layout=per_batch"])


def test_auto_recomputes_nothing_where_the_step_fits_and_the_fewest_layers_where_it_does_not():
    # 32K on an H200 (90% of 141 GiB): no recompute at all
    w, policy = _auto(32768, 126.0)
    assert policy.layers == 0 and policy.fits and policy.recompute_flops == 0
    assert policy.describe().startswith("no activation checkpointing (predicted peak")
    # 128K on the same budget: sc++ (recompute without attention) on the fewest first layers that fit
    w, policy = _auto(131072, 126.0)
    assert policy.mode == "sc++" and 0 < policy.layers < M.n_layers and policy.fits
    assert policy.peak_bytes == _peak(w, "sc++", policy.layers) <= 126.0 * GiB
    assert _peak(w, "sc++", policy.layers - 1) > 126.0 * GiB  # one layer fewer does not fit
    assert _peak(w, "none", 0) > 126.0 * GiB
    assert policy.describe().startswith(f"sc++ on the first {policy.layers} of 16 layers")


def test_auto_recompute_grows_as_the_budget_shrinks_and_says_when_nothing_fits():
    previous = -1.0
    for budget in (126.0, 100.0, 80.0, 64.0, 48.0, 40.0):
        w, policy = _auto(131072, budget)
        assert policy.fits and policy.peak_bytes <= budget * GiB
        assert policy.recompute_flops >= previous
        assert policy.recompute_flops == recompute_flops(w, policy.candidate)
        previous = policy.recompute_flops
    assert policy.mode == "full"  # at 40 GiB sc++'s kept attention outputs no longer fit
    w, policy = _auto(131072, 8.0)
    assert not policy.fits and "does NOT fit" in policy.describe()
    assert policy.peak_bytes == min(_peak(w, mode, k) for mode in ("sc++", "full") for k in range(1, 17))


def test_auto_keeps_the_other_memory_options_and_needs_some_checkpointing_under_offload():
    w = Workload(M, 131072, batch=1, micro_batch=1, dtype_bytes=2)
    memory = MemoryOptions(activation_checkpoint="auto", offload_activations=True, loss_chunk=4096)
    policy = auto_policy(w, ParallelConfig(dp=1), "dp_sp", memory, 1000 * GiB)
    assert policy.layers >= 1  # offload moves what checkpointing keeps: 'none' is not an option
    assert policy.candidate.memory.offload_activations and policy.candidate.memory.loss_chunk == 4096
    with pytest.raises(PlanError, match="budget_bytes=0 must be positive"):
        choose_checkpoint_policy(w, Candidate.of(dp=1), 0)


def test_the_planner_checkpoints_only_the_layers_that_must_be():
    """The search's winner on one H200 at 128K: where a checkpointing layout fits, only the fewest
    first layers are checkpointed (and one layer fewer would not fit)."""
    h200 = cluster_spec("h200")
    w = Workload(M, 131072, batch=1, micro_batch=1, dtype_bytes=2)
    best = search_layouts(h200, w, 1).best
    mem = best.candidate.memory
    assert mem.activation_checkpoint in ("sc++", "full") and 0 < mem.activation_checkpoint_layers < M.n_layers
    fewer = best.candidate.with_(activation_checkpoint_layers=mem.activation_checkpoint_layers - 1)
    assert memory_bytes(w, fewer).total > h200.usable_memory_bytes >= best.memory.total
