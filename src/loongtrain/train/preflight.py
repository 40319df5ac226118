"""Every check of a training config that needs no process group, so that bad input fails
with one line before anything is spawned: layout vs world size, model vs heads, sequence
length, batch split, data source, optimizer values, device, run folder and checkpoint.
:func:`preflight` returns the :class:`~loongtrain.train.spec.RunSpec` it checked."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from loongtrain.apply import check_mlp_tile, check_model_fits
from loongtrain.apply.attention import check_head_groups
from loongtrain.apply.float8 import empty_plan_warning, float8_plan, require_torchao
from loongtrain.attention.sharding import check_sequence_length
from loongtrain.config import ConfigError, ModelSection, OptimSection, TrainConfig
from loongtrain.data import (
    LengthGroupedSource,
    MixtureSource,
    PackedRecallTask,
    RecallTask,
    TokenFile,
    TokenFileError,
    TokenFileSource,
    check_same_tokenizer,
)
from loongtrain.data.loader import rows_per_microbatch
from loongtrain.data.mixture import repeat_notices
from loongtrain.launch import resolve_device, under_torchrun
from loongtrain.model import ModelConfig, build_model
from loongtrain.options import (
    AUTO_CHECKPOINT,
    Float8Options,
    check_float8_device,
    check_kernel_device,
    checkpointed_count,
)
from loongtrain.train.checkpoint import CheckpointManager, check_data_fingerprint, check_model_shape
from loongtrain.train.memory_policy import check_auto_budget
from loongtrain.train.model_setup import check_pretrained_context
from loongtrain.train.spec import (
    RunSpec,
    build_optimizer,
    make_source,
    model_shape,
    model_spec,
    source_fingerprint,
    source_identity,
)
from loongtrain.train.stages import check_stage_shape, stage_checkpoint
from loongtrain.train.tracking import missing_packages

# a model folder with any of these has a tokenizer to check a token file against
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_token_file(file: TokenFile, section: ModelSection, mcfg: ModelConfig) -> list[str]:
    """Raise TokenFileError unless the token file fits the model: its ids below the model's
    vocabulary, its tokenizer no larger than that vocabulary and, with ``init_from``, the same
    tokenizer as the model folder's (fingerprints). Returns notices for what cannot be checked."""
    file.check_vocab(mcfg.vocab_size)
    model = section.init_from or f"model.preset={section.preset!r}"
    if file.vocab_size > mcfg.vocab_size:
        raise TokenFileError(
            f"{file.path} was made with a tokenizer of {file.vocab_size} tokens, but the vocabulary of {model} has "
            f"{mcfg.vocab_size}; use the model's tokenizer (`loongtrain prepare --tokenizer ...`) or a model with "
            f"model.vocab_size >= {file.vocab_size}"
        )
    if not section.init_from:
        return []
    if file.tokenizer_fingerprint is None:
        return [
            f"{file.path} records no tokenizer fingerprint (format version {file.version}), so its tokenizer cannot "
            f"be checked against {section.init_from}'s; re-create it with `loongtrain prepare --tokenizer "
            f"{section.init_from}` to have it checked"
        ]
    if not any((Path(section.init_from) / name).is_file() for name in TOKENIZER_FILES):
        return [
            f"{section.init_from} has no tokenizer files, so the tokenizer of {file.path} cannot be checked against "
            f"it (only the vocabulary size was)"
        ]
    check_same_tokenizer(file, section.init_from)
    return []


def check_finite_weights(folder: str) -> None:
    """Raise ConfigError naming the first tensor of the Hugging Face ``folder`` that holds a NaN
    or an infinity (a damaged download, an export of a diverged run): training on it would be
    NaN from the first step."""
    from loongtrain.hf.load import first_nonfinite_tensor, read_folder

    found = first_nonfinite_tensor(read_folder(folder))
    if found is not None:
        name, count = found
        raise ConfigError(
            f"model.init_from={folder!r}: tensor {name} holds {count} non-finite value(s) (NaN or infinity); "
            f"training on it would be NaN from the first step: use an intact copy of the model"
        )


def check_float8(options: Float8Options, device: str, mcfg: ModelConfig) -> str | None:
    """float8.enabled's checks before any process starts: torchao installed and recent enough,
    the GPU's FP8 units (or ``emulate``), the float8 all-gather's backend; returns a warning when
    the filters leave no linear of the model in float8 (else None). Raises ValueError."""
    if not options.enabled:
        return None
    require_torchao()
    capability, name = None, ""
    if device == "cuda" and torch.cuda.is_available():
        capability, name = torch.cuda.get_device_capability(0), torch.cuda.get_device_name(0)
    check_float8_device(device, capability, name, options)
    warning = empty_plan_warning(float8_plan(build_model(mcfg), options))
    if warning is None and device == "cpu" and not options.emulate:
        return (
            "notice: float8 on the CPU runs torch._scaled_mm's reference kernel, about 100x slower than "
            "float8.emulate=true (the same products; the rowwise recipes also round them to bf16); set it for speed"
        )
    return warning


