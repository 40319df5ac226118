"""Apply parallelism to a model, in one readable order:

1. attention wiring (2D head-context attention on the ParallelState),
2. activation checkpointing (none / full / sc++, every k-th layer),
3. ``torch.compile`` of each block, when asked (the attention ops stay opaque),
4. hybrid ZeRO (FSDP2 over the chosen scope, optional bf16 compute).

The model is built on the meta device first and materialised afterwards with
:func:`materialize`, so no rank ever holds the full unsharded model.

``loongtrain.parallelize`` is also :func:`parallelize` itself: the package is callable,
so ``lt.parallelize(model, state, ...)`` runs the function below whether or not this
package was imported before (a package attribute of the same name would hide it).
"""

from __future__ import annotations

import sys
import types

import torch

from loongtrain.model.llama import Transformer
from loongtrain.options import CHECKPOINT_MODES, ZERO_SCOPES, check_checkpoint_mode, check_zero_scope
from loongtrain.parallel import ParallelState
from loongtrain.parallelize.attention import apply_attention, check_model_fits
from loongtrain.parallelize.checkpoint import apply_checkpoint
from loongtrain.parallelize.compile import apply_compile
from loongtrain.parallelize.init import materialize
from loongtrain.parallelize.zero import apply_zero, zero_mesh

__all__ = [
    "CHECKPOINT_MODES",
    "ZERO_SCOPES",
    "apply_attention",
    "apply_checkpoint",
    "apply_compile",
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
    compile: bool = False,
) -> Transformer:
    """Parallelise ``model`` (on meta) for ``state``; returns it (modified in place).

    Every argument is validated before any communication.
    """
    check_model_fits(model.config, state.config.hp)
    check_checkpoint_mode(checkpoint, checkpoint_every)
    check_zero_scope(zero)
    zero_mesh(state, zero)  # built by init_parallel for this scope
    apply_attention(model, state)
    apply_checkpoint(model, checkpoint, checkpoint_every)
    if compile:
        apply_compile(model)
    apply_zero(model, state, zero, param_dtype=param_dtype, reshard_after_forward=reshard_after_forward)
    return model


class _CallablePackage(types.ModuleType):
    """This package, callable as :func:`parallelize` (``lt.parallelize(model, state, ...)``)."""

    def __call__(self, model: Transformer, state: ParallelState, **options) -> Transformer:
        return parallelize(model, state, **options)


sys.modules[__name__].__class__ = _CallablePackage
