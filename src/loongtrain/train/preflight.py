"""Every check of a training config that needs no process group, so that bad input fails
with one line before anything is spawned: layout vs world size, model vs heads, sequence
length, batch split, data source, optimizer values, device, run folder and checkpoint."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from loongtrain.apply import check_model_fits
from loongtrain.attention.sharding import check_sequence_length
from loongtrain.config import ConfigError, OptimSection, TrainConfig
from loongtrain.data import PackedRecallTask, RecallTask, TokenFile, TokenFileError, TokenFileSource
from loongtrain.data.loader import rows_per_microbatch
from loongtrain.launch import check_device
from loongtrain.model import ModelConfig
from loongtrain.options import MemoryOptions
from loongtrain.parallel import ParallelConfig
from loongtrain.train.checkpoint import CheckpointManager, check_model_shape
from loongtrain.train.model_setup import model_config_for

PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RunSpec:
    """What :func:`preflight` resolved from a config for one world size: what ``build_run``
    builds the parallel model from (the config's other sections are read as they are)."""

    parallel: ParallelConfig
    model: ModelConfig
    memory: MemoryOptions
    param_dtype: torch.dtype  # compute dtype of the parameters (fp32 master copy kept)
    init_from: str  # a Hugging Face folder the weights come from, or "" (random initial weights)
    task: RecallTask | PackedRecallTask | None  # the synthetic task, or None for a token file


def parallel_config(cfg: TrainConfig) -> ParallelConfig:
    p = cfg.parallel
    return ParallelConfig(
        hp=p.hp, cp=p.cp, ring_window=p.ring_window, placement=p.placement, dp=p.dp or None,
        context_order=p.context_order, balance=p.balance,
    )  # fmt: skip


def make_source(cfg: TrainConfig) -> RecallTask | PackedRecallTask | TokenFileSource:
    """The configured data source (a token file is memory-mapped, so this is cheap)."""
    d = cfg.data
    if d.source == "recall":
        recall = dict(
            seq_len=d.seq_len, keys=d.recall_keys, values=d.recall_values, facts=d.recall_facts,
            queries=d.recall_queries, filler=d.recall_filler, seed=d.seed,
        )  # fmt: skip
        return PackedRecallTask(doc_len=d.doc_len, **recall) if d.pack else RecallTask(**recall)
    file = TokenFile(d.path)
    eos = None
    if d.pack:
        eos = d.eos_id if d.eos_id >= 0 else file.eos
        if eos is None:
            raise ConfigError(
                f"data.pack=true needs the end-of-document token, but {d.path} records none (written before "
                f"loongtrain recorded it, or by a tokenizer without one); set data.eos_id"
            )
    return TokenFileSource(file, d.seq_len, d.seed, eos=eos)


def model_shape(mcfg: ModelConfig) -> dict:
    return dataclasses.asdict(mcfg)


def build_optimizer(params, o: OptimSection) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)


def check_optimizer(o: OptimSection) -> None:
    """Raise ConfigError if AdamW would reject the [optim] values."""
    try:
        build_optimizer([torch.zeros(1, requires_grad=True)], o)
    except ValueError as e:
        raise ConfigError(f"[optim] {e}; fix the value in [optim]") from None


def check_run_dir(run_dir: Path) -> None:
    """Raise ConfigError if ``run_dir`` cannot be created and written."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"run.output_dir={str(run_dir)!r} cannot be written ({e}); choose another folder") from None


def preflight(cfg: TrainConfig, world_size: int, local_world_size: int | None = None) -> RunSpec:
    """Every check that needs no process group; raises ConfigError/TokenFileError/CheckpointError
    naming the fix. ``local_world_size``: ranks on this node (default: all)."""
    try:
        layout = parallel_config(cfg)
        dp = layout.resolve_dp(world_size)
        mcfg = model_config_for(cfg.model)  # a preset or the [model] init_from HF folder, with the RoPE keys
        check_model_fits(mcfg, layout.hp)
        check_sequence_length(cfg.data.seq_len, layout.hp, layout.cp)
        rows_per_microbatch(cfg.data.global_batch, dp, cfg.data.micro_batches)
        check_device(cfg.run.device, local_world_size or world_size)
        source = make_source(cfg)
    except TokenFileError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_optimizer(cfg.optim)
    if isinstance(source, RecallTask | PackedRecallTask) and source.vocab_size > mcfg.vocab_size:
        raise ConfigError(
            f"the recall task needs {source.vocab_size} token ids but the model's vocabulary is "
            f"{mcfg.vocab_size}; set model.vocab_size >= {source.vocab_size} or use fewer keys/values/filler"
        )
    if isinstance(source, TokenFileSource):
        source.file.check_vocab(mcfg.vocab_size)
    run_dir = Path(cfg.run.output_dir)
    check_run_dir(run_dir)
    if cfg.checkpoint.resume:
        newest = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint.keep).newest_readable()
        if newest is not None:
            check_model_shape(newest[1], newest[2], model_shape(mcfg))
    return RunSpec(
        parallel=layout, model=mcfg, memory=cfg.memory.options(), param_dtype=PARAM_DTYPES[cfg.parallel.param_dtype],
        init_from=cfg.model.init_from, task=None if isinstance(source, TokenFileSource) else source,
    )  # fmt: skip
