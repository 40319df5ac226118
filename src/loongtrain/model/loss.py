"""The language-model loss without the full logits: the output layer and cross entropy over
chunks of tokens, one chunk's ``[chunk, vocab]`` logits alive at a time.

A long shard's logits are the largest tensor of a step (Llama-3's vocabulary of 128K at
32K tokens: 16 GiB in float32, and its gradient again). :func:`lm_loss` computes, for each
chunk of ``chunk`` rows of the final hidden states ``h``, the logits ``h_c W^T`` in the
compute dtype, their float32 log-softmax, the summed loss and the correct argmax
predictions, and -- because the loss is the end of the graph -- the gradients right there
(the approach of Liger's fused linear cross entropy): ``dL/dh_c`` into a ``[T, dim]``
buffer and ``dL/dW`` accumulated in float32. Backward only scales them, in place, by the
incoming gradient and hands them over (the ``[vocab, dim]`` accumulator is the gradient
returned, cast only when the weight is not float32, or given to a gradient sink:
:mod:`loongtrain.model.vocab`). The result equals ``F.cross_entropy(F.linear(h,
W).float(), labels, reduction="sum")`` and its gradients, up to float32 summation order.

:func:`token_scores` is the forward-only variant for evaluation: per-token loss and
whether the argmax is the target, chunk by chunk, without gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongtrain.model import config
from loongtrain.model.norm import RMSNorm, rms_norm, rms_norm_backward, sum_parts
from loongtrain.model.vocab import GradientSink

Tensor = torch.Tensor

IGNORE_INDEX = -100


def _chunk_rows(h: Tensor, weight: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One chunk's float32 logits turned, in place, into their softmax; beside it the
    log-sum-exp, the target's logit, whether the argmax is the target, and which rows are
    scored. The logits' buffer is the only ``[chunk, vocab]`` float32 one: ``torch.logsumexp``
    would allocate a second (its ``x - max``)."""
    logits = _logits(h, weight)
    scored = labels != IGNORE_INDEX
    targets = torch.where(scored, labels, 0)
    picked = logits.gather(1, targets.unsqueeze(1)).squeeze(1)
    correct = (logits.argmax(dim=-1) == labels) & scored
    top = logits.amax(dim=-1, keepdim=True)
    probs = logits.sub_(top).exp_()
    total = probs.sum(dim=-1, keepdim=True)
    lse = (top + total.log()).squeeze(1)
    return probs.div_(total), lse, picked, correct, scored


def _vocab_slices(matrix: Tensor, dtype: torch.dtype) -> list[slice]:
    """The rows of the ``[vocab, dim]`` ``matrix`` a slice at a time, products in ``dtype``
    (:func:`~loongtrain.model.config.vocab_slice_rows`, read at call time)."""
    vocab, dim = matrix.shape
    step = config.vocab_slice_rows(vocab, dim, dtype.itemsize)
    return [slice(first, first + step) for first in range(0, vocab, step)]


def _logits(h: Tensor, weight: Tensor) -> Tensor:
    """``F.linear(h, weight).float()``; a ``weight`` in another dtype than ``h`` (the float32
    master, :mod:`loongtrain.model.vocab`) is cast a vocabulary slice at a time, each slice's
    logits written into the float32 buffer."""
    if weight.dtype == h.dtype:
        return F.linear(h, weight).float()
    logits = torch.empty((h.shape[0], weight.shape[0]), dtype=torch.float32, device=h.device)
    for rows in _vocab_slices(weight, h.dtype):
        logits[:, rows] = F.linear(h, weight[rows].to(h.dtype))
    return logits


def _input_gradient(grad: Tensor, weight: Tensor, out: Tensor) -> None:
    """``out = grad @ weight``; a ``weight`` in another dtype than ``grad``: cast a vocabulary
    slice at a time, the slices' products summed in float32."""
    if weight.dtype == grad.dtype:
        torch.mm(grad, weight, out=out)
        return
    total = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for rows in _vocab_slices(weight, grad.dtype):
        total += grad[:, rows] @ weight[rows].to(grad.dtype)
    out.copy_(total)


