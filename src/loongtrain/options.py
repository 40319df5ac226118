"""The names of loongtrain's options, and their checks. A leaf module: no torch, no imports
from the rest of the package, so the training config, the parallel layout, the
parallelize functions and the planner all read the same names from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Placement = Literal["head_first", "context_first"]
ContextOrder = Literal["contiguous", "interleaved"]
ActivationCheckpoint = Literal["none", "full", "sc++"]
ZeroScope = Literal["none", "dp", "sp", "dp_sp"]
Balance = Literal["zigzag", "documents", "locality"]

#: ``head_first``: a head group on consecutive ranks; ``context_first``: a context group.
PLACEMENTS: tuple[str, ...] = get_args(Placement)
#: ``contiguous``: ring windows of consecutive context-group members; ``interleaved``: strided.
CONTEXT_ORDERS: tuple[str, ...] = get_args(ContextOrder)
#: activation checkpointing per block: nothing, the whole block, or the block minus the attention.
ACTIVATION_CHECKPOINT_MODES: tuple[str, ...] = get_args(ActivationCheckpoint)
#: where model states are sharded: nowhere, across dp, within the sp group, over every rank.
ZERO_SCOPES: tuple[str, ...] = get_args(ZeroScope)
#: how sequence chunks are assigned to context ranks (see ``loongtrain.attention.balance``).
BALANCES: tuple[str, ...] = get_args(Balance)
#: what the token-file loader does with a document longer than a sequence (data.long_documents)
LONG_DOCUMENTS: tuple[str, ...] = ("split", "drop")
#: ``fixed``: every microbatch on the configured hp x cp; ``per_batch``: each microbatch on the
#: hp x cp split of the same ranks that ``loongtrain.attention.choose`` prices fastest.
LAYOUT_MODES: tuple[str, ...] = ("fixed", "per_batch")


def check_activation_checkpoint(mode: str, every: int = 1) -> None:
    """Raise ValueError unless ``mode`` is an activation checkpoint mode and ``every`` a positive integer."""
    if mode not in ACTIVATION_CHECKPOINT_MODES:
        raise ValueError(
            f"unknown activation checkpoint mode {mode!r}; choose one of {list(ACTIVATION_CHECKPOINT_MODES)}"
        )
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"activation checkpoint every={every!r} must be a positive integer (1 = every layer)")


def check_zero_scope(scope: str) -> None:
    """Raise ValueError unless ``scope`` is a ZeRO scope."""
    if scope not in ZERO_SCOPES:
        raise ValueError(f"unknown ZeRO scope {scope!r}; choose one of {list(ZERO_SCOPES)}")


@dataclass(frozen=True)
class MemoryOptions:
    """How a run trades recomputation and host transfers for device memory (the ``[memory]``
    keys of a training config; the planner prices the same options).

    Args:
        activation_checkpoint: per block, ``"none"``, ``"full"`` (recompute the whole block,
            distributed attention included) or ``"sc++"`` (recompute the block but keep the
            attention's results: Selective Checkpoint++).
        activation_checkpoint_every: checkpoint layers ``0, k, 2k, ...``.
        loss_chunk: the output layer and cross entropy run over chunks of this many tokens,
            one chunk's logits alive at a time (0: all of the rank's tokens at once).
        mlp_tile: the SwiGLU MLP runs over sequence tiles of this many tokens, recomputed per
            tile in backward (0: off).
        offload_activations: what activation checkpointing keeps per layer lives in host
            memory between the layer's forward and its backward (needs ``full`` or ``sc++``).
        offload_states: parameters, gradients and optimizer states live in host memory
            (FSDP2's ``CPUOffloadPolicy``; the optimizer steps on the CPU).
    """

    activation_checkpoint: ActivationCheckpoint = "none"
    activation_checkpoint_every: int = 1
    loss_chunk: int = 1024
    mlp_tile: int = 0
    offload_activations: bool = False
    offload_states: bool = False

    def __post_init__(self) -> None:
        check_activation_checkpoint(self.activation_checkpoint, self.activation_checkpoint_every)
        for name in ("loss_chunk", "mlp_tile"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"MemoryOptions: {name}={value!r} must be 0 (off) or a positive number of tokens")
        for name in ("offload_activations", "offload_states"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MemoryOptions: {name}={getattr(self, name)!r} must be true or false")
        if self.offload_activations and self.activation_checkpoint == "none":
            raise ValueError(
                "MemoryOptions: offload_activations moves what activation checkpointing keeps, and "
                "activation_checkpoint='none' keeps nothing to move; use 'full' or 'sc++'"
            )
