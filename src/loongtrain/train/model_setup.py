"""The run's model from ``[model]``: its ``ModelConfig`` (a preset, or a Hugging Face folder
with ``init_from``, then the context-extension keys) and its initial weights
(layout-independent random values, or the HF folder's weights).

Importing this module needs neither transformers nor safetensors; only ``init_from`` does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from loongtrain.apply.init import materialize, states_device
from loongtrain.config import ConfigError, ModelSection
from loongtrain.model.config import ModelConfig, extend_context, model_config

SOURCE_DIR = "hf-source"  # in the run folder: the imported folder's config and tokenizer files


def model_config_for(section: ModelSection) -> ModelConfig:
    """The run's model: ``section.init_from``'s config (checked with its weights' table) or the
    preset with its overrides, then the RoPE keys. Raises ConfigError; needs no process group."""
    if section.init_from:
        from loongtrain.hf.load import read_folder

        base = read_folder(section.init_from).model
        if section.sliding_window:
            base = dataclasses.replace(base, sliding_window=section.sliding_window)
    else:
        base = model_config(section.preset, **section.overrides())
    try:
        return extend_context(
            base, rope_theta=section.rope_theta, scaling=section.rope_scaling, factor=section.rope_factor,
            original_max_positions=section.rope_original_max_positions,
            low_freq_factor=section.rope_low_freq_factor, high_freq_factor=section.rope_high_freq_factor,
            beta_fast=section.rope_beta_fast, beta_slow=section.rope_beta_slow,
            attention_factor=section.rope_attention_factor, max_positions=section.max_positions,
        )  # fmt: skip
    except ValueError as e:
        raise ConfigError(str(e)) from None


def init_weights(model: torch.nn.Module, device: torch.device, init_from: str, run_dir: str | Path, seed: int) -> None:
    """Materialise ``model`` (built on meta, possibly FSDP-sharded) on ``device``: from the
    Hugging Face folder ``init_from`` (each rank reads its own shards; rank 0 keeps the
    folder's config and tokenizer files in ``<run_dir>/hf-source`` for export), else random
    layout-independent values (``materialize``)."""
    if not init_from:
        materialize(model, device, seed=seed)
        return
    from loongtrain.hf.load import keep_companion_files, load_weights, read_folder

    model.to_empty(device=states_device(model, device))
    load_weights(model, read_folder(init_from))
    if not dist.is_initialized() or dist.get_rank() == 0:
        keep_companion_files(init_from, Path(run_dir) / SOURCE_DIR)
