"""Apply parallelism to a model, in one readable order:

1. attention wiring (2D head-context attention on the ParallelState),
2. activation checkpointing (none / full / sc++, every k-th layer),
3. hybrid ZeRO (FSDP2 over the chosen scope, optional bf16 compute).

The model is built on the meta device first and materialised afterwards with
:func:`materialize`, so no rank ever holds the full unsharded model.
"""

from __future__ import annotations

import torch

from loongtrain.model.llama import Transformer
from loongtrain.parallel import ParallelState
from loongtrain.parallelize.attention import apply_attention, check_model_fits
from loongtrain.parallelize.checkpoint import CHECKPOINT_MODES, apply_checkpoint, check_checkpoint_mode
from loongtrain.parallelize.init import materialize
from loongtrain.parallelize.zero import ZERO_SCOPES, apply_zero, check_zero_scope

__all__ = [
    "CHECKPOINT_MODES",
    "ZERO_SCOPES",
    "apply_attention",
    "apply_checkpoint",
    "apply_zero",
    "check_model_fits",
    "materialize",
    "parallelize",
]


def parallelize(
    model: Transformer,
    state: ParallelState,
    *,
    checkpoint: str = "none",
    checkpoint_every: int = 1,
    zero: str = "dp_sp",
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> Transformer:
    """Parallelise ``model`` (on meta) for ``state``; returns it (modified in place).

    Every argument is validated before any communication.
    """
    check_model_fits(model.config, state.config.hp)
    check_checkpoint_mode(checkpoint, checkpoint_every)
    check_zero_scope(zero)
    apply_attention(model, state)
    apply_checkpoint(model, checkpoint, checkpoint_every)
    apply_zero(model, state, zero, param_dtype=param_dtype, reshard_after_forward=reshard_after_forward)
    return model
