"""``memory.activation_checkpoint = "auto"``: the run's checkpointing chosen by the planner's
memory model (:func:`~loongtrain.planner.policy.auto_policy`) for this layout, length and
device: the least recompute whose predicted peak fits ``memory.device_memory_gib`` (0: 90% of
a GPU's own memory, the planner presets' usable share). Every rank resolves it alike (the
smallest budget of any rank) before the model is built; the start-up line prints the choice."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from loongtrain.config import ConfigError, TrainConfig
from loongtrain.data.loader import rows_per_microbatch
from loongtrain.options import AUTO_CHECKPOINT
from loongtrain.planner.cost import Workload
from loongtrain.planner.policy import CheckpointPolicy, auto_policy
from loongtrain.train.spec import RunSpec

GiB = 2**30
#: of a GPU's memory the plan may fill (the rest: CUDA context, allocator slack), as the planner's presets
USABLE_FRACTION = 0.9


def check_auto_budget(cfg: TrainConfig, device_type: str) -> None:
    """Raise ConfigError where ``auto`` has no budget to fill: off a GPU, ``memory.device_memory_gib``
    must say it (no process group needed: preflight calls this)."""
    if (
        cfg.memory.activation_checkpoint == AUTO_CHECKPOINT
        and device_type != "cuda"
        and not cfg.memory.device_memory_gib
    ):
        raise ConfigError(
            f"memory.activation_checkpoint='auto' fills the device's memory, and on {device_type} there is no device "
            f"total to read: set memory.device_memory_gib (the GiB one rank may use), or choose full, sc++ or none"
        )


def budget_bytes(cfg: TrainConfig, device: torch.device) -> float:
    """This rank's budget: ``memory.device_memory_gib``, else 90% of the GPU's total memory."""
    if cfg.memory.device_memory_gib:
        return cfg.memory.device_memory_gib * GiB
    check_auto_budget(cfg, device.type)
    return torch.cuda.get_device_properties(device).total_memory * USABLE_FRACTION


def resolve_memory_policy(
    cfg: TrainConfig, spec: RunSpec, device: torch.device
) -> tuple[RunSpec, CheckpointPolicy | None]:
    """Collective where ``auto``: ``spec`` with its checkpointing chosen, and the choice (None
    and ``spec`` unchanged for any other mode)."""
    if spec.memory.activation_checkpoint != AUTO_CHECKPOINT:
        return spec, None
    budget = torch.tensor([budget_bytes(cfg, device)], dtype=torch.float64, device=device)
    dist.all_reduce(budget, op=dist.ReduceOp.MIN)  # every rank the same choice
    parallel = dataclasses.replace(spec.parallel, dp=spec.parallel.resolve_dp(dist.get_world_size()))
    rows = rows_per_microbatch(cfg.data.global_batch, parallel.dp, cfg.data.micro_batches)
    workload = Workload(
        spec.model, cfg.data.seq_len, batch=cfg.data.global_batch, micro_batch=rows,
        dtype_bytes=spec.param_dtype.itemsize,
    )  # fmt: skip
    policy = auto_policy(workload, parallel, cfg.parallel.zero, spec.memory, budget.item(), gpu=device.type == "cuda")
    return dataclasses.replace(spec, memory=policy.candidate.memory), policy
