"""Hybrid ZeRO on FSDP2: model states sharded over data- and sequence-parallel ranks.

Every dp, hp and cp rank computes gradients on different tokens, so gradients are
always reduced over all ranks; the scope only decides where states are sharded:

- ``dp_sp``: shard over all ranks (ZeRO-3 over dp x sp)
- ``sp``: shard within the sequence-parallel group, replicate across dp (HSDP)
- ``dp``: shard across dp, replicate within the sp group (classic ZeRO over dp, HSDP)
- ``none``: replicate everywhere (all-reduce of full gradients, DDP-like)

Reduction is a plain sum (divide factor 1): the loss is already divided by the global
number of target tokens, so the summed gradient equals the unsharded model's.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from loongtrain.model.llama import Transformer
from loongtrain.parallel import ParallelState

ZERO_SCOPES: tuple[str, ...] = ("none", "dp", "sp", "dp_sp")


def check_zero_scope(scope: str) -> None:
    if scope not in ZERO_SCOPES:
        raise ValueError(f"unknown ZeRO scope {scope!r}; choose one of {list(ZERO_SCOPES)}")


def zero_mesh_ranks(world: int, dp: int, scope: str) -> tuple[torch.Tensor, tuple[str, ...]]:
    """The (replicate, shard) rank grid for ``scope``; pure. Global rank = d * sp + local."""
    check_zero_scope(scope)
    grid = torch.arange(world).view(dp, world // dp)  # [dp, sp]
    if scope == "dp_sp":
        return grid.flatten(), ("shard",)
    if scope == "sp":
        return grid, ("replicate", "shard")
    if scope == "dp":
        return grid.T.contiguous(), ("replicate", "shard")
    return grid.flatten().view(world, 1), ("replicate", "shard")


def zero_mesh(state: ParallelState, scope: str) -> DeviceMesh:
    """The DeviceMesh FSDP uses for ``scope`` (built once per state and scope)."""
    if scope not in state.meshes:
        ranks, names = zero_mesh_ranks(state.layout.world_size, state.dp, scope)
        state.meshes[scope] = DeviceMesh(state.device.type, ranks, mesh_dim_names=names)
    return state.meshes[scope]


def apply_zero(
    model: Transformer,
    state: ParallelState,
    scope: str = "dp_sp",
    *,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> None:
    """Shard ``model`` with FSDP2 (each block, then the root).

    ``param_dtype`` (e.g. ``torch.bfloat16``) casts parameters for compute while the
    sharded fp32 parameters stay the master copy; gradients are reduced in fp32.
    ``reshard_after_forward=False`` keeps gathered parameters from forward to backward
    (ZeRO-2-like: less communication, more memory); ``True`` is ZeRO-3.
    """
    check_zero_scope(scope)
    mesh = zero_mesh(state, scope)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    # the root keeps its parameters (embeddings, final norm, output) gathered after
    # forward: backward needs them first
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # plain SUM collectives (gloo has no PREMUL_SUM; NCCL gets zero-copy sums)
            module.set_force_sum_reduction_for_comms(True)
