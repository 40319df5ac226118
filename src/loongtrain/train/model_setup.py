"""The run's model from ``[model]``: its ``ModelConfig`` (a preset, or a Hugging Face folder
with ``init_from``, then the context-extension keys) and its initial weights
(layout-independent random values, or the HF folder's weights).

Importing this module needs neither transformers nor safetensors; only ``init_from`` does.
"""

from __future__ import annotations

import math
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
            base = base.with_window(section.sliding_window)
    else:
        base = model_config(section.preset, **section.overrides())
    try:
        if section.layer_types or section.nope_every:  # each layer's kind from a pattern
            base = base.with_layer_pattern(section.layer_types, section.nope_every)
        return extend_context(
            base,
            rope_theta=section.rope_theta,
            scaling=section.rope_scaling,
            max_positions=section.max_positions,
            **section.rope(),
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def rope_reach(base: ModelConfig, trained: ModelConfig) -> int:
    """The context the trained model's RoPE is meant for: the imported model's own
    (``max_position_embeddings``) when its RoPE is kept, else original x factor of the new
    scaling (the original without one); 0 when unknown (a new ``rope_theta`` alone: a larger
    base is itself a context extension, whose reach is not computed)."""
    if trained.rope_scaling == base.rope_scaling:
        return base.max_positions if trained.rope_theta == base.rope_theta else 0
    original = base.max_positions
    if base.rope_scaling is not None and base.rope_scaling.original_max_positions:
        original = base.rope_scaling.original_max_positions  # scaling replaced or removed: from the pretraining length
    scaling = trained.rope_scaling
    if scaling is None:
        return original
    return int((scaling.original_max_positions or original) * scaling.factor)


def check_pretrained_context(section: ModelSection, trained: ModelConfig, seq_len: int) -> str | None:
    """For an ``init_from`` model: raise ConfigError if ``seq_len`` goes beyond the context its
    RoPE reaches (:func:`rope_reach`) unless ``section.allow_longer_context``; returns a
    notice when it is allowed, else None. Presets (random weights) have no pretrained context."""
    if not section.init_from:
        return None
    from loongtrain.hf.load import read_folder

    base = read_folder(section.init_from).model
    reach = rope_reach(base, trained)
    if not reach or seq_len <= reach:
        return None
    factor = 2 ** math.ceil(math.log2(seq_len / (base.max_positions or reach)))
    if section.allow_longer_context:
        return (
            f"training at data.seq_len={seq_len}, beyond the {reach} tokens the model's RoPE reaches "
            f"(model.allow_longer_context = true)"
        )
    if section.rope_scaling in ("keep", "none"):
        how = (
            f"{section.init_from} was pretrained for {reach} tokens (max_position_embeddings) and "
            f"model.rope_scaling={section.rope_scaling!r} keeps its RoPE"
        )
    else:
        how = (
            f"model.rope_scaling={section.rope_scaling!r} with model.rope_factor={section.rope_factor:g} reaches "
            f"{reach} tokens"
        )
    raise ConfigError(
        f"data.seq_len={seq_len} is longer than the context of {section.init_from}: {how}; extend it with "
        f'model.rope_scaling = "yarn" (or linear, llama3) and model.rope_factor = {factor}, or set '
        f"model.allow_longer_context = true to train beyond it as it is"
    )


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
