"""The training config system: TOML + overrides, types, unknown keys, round trip."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from loongtrain.config import RENAMED_KEYS, SECTIONS, ConfigError, TrainConfig, load_config, to_toml
from loongtrain.model.config import ROPE_SCALINGS, RopeScaling
from loongtrain.options import GuardOptions, MemoryOptions
from loongtrain.parallel.config import ParallelConfig
from loongtrain.train.cli import split_overrides

REPO = Path(__file__).resolve().parents[1]


def test_defaults_file_and_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[run]\nsteps = 7\n[parallel]\nhp = 2\ncp = 4\nring_window = 2\n[optim]\nlr = 1\n")
    cfg = load_config(path, ["run.steps=9", "data.seq_len=64", "parallel.placement=context_first"])
    assert cfg.run.steps == 9  # override beats file
    assert (cfg.parallel.hp, cfg.parallel.cp, cfg.parallel.ring_window) == (2, 4, 2)
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)  # TOML int accepted for a float
    assert cfg.data.seq_len == 64 and cfg.parallel.placement == "context_first"
    assert cfg.data.global_batch == 8  # default kept


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(REPO / "configs" / "debug_cpu.toml", ["run.steps=3"])
    saved = tmp_path / "resolved.toml"
    saved.write_text(to_toml(cfg))
    assert load_config(saved) == cfg


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.toml")))
def test_shipped_configs_load(name):
    load_config(REPO / "configs" / name)


def test_split_overrides():
    assert split_overrides(["--run.steps", "5", "--data.seq_len=64"]) == ["run.steps=5", "data.seq_len=64"]
    with pytest.raises(ConfigError, match="has no value"):
        split_overrides(["--run.steps"])
    with pytest.raises(ConfigError, match="unexpected argument 'steps'"):
        split_overrides(["steps"])


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        ("[run]\nstepz = 3\n", [], "unknown key run.stepz; keys of [run] are"),
        ("[trainer]\nsteps = 3\n", [], "unknown section [trainer]"),
        ("[run]\nsteps = 'many'\n", [], "expected int, got str 'many'"),
        ("[run]\nsteps = 3.5\n", [], "expected int, got float"),
        ("[parallel]\nhp = true\n", [], "expected int, got bool"),
        ("[run\nsteps = 3\n", [], "is not valid TOML"),
        ("steps = 3\n", [], "must be a [section] table"),
        ("", ["run.steps=abc"], "'abc' is not a valid int"),
        ("", ["run.steps"], "must look like section.key=value"),
        ("", ["parallel.zero=zero9"], "parallel.zero='zero9'; choose one of"),
        ("", ["parallel.cp=6", "parallel.ring_window=4"], "[parallel] ParallelConfig: cp=6 is not divisible by ring_"),
        ("", ["run.steps=0"], "run.steps=0 must be positive"),
        ("", ["optim.lr=nan"], "optim.lr=nan must be finite"),
        ("", ["data.source=tokens"], "needs data.path"),
        ("", ["optim.beta1=1.5"], "optim.beta1=1.5 must be in [0, 1)"),
        ("", ["optim.beta2=1"], "optim.beta2=1.0 must be in [0, 1)"),
        ("", ["optim.eps=-1"], "optim.eps=-1.0 must be positive"),
        ("", ["optim.eps=0"], "optim.eps=0.0 must be positive"),
        ("", ["optim.min_lr_ratio=2"], "optim.min_lr_ratio=2.0 must be at most 1"),
        ("", ["model.rope_theta=1e39"], "model.rope_theta=1e+39 does not fit float32, the dtype of the RoPE frequ"),
        ("", ["run.timeout_s=0"], "run.timeout_s=0.0 must be positive"),
        ("", ["checkpoint.on_damaged=ignore"], "checkpoint.on_damaged='ignore'; choose one of ['fallback', 'stop']"),
        ("", ["memory.loss_chunk=-1"], "memory.loss_chunk=-1 must not be negative"),
        ("", ["memory.mlp_tile=-8"], "memory.mlp_tile=-8 must not be negative"),
        ("[memory]\noffload_states = 1\n", [], "expected bool, got int 1"),
        (
            "",
            ["memory.activation_checkpoint=none", "memory.offload_activations=true"],
            "offload_activations moves what activation checkpointing keeps",
        ),
    ],
)
def test_bad_config_names_the_problem(tmp_path, text, overrides, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert message in str(info.value)


def test_memory_keys_reach_memory_options(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        "[memory]\nactivation_checkpoint = 'full'\nloss_chunk = 0\nmlp_tile = 4096\n"
        "offload_activations = true\noffload_states = true\n"
    )
    options = load_config(path).memory.options()
    assert (options.loss_chunk, options.mlp_tile) == (0, 4096)
    assert options.offload_activations and options.offload_states
    defaults = load_config(None).memory.options()
    assert (defaults.loss_chunk, defaults.mlp_tile, defaults.offload_activations, defaults.offload_states) == (
        1024,
        0,
        False,
        False,
    )


def _config_keys_of(option_cls: type) -> dict[str, list[str]]:
    """Every field of ``option_cls`` -> the config keys (section.key) that set it, found by
    building each section with one key changed and reading which option field moved."""
    found: dict[str, list[str]] = {f.name: [] for f in fields(option_cls)}
    build = {
        ParallelConfig: lambda c: c.parallel.config(), MemoryOptions: lambda c: c.memory.options(),
        GuardOptions: lambda c: c.guard.options(),
    }  # fmt: skip
    reference = TrainConfig()
    for sec_name, section_cls in SECTIONS.items():
        for key in fields(section_cls):
            meta = key.metadata.get("option")
            if meta is not None and meta[0] is option_cls:
                found[meta[1]].append(f"{sec_name}.{key.name}")
    if option_cls in build:  # the declared mapping is also the one the section's builder uses
        base = build[option_cls](reference)
        for name, keys in found.items():
            for dotted in keys:
                cfg = TrainConfig()
                sec, key = dotted.split(".")
                value = getattr(getattr(cfg, sec), key)
                if isinstance(value, bool):
                    changed = not value
                elif isinstance(value, int | float):
                    changed = value + 2
                else:
                    choices = next(f for f in fields(SECTIONS[sec]) if f.name == key).metadata["choices"]
                    changed = next(c for c in choices if c != value)
                setattr(getattr(cfg, sec), key, changed)
                if name == "ring_window":
                    cfg.parallel.cp = changed * 2
                if name == "activation_checkpoint_span":  # spans need full checkpointing
                    cfg.memory.activation_checkpoint = "full"
                if name == "activation_checkpoint_layers":  # a layer count needs one mode on every layer
                    cfg.memory.activation_checkpoint = "full"
                if name == "device_memory_gib":  # the budget of auto
                    cfg.memory.activation_checkpoint = "auto"
                built = build[option_cls](cfg)
                moved = [f.name for f in fields(option_cls) if getattr(built, f.name) != getattr(base, f.name)]
                assert name in moved, (dotted, moved)
    return found


@pytest.mark.parametrize("option_cls", [ParallelConfig, MemoryOptions, GuardOptions, RopeScaling])
def test_every_option_field_has_exactly_one_config_key(option_cls):
    found = _config_keys_of(option_cls)
    if option_cls is RopeScaling:
        # its kind is model.rope_scaling, whose choices add keep and none to the kinds
        assert found["kind"] == []
        model = {f.name: f for f in fields(SECTIONS["model"])}
        assert set(ROPE_SCALINGS) < set(model["rope_scaling"].metadata["choices"])
        found["kind"] = ["model.rope_scaling"]
    assert {name: len(keys) for name, keys in found.items()} == {name: 1 for name in found}, found


def test_rope_keys_reach_rope_scaling():
    cfg = load_config(
        None,
        [
            "model.rope_scaling=yarn",
            "model.rope_factor=4",
            "model.rope_original_max_positions=512",
            "model.rope_beta_fast=16",
            "model.rope_truncate=false",
            "model.rope_attention_factor=0",
        ],
    )
    rope = RopeScaling(cfg.model.rope_scaling, **cfg.model.rope())
    assert rope == RopeScaling("yarn", 4.0, 512, beta_fast=16.0, truncate=False, attention_factor=None)


def test_renamed_keys_are_refused_naming_the_new_key():
    for old, (new, _) in RENAMED_KEYS.items():
        with pytest.raises(ConfigError, match=f"{old} was renamed to {new}.*; use {new}$"):
            load_config(None, [f"{old}=1"])


def test_a_resolved_config_written_before_loads():
    """A run folder's resolved.toml from 2026-12-02 (before the sections were made from the
    option objects) loads to the same values."""
    cfg = load_config(Path(__file__).parent / "data" / "resolved_config_2026-12-02.toml")
    assert cfg.parallel.config() == ParallelConfig(hp=2, cp=4, ring_window=2, dp=2)
    assert cfg.memory.options() == MemoryOptions(activation_checkpoint="full")
    assert RopeScaling(cfg.model.rope_scaling, **cfg.model.rope()) == RopeScaling("yarn", 4.0, 2048)
    assert cfg.parallel.layout == "fixed" and cfg.memory.activation_checkpoint == "full"


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/x.toml")
    with pytest.raises(ConfigError, match=r"config file '.*' is a folder, not a TOML file; give the file"):
        load_config(tmp_path)


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.toml")))
def test_shipped_configs_fit_their_layout(name, tmp_path):
    """Every shipped config passes the start-up checks at the world size of its layout
    (the GPU configs with synthetic data, since their token file is the user's)."""
    from loongtrain.train.trainer import preflight

    overrides = [f"run.output_dir={tmp_path / 'run'}"]
    shipped = load_config(REPO / "configs" / name)
    if shipped.data.sources:  # a mixture: stand-in token files at its sources' paths, long enough for it
        overrides += _stand_in_sources(shipped, tmp_path)
    else:
        overrides += ["data.source=recall", "data.pack=false"]
        if shipped.data.long_documents != "split":
            overrides.append("data.long_documents=split")
    if shipped.model.init_from:  # a local HF folder: stand in a tiny one, pretrained for the config's context
        pytest.importorskip("transformers")
        from hf_tiny import make_hf_model

        heads = max(4, shipped.parallel.hp)
        stand_in = make_hf_model(
            "llama", tmp_path / "hf", max_position_embeddings=shipped.data.seq_len, num_attention_heads=heads,
            num_key_value_heads=heads, num_hidden_layers=max(2, shipped.memory.activation_checkpoint_layers),
        )  # fmt: skip
        overrides.append(f"model.init_from={stand_in}")
    if shipped.checkpoint.init_from:  # a stage: the previous stage's checkpoint stands in, of this model
        overrides.append(f"checkpoint.init_from={_stand_in_stage(shipped, tmp_path)}")
    cfg = load_config(REPO / "configs" / name, overrides)
    p = cfg.parallel
    spec = preflight(cfg, p.hp * p.cp * max(p.dp, 1))
    assert spec.parallel.sp == p.hp * p.cp


def _stand_in_sources(cfg, folder) -> list[str]:
    """Token files for each source of ``cfg``'s mixture: at least two sequences of documents of
    each kind it draws (long ones where it upsamples), in ids every model has."""
    import numpy as np

    from loongtrain.data import write_tokens

    seq, out = cfg.data.seq_len, []
    for name, source in cfg.data.sources.items():
        long = max(source.upsample_length, 2)
        lengths = [seq] * 3 + [max(1, long - 1)] * (3 * seq // max(1, long - 1) + 1 if source.upsample_length else 0)
        tokens = np.concatenate([np.r_[np.full(n - 1, 5, dtype=np.int64), 1] for n in lengths])
        write_tokens(folder / f"{name}.tok", tokens, vocab_size=96, eos=1)
        out.append(f"data.sources.{name}.path={folder / f'{name}.tok'}")
    return out


def _stand_in_stage(cfg, folder):
    """A checkpoint of ``cfg``'s model (its trainer state; the stage's checks read no weights)."""
    import json

    from loongtrain.train.model_setup import model_config_for
    from loongtrain.train.spec import model_shape

    step = folder / "stage" / "checkpoints" / "step-1"
    step.mkdir(parents=True)
    state = {"step": 1, "model_shape": model_shape(model_config_for(cfg.model))}
    (step / "trainer_state.json").write_text(json.dumps(state))
    (step / "checksums.json").write_text("{}")
    return folder / "stage"


def test_device_and_optimizer_checked_before_spawning(tmp_path):
    """What a worker would reject 40-90 s later is refused by preflight (no process group)."""
    import torch

    from loongtrain.config import OptimSection
    from loongtrain.train.preflight import check_optimizer, preflight

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cfg = load_config(None, ["run.device=cuda", f"run.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=f"run.device=cuda needs one GPU per local rank: {gpus + 1} local rank"):
        preflight(cfg, gpus + 1, gpus + 1)
    with pytest.raises(ConfigError, match="Invalid epsilon value: -1.0"):
        check_optimizer(OptimSection(eps=-1.0))  # AdamW's own check behind config validation
    check_optimizer(OptimSection())
    # head groups that do not split the debug model's 4 heads over hp=2 (one head a group)
    cfg = load_config(None, ["parallel.hp=2", "memory.head_groups=4", f"run.output_dir={tmp_path}"])
    refusal = r"memory.head_groups=4: a group of 1 query .* over hp=2 .* fewer head groups"
    with pytest.raises(ConfigError, match=refusal):
        preflight(cfg, 2)


def test_torch_older_than_the_oldest_tested_is_refused_with_one_line():
    from loongtrain.torch_support import check_torch, release

    assert release("2.11.0+cu130") == (2, 11) and release("2.12.0a0+git1234") == (2, 12)
    for ok in ("2.11.0+cu130", "2.13.0+cpu", "3.0.0"):
        check_torch(ok)
    with pytest.raises(RuntimeError, match=r"needs torch >= 2.11 .* this is torch 2.10.1\+cu128: pip install") as e:
        check_torch("2.10.1+cu128")
    assert "\n" not in str(e.value)
    check_torch()  # the installed one is tested


def test_the_launcher_passes_a_shutdown_timeout_only_to_a_torch_that_takes_one():
    from dataclasses import dataclass

    from torch.distributed.launcher.api import LaunchConfig

    from loongtrain.launch import _shutdown_timeout

    @dataclass
    class Torch211LaunchConfig:  # torch 2.11's LaunchConfig has no shutdown_timeout (a TypeError if passed)
        nproc_per_node: int = 1

    assert _shutdown_timeout(Torch211LaunchConfig, 5) == {}
    taken = {f.name for f in fields(LaunchConfig)}
    assert _shutdown_timeout(LaunchConfig, 5) == ({"shutdown_timeout": 5} if "shutdown_timeout" in taken else {})
    LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, **_shutdown_timeout(LaunchConfig, 5))  # accepted


@pytest.mark.parametrize(
    "name, model",
    [("prolong_llama3_8b_64k.toml", "llama3-8b"), ("prolong_llama3_8b_512k.toml", "llama3-8b"),
     ("olmo3_7b_128k.toml", "olmo3-7b")],
)  # fmt: skip
def test_the_8_gpu_stage_configs_are_the_planners_first_row(name, model, capsys):
    """Each stage's layout and memory options, priced by the planner at the stage's length and
    batch on one node of 8 GPUs, fit and rank first (the configs say which command chose them)."""
    import argparse
    import json

    from loongtrain import plan_cli

    cfg = load_config(REPO / "configs" / name)
    p, m, d = cfg.parallel, cfg.memory, cfg.data
    layout = (
        f"hp={p.hp},cp={p.cp},zero={p.zero},ckpt={m.activation_checkpoint},loss_chunk={m.loss_chunk},"
        f"mlp_tile={m.mlp_tile},head_groups={m.head_groups},layers={m.activation_checkpoint_layers}"
    )
    argv = [
        "--cluster", "h100", "--model", model, "--devices", "8", "--seq-len", str(d.seq_len),
        "--global-batch", str(d.global_batch * d.seq_len), "--layout", layout, "--json",
    ]  # fmt: skip
    parser = argparse.ArgumentParser(prog="loongtrain plan")
    plan_cli.add_arguments(parser)
    plan_cli.main(parser.parse_args(argv))
    priced = json.loads(capsys.readouterr().out)["layout"]
    assert priced["fits"] and priced["rank"] == 1, priced["standing"]


def _fits_float32_adamw(**optim: float) -> bool:
    """torch's own answer: one float32 AdamW step (with clipping) with these [optim] values
    runs and leaves finite weights, and each value is finite as a float32 scalar."""
    import torch

    o = {"lr": 1e-3, "eps": 1e-8, "weight_decay": 0.0, "beta1": 0.9, "grad_clip": 1.0, **optim}
    if not all(torch.isfinite(torch.tensor(v, dtype=torch.float32)) for v in o.values()):
        return False
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 0.5)
    torch.nn.utils.clip_grads_with_norm_([p], o["grad_clip"], torch.linalg.vector_norm(p.grad))
    opt = torch.optim.AdamW([p], lr=o["lr"], eps=o["eps"], weight_decay=o["weight_decay"], betas=(o["beta1"], 0.95))
    try:
        opt.step()
    except RuntimeError:  # "value cannot be converted to type float without overflow"
        return False
    return bool(torch.isfinite(p).all())


@pytest.mark.parametrize(
    ("overrides", "key", "largest"),
    [
        ({"lr": 1e39}, "lr", "3.402e+37"),  # the case: it failed at the step, naming no key
        ({"lr": 1e38}, "lr", "3.402e+37"),  # fits float32 itself, but the first step is lr / (1 - beta1)
        ({"lr": 4e38, "beta1": 0.0}, "lr", "3.402e+38"),
        ({"lr": 10.0, "weight_decay": 1e38}, "weight_decay", "3.402e+37"),
        ({"eps": 1e39}, "eps", "3.402e+38"),
        ({"grad_clip": 1e39}, "grad_clip", "3.402e+38"),
    ],
)
def test_an_optimizer_float_beyond_float32_is_refused_naming_the_key_and_the_largest(overrides, key, largest):
    """Refused by config validation (before any process), naming the key and the largest value
    allowed; torch's float32 AdamW fails (or goes non-finite) at the refused value and trains
    at the largest one named."""
    items = [f"optim.{k}={v}" for k, v in overrides.items()]
    with pytest.raises(ConfigError) as info:
        load_config(None, items)
    text = str(info.value)
    print(f"\n{' '.join(items)}: {text}")
    assert text.startswith(f"optim.{key}={overrides[key]:g} does not fit float32, the dtype of AdamW's parameters")
    assert text.endswith(f"optim.{key} at most {largest}" if key in ("lr", "weight_decay") else f"at most {largest}")
    assert not _fits_float32_adamw(**overrides)
    allowed = {**overrides, key: float(largest)}
    load_config(None, [f"optim.{k}={v}" for k, v in allowed.items()])
    assert _fits_float32_adamw(**allowed)


def test_an_epsilon_that_is_zero_in_float32_is_refused():
    """Issue 56's first case (``optim.eps 1e-50``): 0 in float32, so AdamW's first update divides 0
    by 0 where a gradient is 0 (checked with torch's own AdamW below); refused naming the key."""
    import torch

    with pytest.raises(ConfigError, match=r"optim.eps=1e-50 is below float32's smallest normal number"):
        load_config(None, ["optim.eps=1e-50"])
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.tensor([1.0, 0.0, 1.0, 0.0])
    torch.optim.AdamW([p], lr=1e-3, eps=1e-50).step()
    assert not torch.isfinite(p).all()  # 0 / (sqrt(0) + 0): what the refusal prevents
    load_config(None, ["optim.eps=1.2e-38"])


def test_a_timeout_no_timer_can_hold_is_refused():
    """A huge ``run.timeout_s`` overflowed ``timedelta`` inside the workers; refused naming the key."""
    from datetime import timedelta

    with pytest.raises(OverflowError):
        timedelta(seconds=2e300)  # what the workers would have met
    refused = r"run.timeout_s=1e\+300 is longer than a timer can hold here; at most 1e\+09"
    with pytest.raises(ConfigError, match=refused):
        load_config(None, ["run.timeout_s=1e300"])
    timedelta(seconds=2 * 1e9)  # the largest allowed, doubled as the backstop: fine
    load_config(None, ["run.timeout_s=1e9"])


def test_layer_kinds_from_the_config_keys():
    """``[model] layer_types`` (a pattern repeated over the layers) and ``nope_every`` set each layer's
    kind as written, for any preset; bad entries are one line."""
    from loongtrain.train.model_setup import model_config_for

    cfg = load_config(None, ["model.n_layers=6", "model.sliding_window=16",
                             "model.layer_types=sliding, sliding,full", "model.nope_every=4"])  # fmt: skip
    m = model_config_for(cfg.model)
    assert m.windows == (16, 16, 0, 16, 16, 0)
    assert [k.rope for k in m.kinds] == [True, True, True, False, True, True]
    with pytest.raises(ConfigError, match=r"model.layer_types entries \['global'\]: each is full or sliding"):
        model_config_for(load_config(None, ["model.layer_types=full,global"]).model)
    with pytest.raises(ConfigError, match="has sliding layers but the model no window: set model.sliding_window"):
        model_config_for(load_config(None, ["model.layer_types=sliding,full"]).model)