def check_optimizer(o: OptimSection) -> None:
    """Raise ConfigError if AdamW would reject the [optim] values."""
    try:
        build_optimizer([torch.zeros(1, requires_grad=True)], o)
    except ValueError as e:
        raise ConfigError(f"[optim] {e}; fix the value in [optim]") from None


def check_run_dir(run_dir: Path) -> None:
    """Raise ConfigError if ``run_dir`` cannot be created and written. Folders made for the
    probe are removed again (the run makes its folder when it starts), except under torchrun,
    where every rank probes at once."""
    made = []
    for folder in (run_dir, *run_dir.parents):
        if folder.exists() or under_torchrun():
            break
        made.append(folder)  # deepest first
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"run.output_dir={str(run_dir)!r} cannot be written ({e}); choose another folder") from None
    finally:
        for folder in made:
            try:
                folder.rmdir()
            except OSError:
                break


def preflight(cfg: TrainConfig, world_size: int, local_world_size: int | None = None) -> RunSpec:
    """Every check that needs no process group; raises ConfigError/TokenFileError/CheckpointError
    naming the fix. ``local_world_size``: ranks on this node (default: all). Returns the run's
    spec, its data source made here (the only time in this process)."""
    try:
        spec = model_spec(cfg)
        layout, mcfg = spec.parallel, spec.model
        dp = layout.resolve_dp(world_size)
        check_model_fits(mcfg, layout.hp)
        check_head_groups(mcfg, cfg.memory.head_groups, [layout.hp])
        check_mlp_tile(mcfg, cfg.memory.mlp_tile)
        if spec.memory.activation_checkpoint != AUTO_CHECKPOINT:  # auto is resolved per run
            checkpointed_count(spec.memory, mcfg.n_layers)  # no more checkpointed layers than the model has
        check_sequence_length(cfg.data.seq_len, layout.hp, layout.cp)
        rows_per_microbatch(cfg.data.global_batch, dp, cfg.data.micro_batches)
        device = resolve_device(cfg.run.device, local_world_size or world_size)
        check_kernel_device(cfg.attention.kernel, device)
        check_auto_budget(cfg, device)
        notices = [check_pretrained_context(cfg.model, mcfg, cfg.data.seq_len), check_float8(spec.float8, device, mcfg)]
        source = make_source(cfg)
    except TokenFileError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_optimizer(cfg.optim)
    missing = missing_packages(cfg.metrics)  # metrics.wandb / metrics.mlflow without the package
    if missing is not None:
        raise ConfigError(missing)
    if isinstance(source, RecallTask | PackedRecallTask) and source.vocab_size > mcfg.vocab_size:
        raise ConfigError(
            f"the recall task needs {source.vocab_size} token ids but the model's vocabulary is "
            f"{mcfg.vocab_size}; set model.vocab_size >= {source.vocab_size} or use fewer keys/values/filler"
        )
    if isinstance(source, TokenFileSource | LengthGroupedSource):
        notices += check_token_file(source.file, cfg.model, mcfg)
    if isinstance(source, MixtureSource):
        for name, file in source.files().items():
            try:
                notices += check_token_file(file, cfg.model, mcfg)
            except TokenFileError as e:
                raise TokenFileError(f"data.sources.{name}: {e}") from None
        notices += repeat_notices(source, cfg.run.steps * cfg.data.global_batch)  # sources drawn past 4 epochs
    if cfg.model.init_from:
        check_finite_weights(cfg.model.init_from)
    run_dir = Path(cfg.run.output_dir)
    check_run_dir(run_dir)
    if cfg.checkpoint.init_from:  # a new stage: the checkpoint it starts from holds this model
        check_stage_shape(stage_checkpoint(cfg.checkpoint.init_from), model_shape(mcfg))
    if cfg.checkpoint.resume:
        newest = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint.keep).newest_readable()
        if newest is not None:
            check_model_shape(newest[1], newest[2], model_shape(mcfg))
            notices.append(check_data_fingerprint(
                newest[1], newest[2], source_fingerprint(source), cfg.checkpoint.allow_data_change,
                source_identity(source),
            ))  # fmt: skip
    return dataclasses.replace(spec, source=source, notices=tuple(n for n in notices if n))
