"""Materialise a model built on the meta device: allocate on the device and fill every
parameter with its layout-independent initial value (only the local shard is kept)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from loongtrain.model.llama import Transformer, init_value


def local_part(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` that ``param`` holds on this rank (plain tensor: all of it).

    Supports the placements FSDP2 uses: ``Replicate`` and ``Shard(0)`` (``torch.chunk``
    split, trailing ranks possibly empty).
    """
    if not isinstance(param, DTensor):
        return full
    local = full
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard) or placement.dim != 0:
            raise NotImplementedError(f"materialize: unsupported placement {placement} of a parameter")
        chunks = torch.chunk(local, param.device_mesh.size(mesh_dim), dim=0)
        index = param.device_mesh.get_local_rank(mesh_dim)
        local = chunks[index] if index < len(chunks) else local.new_empty((0, *local.shape[1:]))
    return local


def states_device(model: torch.nn.Module, device: torch.device) -> torch.device:
    """Where ``model``'s (sharded) parameters live: the host when ``apply_zero`` offloaded the
    model states, else ``device``."""
    return torch.device("cpu") if getattr(model, "offload_states", False) else torch.device(device)


@torch.no_grad()
def materialize(model: Transformer, device: torch.device, seed: int = 0) -> None:
    """Allocate ``model`` (possibly FSDP-sharded, on meta) on ``device`` (on the host when its
    states are offloaded) and initialise it.

    Every parameter gets ``init_value(name, seed)``, a function of its name and the seed
    alone, so any parallel layout starts from the same weights as the unsharded model.
    """
    device = states_device(model, device)
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        full = init_value(model.config, name, param.shape, seed, device)
        target = param.to_local() if isinstance(param, DTensor) else param
        target.copy_(local_part(full, param).to(target.dtype))
