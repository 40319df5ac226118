"""Apply parallelism and memory options to a model, in one readable order:

0. float8 linears (torchao), when asked: first, so everything below wraps the float8 modules,
1. attention wiring (2D head-context attention on the ParallelState),
2. the memory options (chunked loss, tiled MLP, the attention over head groups) and
   activation checkpointing (none / full / sc++, every k-th layer or spans of layers, what it
   keeps optionally offloaded to host memory),
3. ``torch.compile`` of each block, when asked (the attention ops stay opaque),
4. hybrid ZeRO (FSDP2 over the chosen scope, optional bf16 compute, states optionally in
   host memory).

The model is built on the meta device first and materialised afterwards with
:func:`materialize`, so no rank ever holds the full unsharded model. :func:`parallelize`
runs the four steps; each ``apply_*`` function is usable on its own.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from loongtrain.apply.activation_checkpoint import apply_activation_checkpoint, checkpointed_layers
from loongtrain.apply.attention import apply_attention, apply_head_groups, check_model_fits
from loongtrain.apply.compile import apply_compile
from loongtrain.apply.float8 import apply_float8, uses_float8
from loongtrain.apply.init import materialize
from loongtrain.apply.offload import ActivationOffload
from loongtrain.apply.zero import apply_zero, zero_mesh
from loongtrain.model.config import ModelConfig
from loongtrain.model.lean import lean_normed_projections, tiled_rope
from loongtrain.model.llama import Transformer, normed_projections
from loongtrain.model.tiled_mlp import tiled_normed_mlp
from loongtrain.options import (
    Float8Options,
    MemoryOptions,
    check_compile,
    check_float8_memory,
    check_zero_scope,
    checkpointed_count,
)
from loongtrain.parallel import ParallelState

__all__ = [
    "Float8Options",
    "MemoryOptions",
    "apply_activation_checkpoint",
    "apply_attention",
    "apply_compile",
    "apply_float8",
    "apply_head_groups",
    "apply_memory_options",
    "apply_zero",
    "check_model_fits",
    "materialize",
    "parallelize",
]


def parallelize(
    model: Transformer,
    state: ParallelState,
    *,
    memory: MemoryOptions | None = None,
    zero: str = "dp_sp",
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    compile: bool = False,
    alternatives: Sequence[ParallelState] = (),
    float8: Float8Options | None = None,
) -> Transformer:
    """Parallelise ``model`` (on meta) for ``state``; returns it (modified in place).

    ``memory`` holds the activation checkpointing (and the other memory options; None:
    ``MemoryOptions()``); ``zero`` the ZeRO scope of the model states; ``alternatives``
    the states of other hp x cp splits a microbatch's layout may take (:func:`apply_attention`); ``float8``
    the FP8 training of the blocks' linears (None: off; ``model.float8_plan`` says which). Every argument is
    validated before any communication.
    """
    memory = MemoryOptions() if memory is None else memory
    float8 = Float8Options() if float8 is None else float8
    if not isinstance(memory, MemoryOptions):
        raise TypeError(f"parallelize: memory must be a loongtrain.MemoryOptions, got {type(memory).__name__}")
    check_zero_scope(zero)
    check_float8_memory(memory, float8)
    zero_mesh(state, zero)  # built by init_parallel for this scope
    if compile:
        check_compile(memory, per_batch=bool(alternatives))
    apply_attention(model, state, alternatives)  # checks that the heads split over hp, before anything else
    apply_float8(model, float8)  # first of the module swaps (torchtitan's order): everything below wraps them
    apply_memory_options(model, memory)
    checkpointed_count(memory, len(model.layers))  # refuses 'auto' unresolved and more layers than the model's
    mode, every, layers = (
        memory.activation_checkpoint,
        memory.activation_checkpoint_every,
        memory.activation_checkpoint_layers,
    )
    recomputed = checkpointed_layers(len(model.layers), mode, every, layers) if mode == "full" else ()
    apply_head_groups(model, memory.head_groups, state, alternatives, recomputed=recomputed)
    offload = ActivationOffload(state.device) if memory.offload_activations else None
    model.activation_offload = offload  # what it holds on the host: model.activation_offload.host_bytes()
    apply_activation_checkpoint(model, mode, every, offload, span=memory.activation_checkpoint_span, layers=layers)
    if compile:
        apply_compile(model)
    apply_zero(
        model, state, zero, param_dtype=param_dtype, reshard_after_forward=reshard_after_forward,
        offload_states=memory.offload_states,
    )  # fmt: skip
    return model


def check_mlp_tile(cfg: ModelConfig, tile: int) -> None:
    """Raise unless the tiled MLP (``memory.mlp_tile``) computes ``cfg``'s MLP (its pre-norm SwiGLU)."""
    if tile and not cfg.pre_norm_blocks:
        raise ValueError(
            f"memory.mlp_tile={tile} tiles the pre-norm MLP; this model has norm_placement={cfg.norm_placement!r}: "
            "set memory.mlp_tile = 0"
        )


def apply_memory_options(model: Transformer, memory: MemoryOptions) -> None:
    """The model-side memory options: the memory-lean norm + projections (except over float8
    linears, which need the modules called) and RoPE (always: what the planner's memory model
    prices), the chunked loss and the tiled MLP."""
    check_mlp_tile(model.config, memory.mlp_tile)
    model.loss_chunk = memory.loss_chunk
    # float8: the q/k/v projections through the (float8) linear modules; the lean function reads
    # their weight tensors directly and would compute them in high precision
    projections = normed_projections if uses_float8(model) else lean_normed_projections
    for layer in model.layers:
        layer.attention.projections = projections
        layer.attention.rope = tiled_rope
        if memory.mlp_tile:  # (else the block's own: SwiGLU, or Gemma's GeGLU)
            layer.feed_forward.mlp = functools.partial(tiled_normed_mlp, tile=memory.mlp_tile)
