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
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from loongtrain.apply.vocab import apply_vocab_gradients
from loongtrain.apply.zero_comm import count_zero_comm
from loongtrain.model.llama import Transformer
from loongtrain.options import check_zero_scope
from loongtrain.parallel import ParallelState

__all__ = ["apply_zero", "zero_mesh"]


def zero_mesh(state: ParallelState, scope: str) -> DeviceMesh:
    """The DeviceMesh FSDP uses for ``scope`` (built by ``init_parallel``)."""
    check_zero_scope(scope)
    if scope not in state.zero_meshes:
        raise ValueError(
            f"ZeRO scope {scope!r} has no mesh on this ParallelState: init_parallel built "
            f"{sorted(state.zero_meshes)}; pass zero_scopes including {scope!r} to init_parallel"
        )
    return state.zero_meshes[scope]


def _output_gathering(module: FSDPModule, args: tuple, kwargs: dict) -> None:
    """Before each call of the output layer (``OutputLayer.forward(h, labels, reduction,
    chunk)``): the chunked loss makes its gradients in forward, so the matrix is freed after
    it and not gathered again in backward; logits, or the whole-shard loss, need it in
    backward: kept gathered from the call to its backward."""
    labels = args[1] if len(args) > 1 else kwargs.get("labels")
    chunk = args[3] if len(args) > 3 else kwargs.get("chunk", 0)
    backward_needs_weight = labels is None or chunk <= 0
    module.set_unshard_in_backward(backward_needs_weight)
    module.set_reshard_after_forward(not backward_needs_weight, recurse=False)


def apply_zero(
    model: Transformer,
    state: ParallelState,
    scope: str = "dp_sp",
    *,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    offload_states: bool = False,
) -> None:
    """Shard ``model`` with FSDP2 (each block, then the root).

    ``param_dtype`` (e.g. ``torch.bfloat16``) casts parameters for compute while the
    sharded fp32 parameters stay the master copy; gradients are reduced in fp32.
    ``reshard_after_forward=False`` keeps gathered parameters from forward to backward
    (ZeRO-2-like: less communication, more memory); ``True`` is ZeRO-3.
    Every collective's bytes are counted into ``state.stats`` (kinds
    :data:`~loongtrain.apply.zero_comm.ZERO_KINDS`; ``model.zero_comm_counted`` says whether
    this torch allows it).
    ``offload_states`` keeps the sharded parameters and gradients (and so the optimizer
    states, built from them) in host memory: FSDP2's ``CPUOffloadPolicy``, pinned where an
    accelerator is present; the optimizer then steps on the CPU.
    """
    check_zero_scope(scope)
    mesh = zero_mesh(state, scope)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    extra = {}
    if offload_states:
        extra["offload_policy"] = CPUOffloadPolicy(pin_memory=state.device.type != "cpu")
    units: list[tuple[torch.nn.Module, bool]] = [(layer, reshard_after_forward) for layer in model.layers]
    if model.output is not None:
        # untied vocabulary matrices: each gathered only around its use, and not in backward,
        # whose float32 gradients go to their shards without them (apply/vocab.py); the
        # whole-shard loss's backward needs the output matrix: kept from the loss to its backward
        units += [(model.tok_embeddings, True), (model.output, True)]
    for unit, reshard in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, **extra)
    if model.output is not None:
        model.tok_embeddings.set_unshard_in_backward(False)
        model.output.register_forward_pre_hook(_output_gathering, prepend=True, with_kwargs=True)
    # the root keeps its parameters (the final norm; tied, the embedding) gathered after
    # forward: backward needs them first
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, **extra)
    # the vocabulary matrices' gradients: float32, into their shards (on one shard, their masters read directly)
    apply_vocab_gradients(model, state.stats, param_dtype)
    model.offload_states = offload_states  # materialize and the loaders allocate the states on the host then
    # each FSDP unit and whether it reshards after forward (generation gathers them for a while)
    model.zero_units = [*units, (model, False)]
    replicas = mesh.size(0) if mesh.ndim == 2 else 1
    shards = mesh.size(mesh.ndim - 1)
    model.zero_comm_counted = True
    for module in model.modules():
        if isinstance(module, FSDPModule):
            model.zero_comm_counted &= count_zero_comm(module, state.stats, replicas, shards)
            if replicas * shards > 1:  # on one rank the default (1) is the same sum without FSDP2's
                module.set_gradient_divide_factor(1.0)  # `input / factor` copy of every gradient
            # plain SUM collectives (gloo has no PREMUL_SUM; NCCL gets zero-copy sums)
            module.set_force_sum_reduction_for_comms(True)
