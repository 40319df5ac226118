"""The language-model loss without the full logits: the output layer and cross entropy over
chunks of tokens, one chunk's ``[chunk, vocab]`` logits alive at a time.

A long shard's logits are the largest tensor of a step (Llama-3's vocabulary of 128K at
32K tokens: 16 GiB in float32, and its gradient again). :func:`lm_loss` computes, for each
chunk of ``chunk`` rows of the final hidden states ``h``, the logits ``h_c W^T`` in the
compute dtype, their float32 log-softmax, the summed loss and the correct argmax
predictions, and -- because the loss is the end of the graph -- the gradients right there
(the approach of Liger's fused linear cross entropy): ``dL/dh_c`` into a ``[T, dim]``
buffer and ``dL/dW`` accumulated in float32. Backward only scales them by the incoming
gradient. The result equals ``F.cross_entropy(F.linear(h, W).float(), labels,
reduction="sum")`` and its gradients, up to float32 summation order.

:func:`token_scores` is the forward-only variant for evaluation: per-token loss and
whether the argmax is the target, chunk by chunk, without gradients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

IGNORE_INDEX = -100


def _chunk_rows(h: Tensor, weight: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Logits of one chunk in float32, their log-sum-exp, the scored rows and safe targets."""
    logits = F.linear(h, weight).float()
    lse = torch.logsumexp(logits, dim=-1)
    scored = labels != IGNORE_INDEX
    targets = torch.where(scored, labels, 0)
    return logits, lse, scored, targets


def _chunk(
    h_c: Tensor, weight: Tensor, y_c: Tensor, grad_h_c: Tensor | None, grad_w: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Loss and correct count of one chunk; with ``grad_h_c``/``grad_w`` also its gradients
    (written into ``grad_h_c``, added to ``grad_w``). Its ``[chunk, vocab]`` temporaries are
    freed when it returns, before the next chunk allocates its own."""
    logits, lse, scored, targets = _chunk_rows(h_c, weight, y_c)
    picked = logits.gather(1, targets.unsqueeze(1)).squeeze(1)
    loss = torch.where(scored, lse - picked, 0.0).sum()
    correct = ((logits.argmax(dim=-1) == y_c) & scored).sum()
    if grad_w is not None:
        # d(sum of losses)/d(logits) = softmax - one_hot(target), zero on ignored rows
        grad = logits.sub_(lse.unsqueeze(1)).exp_()
        grad.scatter_add_(1, targets.unsqueeze(1), torch.full_like(lse, -1.0).unsqueeze(1))
        grad = grad.mul_(scored.unsqueeze(1)).to(h_c.dtype)
        torch.mm(grad, weight, out=grad_h_c)
        if grad.dtype == torch.float32:
            grad_w.addmm_(grad.t(), h_c)
        else:  # one [vocab, dim] product in the compute dtype, summed in float32
            grad_w += grad.t() @ h_c
    return loss, correct


class _ChunkedLoss(torch.autograd.Function):
    """Summed cross entropy of ``F.linear(h, weight)`` and the count of correct argmaxes,
    gradients computed in forward chunk by chunk."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, labels: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
        want_grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        correct = torch.zeros((), dtype=torch.int64, device=h.device)
        grad_h = torch.empty_like(h) if want_grads else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_grads else None
        for start in range(0, h.shape[0], chunk):
            rows = slice(start, start + chunk)
            loss_c, correct_c = _chunk(h[rows], weight, labels[rows], grad_h[rows] if want_grads else None, grad_w)
            loss += loss_c
            correct += correct_c
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_correct: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        grad_h = grad_h * grad_loss.to(grad_h.dtype) if ctx.needs_input_grad[0] else None
        grad_w = (grad_w * grad_loss).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return grad_h, grad_w, None, None


def lm_loss(h: Tensor, weight: Tensor, labels: Tensor, chunk: int = 0) -> tuple[Tensor, Tensor]:
    """Summed next-token cross entropy (float32 scalar, differentiable in ``h`` and ``weight``)
    and the number of targets whose argmax prediction is right (int64 scalar).

    ``h`` [..., dim] final hidden states, ``weight`` [vocab, dim] the output matrix, ``labels``
    [...] targets (IGNORE_INDEX = -100: not scored). ``chunk`` > 0 processes that many rows at a
    time (the logits of one chunk alive at a time, gradients made in forward); 0: all rows
    at once, through PyTorch's ``cross_entropy``.
    """
    h, labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    if chunk <= 0:
        logits = F.linear(h, weight)
        loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
        correct = ((logits.detach().argmax(dim=-1) == labels) & (labels != IGNORE_INDEX)).sum()
        return loss, correct
    return _ChunkedLoss.apply(h, weight, labels, chunk)


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
    logits, lse, scored, targets = _chunk_rows(h_c, weight, y_c)
    picked = logits.gather(1, targets.unsqueeze(1)).squeeze(1)
    return torch.where(scored, lse - picked, 0.0), (logits.argmax(dim=-1) == y_c) & scored
