"""The vocabulary matrices' float32 gradients written straight into their ZeRO shards.

FSDP2 computes every gradient in the parameters' compute dtype and, after the embedding's
backward, copies the root's gradients into a float32 buffer of their full size to reduce
them: for the embedding and output matrices that is, per matrix, a ``[vocab, dim]``
gradient in bf16 and a float32 one beside the float32 gradient kept (Llama-3-8B: 1 + 2.1 +
2.1 GB). The chunked loss builds the output matrix's float32 gradient anyway and the
embedding's is a scatter of rows, so :class:`ShardGradient` (a
:class:`~loongtrain.model.vocab.GradientSink`) takes them in float32 and adds them into the
sharded parameter's gradient: on one rank in place (the embedding's rows added into the
gradient itself, no dense buffer at all), on several through one reduce-scatter of the
dense gradient into the rank's shard (the dense buffer itself the collective's input) and,
under HSDP, an all-reduce of the shard over the replicas. FSDP2 then finds no
gradient on those matrices and reduces only the rest of the root.

Where a rank's shard is the whole matrix on the compute device (one shard: one rank, or the
states replicated, and not offloaded), :meth:`ShardGradient.master` hands it to the model,
which reads it directly instead of through FSDP2's gathered copy (``model/vocab.py``).

The gradient made is the one FSDP2 would make (the same sum, reduced in float32), in the
parameter's placements, so the optimizer, clipping and checkpoints see no difference.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from loongtrain.apply.zero_comm import count_reduce, reduce_scatter_into
from loongtrain.parallel.stats import AttentionStats

Tensor = torch.Tensor

__all__ = ["ShardGradient", "apply_vocab_gradients"]


class ShardGradient:
    """Float32 gradient contributions of one FSDP2-sharded ``[vocab, dim]`` parameter, added
    into its ``.grad`` (a DTensor in the parameter's placements); collectives counted into
    ``stats`` as ZeRO's reduce-scatter (and all-reduce) bytes; ``compute_dtype`` the dtype
    FSDP2 casts the matrix to for compute."""

    def __init__(self, param: DTensor, stats: AttentionStats, compute_dtype: torch.dtype | None = None) -> None:
        if not isinstance(param, DTensor):
            raise TypeError(f"ShardGradient: expected an FSDP2-sharded (DTensor) parameter, got {type(param).__name__}")
        self.param, self.stats = param, stats
        self.compute_dtype = compute_dtype or param.dtype
        self.mesh, self.placements = param.device_mesh, param.placements
        self.single = self.mesh.size() == 1
        self.shards = self.mesh.size(self.mesh.ndim - 1)  # FSDP2's mesh: (replicate, shard) or (shard,)
        self.replicas = self.mesh.size(0) if self.mesh.ndim == 2 else 1

    def master(self) -> Tensor | None:
        if self.shards > 1:
            return None
        local = self.param.to_local()
        return local if local.device.type == self.mesh.device_type else None  # not when offloaded to the host

    def add(self, grad: Tensor) -> None:
        if self.single:
            self._add_local(grad)
            return
        n = self.shards
        rows = -(-grad.shape[0] // n)  # torch.chunk's (and FSDP2's) rows per shard
        shard = grad
        if n > 1:
            if grad.shape[0] != rows * n:  # the last shards short: reduce a padded copy
                grad = torch.cat([grad, grad.new_zeros((rows * n - grad.shape[0], *grad.shape[1:]))])
            shard = grad.new_empty((rows, *grad.shape[1:]))
            reduce_scatter_into(shard, grad, op=dist.ReduceOp.SUM, group=self.mesh.get_group(self.mesh.ndim - 1))
        if self.replicas > 1:  # HSDP: summed over the replicas too
            dist.all_reduce(shard, group=self.mesh.get_group(0))
        count_reduce(self.stats, shard, n, self.replicas)
        self._add_local(shard[: self.param.to_local().shape[0]])

    def add_rows(self, ids: Tensor, rows: Tensor) -> None:
        if self.single:  # the gradient is the whole matrix: add the rows into it
            local = self._local_grad()
            local.index_add_(0, ids.to(local.device), rows.to(local.device))
            return
        dense = torch.zeros(self.param.shape, dtype=torch.float32, device=rows.device)
        self.add(dense.index_add_(0, ids, rows))

    def _local_grad(self) -> Tensor:
        if self.param.grad is None:
            local = self.param.to_local()
            self._set(torch.zeros(local.shape, dtype=torch.float32, device=local.device))
        return self.param.grad.to_local()

    def _add_local(self, local: Tensor) -> None:
        if self.param.grad is None:
            self._set(local)
        else:
            grad = self.param.grad.to_local()  # on the host when the states are offloaded
            grad.add_(local.to(grad.device))

    def _set(self, local: Tensor) -> None:
        """Make ``local`` (on any device) the gradient, on the device of the parameter's shard."""
        device = self.param.to_local().device
        if device.type == self.mesh.device_type:
            self.param.grad = DTensor.from_local(
                local.to(device), self.mesh, self.placements, run_check=False, shape=self.param.shape,
                stride=self.param.stride(),
            )  # fmt: skip
            return
        # states offloaded to the host (FSDP2's CPUOffloadPolicy): DTensor.from_local would move the
        # gradient to the mesh's device, and a gradient must be on its parameter's device
        grad = torch.empty_like(self.param, dtype=torch.float32)
        grad.to_local().copy_(local)
        self.param.grad = grad


def apply_vocab_gradients(model, stats: AttentionStats, compute_dtype: torch.dtype | None = None) -> None:
    """Give the FSDP2-sharded ``model`` (after ``fully_shard``) a :class:`ShardGradient` for
    its embedding and output matrices (one when they are tied): the embedding lookup and the
    chunked loss write their float32 gradients there (:mod:`loongtrain.model.vocab`).
    ``compute_dtype``: FSDP2's ``param_dtype`` (None: the parameters' own)."""
    model.tok_embeddings.sink = ShardGradient(model.tok_embeddings.weight, stats, compute_dtype)
    if model.output is not None:
        model.output.sink = ShardGradient(model.output.weight, stats, compute_dtype)
