"""Small object collectives of the trainer (through the default group; gloo and NCCL alike)."""

from __future__ import annotations

import torch.distributed as dist


def broadcast_object(obj):
    """Rank 0's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj) -> list:
    """Every rank's ``obj``, by rank."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def first_error(local: str | None) -> str | None:
    """The first rank's error message, or None if no rank had one."""
    return next((e for e in gather_objects(local) if e is not None), None)