def _chunk(
    h_c: Tensor,
    weight: Tensor,
    y_c: Tensor,
    grad_h_c: Tensor | None,
    grad_w: Tensor | None,
    groups_c: Tensor | None = None,
    group_sums: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Loss and correct count of one chunk; with ``grad_h_c`` / ``grad_w`` also its gradients
    (written into ``grad_h_c``, added to ``grad_w``; either may be None); with ``groups_c``
    its rows' losses added into ``group_sums`` by group. Its ``[chunk, vocab]`` temporaries
    are freed when it returns, before the next chunk allocates its own."""
    probs, lse, picked, correct, scored = _chunk_rows(h_c, weight, y_c)
    rows = torch.where(scored, lse - picked, 0.0)
    loss = rows.sum()
    if groups_c is not None:
        group_sums.index_add_(0, groups_c, rows)
    if grad_h_c is not None or grad_w is not None:
        # d(sum of losses)/d(logits) = softmax - one_hot(target), zero on ignored rows
        targets = torch.where(scored, y_c, 0)
        probs.scatter_add_(1, targets.unsqueeze(1), torch.full_like(lse, -1.0).unsqueeze(1))
        grad = probs.mul_(scored.unsqueeze(1)).to(h_c.dtype)
        if grad_h_c is not None:
            _input_gradient(grad, weight, grad_h_c)
        if grad_w is not None and grad.dtype == torch.float32:
            grad_w.addmm_(grad.t(), h_c)
        elif grad_w is not None:  # products in the compute dtype summed in float32, a vocabulary slice at a time
            for rows in _vocab_slices(grad_w, h_c.dtype):
                grad_w[rows] += grad[:, rows].t() @ h_c
    return loss, correct.sum()


class _ChunkedLoss(torch.autograd.Function):
    """Summed cross entropy of ``F.linear(h, weight)``, the count of correct argmaxes and the
    loss sums per group (``[n_groups]``, empty without ``groups``), gradients computed in
    forward chunk by chunk."""

    @staticmethod
    def forward(
        ctx,
        h: Tensor,
        weight: Tensor,
        labels: Tensor,
        chunk: int,
        sink: GradientSink | None,
        norm_weight: Tensor | None,
        eps: float,
        groups: Tensor | None = None,
        n_groups: int = 0,
    ) -> tuple[Tensor, Tensor, Tensor]:
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        correct = torch.zeros((), dtype=torch.int64, device=h.device)
        group_sums = torch.zeros(n_groups if groups is not None else 0, dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = grad_norm = None
        if ctx.needs_input_grad[1]:
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, h.shape[0], chunk):
            rows = slice(start, start + chunk)
            x_c = h[rows]
            groups_c = None if groups is None else groups[rows]
            if norm_weight is None:
                grad_h_c = grad_h[rows] if grad_h is not None else None
                loss_c, correct_c = _chunk(x_c, weight, labels[rows], grad_h_c, grad_w, groups_c, group_sums)
            else:  # the final norm, chunk by chunk: its output and gradient exist for one chunk
                h_c, rstd = rms_norm(x_c, norm_weight, eps)
                grad_h_c = torch.empty_like(h_c) if grad_h is not None else None
                loss_c, correct_c = _chunk(h_c, weight, labels[rows], grad_h_c, grad_w, groups_c, group_sums)
                del h_c
                if grad_h_c is not None:
                    grad_h[rows], part = rms_norm_backward(grad_h_c, x_c, norm_weight, rstd, ctx.needs_input_grad[5])
                    grad_norm = sum_parts(grad_norm, part)
            loss += loss_c
            correct += correct_c
        # kept on ctx, not saved: backward scales them in place and hands them over, so the
        # float32 [vocab, dim] accumulator is never copied (a saved tensor could not be)
        ctx.grads = (grad_h, grad_w, grad_norm)
        ctx.weight_dtype = weight.dtype
        ctx.norm_dtype = None if norm_weight is None else norm_weight.dtype
        ctx.sink = sink
        ctx.mark_non_differentiable(correct, group_sums)
        return loss, correct, group_sums

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_correct: Tensor, _grad_groups: Tensor):
        if ctx.grads is None:
            raise RuntimeError(
                "lm_loss: the chunked loss's gradients were made in forward and handed over by the first "
                "backward; a second backward through the same graph (retain_graph=True) is not supported: "
                "run the forward again, or use loss_chunk=0"
            )
        grad_h, grad_w, grad_norm = ctx.grads
        ctx.grads = None
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_loss.to(grad_h.dtype))
        if grad_norm is not None:
            grad_norm = (grad_norm.float() * grad_loss).to(ctx.norm_dtype)
        if grad_w is not None and ctx.sink is not None:
            ctx.sink.add(grad_w.mul_(grad_loss))
            grad_w = None
        elif grad_w is not None:
            grad_w = grad_w.mul_(grad_loss).to(ctx.weight_dtype)  # no copy when the weight is float32
        return grad_h, grad_w, None, None, None, grad_norm, None, None, None


def lm_loss(
    h: Tensor,
    weight: Tensor,
    labels: Tensor,
    chunk: int = 0,
    sink: GradientSink | None = None,
    norm: RMSNorm | None = None,
    groups: Tensor | None = None,
    n_groups: int = 0,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """Summed next-token cross entropy (float32 scalar, differentiable in ``h`` and ``weight``)
    and the number of targets whose argmax prediction is right (int64 scalar); with ``groups``
    also the loss summed per group.

    ``h`` [..., dim] final hidden states, ``weight`` [vocab, dim] the output matrix (with
    ``chunk`` > 0 it may be a float32 master with ``h`` in a lower precision: read in ``h``'s
    dtype a vocabulary slice at a time), ``labels`` [...] targets (IGNORE_INDEX = -100: not
    scored). ``chunk`` > 0 processes that many rows at a time (the logits of one chunk alive at
    a time, gradients made in forward); 0: all rows at once, through PyTorch's
    ``cross_entropy``. ``sink`` (with ``chunk`` > 0): the weight's float32 gradient goes there
    (:mod:`loongtrain.model.vocab`), none to autograd. ``norm``: the final RMSNorm, applied
    here to ``h`` (then the last block's output), chunk by chunk with ``chunk`` > 0: the
    normed hidden states and their gradient never exist for the whole shard, only ``h``'s
    gradient (made in forward) does.

    ``groups`` (int64 shaped like ``labels``, values in ``[0, n_groups)``: e.g. the source of
    each token, ``Microbatch.sources``): then a third value, the float32 loss summed per group
    ``[n_groups]`` (detached; its sum is the summed loss up to float32 rounding), made in the
    same pass over the logits. Without ``groups`` the two values as ever.
    """
    if groups is not None:
        if groups.shape != labels.shape:
            raise ValueError(f"groups {tuple(groups.shape)} must be shaped like the labels {tuple(labels.shape)}")
        if n_groups < 1:
            raise ValueError(f"n_groups={n_groups}: give the number of groups (ids lie in [0, n_groups))")
        groups = groups.reshape(-1)
    if norm is not None and chunk <= 0:
        h, norm = norm(h), None
    h, labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    if norm is not None or chunk > 0:
        norm_weight, eps = (norm.weight, norm.eps) if norm is not None else (None, 0.0)
        loss, correct, group_sums = _ChunkedLoss.apply(h, weight, labels, chunk, sink, norm_weight, eps, groups,
                                                       n_groups)  # fmt: skip
        return (loss, correct) if groups is None else (loss, correct, group_sums)
    logits = F.linear(h, weight)
    correct = ((logits.detach().argmax(dim=-1) == labels) & (labels != IGNORE_INDEX)).sum()
    if groups is None:
        loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
        return loss, correct
    rows = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")  # 0 where ignored
    group_sums = torch.zeros(n_groups, dtype=torch.float32, device=h.device).index_add_(0, groups, rows.detach())
    return rows.sum(), correct, group_sums


@torch.no_grad()
def token_scores(h: Tensor, weight: Tensor, labels: Tensor, chunk: int = 0) -> tuple[Tensor, Tensor]:
    """Per-token loss (float32, 0 where not scored) and whether the argmax prediction is the
    target (bool), shaped like ``labels``; ``chunk`` rows of logits at a time (0: all)."""
    shape = labels.shape
    h, labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    step = chunk if chunk > 0 else max(1, h.shape[0])
    scores = [
        _chunk_scores(h[start : start + step], weight, labels[start : start + step])
        for start in range(0, h.shape[0], step)
    ]
    return torch.cat([s for s, _ in scores]).view(shape), torch.cat([c for _, c in scores]).view(shape)


def _chunk_scores(h_c: Tensor, weight: Tensor, y_c: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token loss and correctness of one chunk (its logits freed on return)."""
    _, lse, picked, correct, scored = _chunk_rows(h_c, weight, y_c)
    return torch.where(scored, lse - picked, 0.0), correct
