"""The loss summed per group (per source of a mixture) beside the summed loss: from the
chunked loss and the whole-shard one, through the model's forward, against float64
cross entropy summed per group; without groups, the values and gradients as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loongtrain import build_model, materialize
from loongtrain.model import model_config
from loongtrain.model.loss import IGNORE_INDEX, lm_loss
from loongtrain.model.norm import RMSNorm

GROUPS = 3


def _inputs(seed: int = 0, tokens: int = 37, dim: int = 16, vocab: int = 50):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(2, tokens, dim, generator=gen)
    weight = torch.randn(vocab, dim, generator=gen) / dim**0.5
    labels = torch.randint(0, vocab, (2, tokens), generator=gen)
    labels[torch.rand(2, tokens, generator=gen) < 0.2] = IGNORE_INDEX
    groups = torch.randint(0, GROUPS, (2, tokens), generator=gen)
    groups[0, :5] = 2  # group 1 may be absent from some rows; every group is present somewhere
    return h, weight, labels, groups


def _reference(h, weight, labels, groups, norm=None) -> torch.Tensor:
    """float64 cross entropy per token, summed per group."""
    x = h.double()
    if norm is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
    per_token = F.cross_entropy(
        F.linear(x, weight.double()).flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return torch.zeros(GROUPS, dtype=torch.float64).index_add_(0, groups.flatten(), per_token)


@pytest.mark.parametrize("chunk", [0, 7, 1000], ids=["whole", "chunked", "one-chunk"])
@pytest.mark.parametrize("with_norm", [False, True], ids=["no-norm", "norm"])
def test_group_sums_match_float64_and_leave_the_loss_and_gradients_alone(chunk, with_norm):
    h, weight, labels, groups = _inputs()
    norm = None
    if with_norm:
        norm = RMSNorm(h.shape[-1], 1e-5)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(h.shape[-1], generator=torch.Generator().manual_seed(1)))
    runs = []
    for g in (None, groups):
        hh, ww = h.clone().requires_grad_(), weight.clone().requires_grad_()
        out = lm_loss(hh, ww, labels, chunk, norm=norm, groups=g, n_groups=GROUPS if g is not None else 0)
        out[0].backward()
        runs.append((out, hh.grad, ww.grad))
    (loss, correct), grad_h, grad_w = runs[0]
    (loss_g, correct_g, sums), grad_h_g, grad_w_g = runs[1]
    assert len(runs[0][0]) == 2 and len(runs[1][0]) == 3  # without groups: the two values as ever
    ref = _reference(h, weight, labels, groups, norm)
    assert sums.dtype == torch.float32 and sums.shape == (GROUPS,) and not sums.requires_grad
    torch.testing.assert_close(sums.double(), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(sums.sum(), loss_g.detach(), rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(loss_g, loss, rtol=1e-6, atol=1e-5)
    assert torch.equal(correct_g, correct)
    torch.testing.assert_close(grad_h_g, grad_h, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_w_g, grad_w, rtol=1e-6, atol=1e-7)
    if chunk:  # the chunked loss: the same arithmetic with groups, to the bit
        assert torch.equal(loss_g, loss) and torch.equal(grad_h_g, grad_h)


@pytest.mark.parametrize("tied", [False, True], ids=["output-layer", "tied"])
def test_groups_through_the_model_forward_and_bad_groups(tied):
    torch.manual_seed(0)
    model = build_model(model_config("debug", vocab_size=64, n_layers=1, tie_embeddings=tied))
    materialize(model, torch.device("cpu"), seed=0)
    assert (model.output is None) == tied
    tokens = torch.randint(0, 64, (1, 24))
    labels = torch.roll(tokens, -1, 1)
    groups = (torch.arange(24) >= 10).long().unsqueeze(0) * 2  # groups 0 and 2; group 1 absent
    positions = torch.arange(24)
    for chunk in (0, 5):
        model.loss_chunk = chunk
        loss, correct = model(tokens, positions, labels=labels)
        loss_g, correct_g, sums = model(tokens, positions, labels=labels, groups=groups, n_groups=3)
        with torch.no_grad():
            h = model.norm(model.residual_stream(tokens, positions))
            per_token = F.cross_entropy(
                F.linear(h.double(), model.output_weight.double())[0], labels[0], reduction="none"
            )
        expected = torch.stack([per_token[:10].sum(), per_token[:0].sum(), per_token[10:].sum()])
        torch.testing.assert_close(sums.double(), expected, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(loss_g, loss)
        assert torch.equal(correct_g, correct) and torch.isfinite(sums).all()
    with pytest.raises(ValueError, match=r"groups \(1, 23\) must be shaped like the labels \(1, 24\)"):
        model(tokens, positions, labels=labels, groups=groups[:, 1:], n_groups=3)
    with pytest.raises(ValueError, match="n_groups=0: give the number of groups"):
        model(tokens, positions, labels=labels, groups=groups)
