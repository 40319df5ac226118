"""The vocabulary matrices' float32 gradients handed to a sink instead of autograd.

Under mixed precision the embedding and output matrices are used in the compute dtype, so
autograd would make each one's gradient as a ``[vocab, dim]`` tensor in that dtype, which
the sharding layer then copies into a float32 buffer of the same size to reduce: two
vocabulary-sized buffers per matrix, beside the float32 gradient that is kept. With a
:class:`GradientSink` (``loongtrain.parallelize`` makes one per matrix under ZeRO,
``apply/vocab.py``), :func:`embedding` and the chunked loss
(:func:`~loongtrain.model.loss.lm_loss`) give it their float32 gradient directly: the
loss the ``[vocab, dim]`` accumulator it builds anyway, the lookup the gathered rows of the
output gradient, which the sink adds into the kept gradient (on one rank) or reduces into
the rank's shard. Autograd gets no gradient for the matrix.

Where the rank holds the whole matrix as its float32 master copy on the compute device (ZeRO
over one shard: one rank, or states replicated), the sink says so (:meth:`GradientSink.master`)
and the model reads that copy directly (:meth:`~loongtrain.model.llama.Embedding.lookup`,
:meth:`~loongtrain.model.llama.OutputLayer.head`): the lookup's rows cast to the compute
dtype, the chunked loss's vocabulary slices cast one at a time. The sharding layer's gathered
``[vocab, dim]`` copy in the compute dtype is then never made.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


class GradientSink(Protocol):
    """Takes float32 gradient contributions of one ``[vocab, dim]`` matrix."""

    compute_dtype: torch.dtype  # the dtype the matrix is used in (its rows cast to it when read from the master)

    def master(self) -> Tensor | None:
        """The whole matrix as this rank keeps it (float32) where it lies on the compute device
        unsharded, else None (then the matrix is read through its module, gathered)."""

    def add(self, grad: Tensor) -> None:
        """Add the dense float32 gradient ``grad`` (``[vocab, dim]``; the sink may reuse it)."""

    def add_rows(self, ids: Tensor, rows: Tensor) -> None:
        """Add float32 ``rows`` ``[n, dim]`` to the gradient's rows ``ids`` ``[n]`` (repeats summed)."""


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens: Tensor, weight: Tensor, sink: GradientSink, dtype: torch.dtype | None) -> Tensor:
        ctx.save_for_backward(tokens)
        ctx.sink = sink
        rows = F.embedding(tokens, weight)
        return rows if dtype is None else rows.to(dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (tokens,) = ctx.saved_tensors
        ctx.sink.add_rows(tokens.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1]).float())
        return None, None, None, None


def embedding(
    tokens: Tensor, weight: Tensor, sink: GradientSink | None = None, dtype: torch.dtype | None = None
) -> Tensor:
    """``F.embedding(tokens, weight)``, its rows cast to ``dtype`` when given; with ``sink``
    its weight gradient (float32) goes to the sink, not to autograd."""
    if sink is None or not (torch.is_grad_enabled() and weight.requires_grad):
        rows = F.embedding(tokens, weight)
        return rows if dtype is None else rows.to(dtype)
    return _Lookup.apply(tokens, weight, sink, dtype)
