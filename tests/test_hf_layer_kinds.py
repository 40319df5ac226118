"""Models with layer kinds imported from Hugging Face train as transformers computes them:
on packed documents, the loss and every gradient of the imported model (one process, 2D
attention, the double ring on the documents balance; sliding layers through the halo) equal
transformers' own model run on each document alone, in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from hf_tiny import make_hf_model, rel_err

pytest.importorskip("transformers")
# a window on layer 1 only; a NoPE sliding layer beside a RoPE full one; OLMo 3's post-norms, projection-wide
# q/k norms, a sliding layer with its own RoPE beside a YaRN full one; Gemma 3's (1 + weight) sandwich norms, GeGLU,
# query_pre_attn_scalar, embedding scale and two RoPE bases
FAMILIES = ("qwen2-window", "smollm3", "olmo3", "gemma3_text")
SEQ, CU = 64, [0, 9, 30, 33, 64]  # documents longer and shorter than the window (5) and the chunks


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 96, (1, SEQ), generator=gen)
    labels = torch.randint(0, 96, (1, SEQ), generator=gen)
    labels[0, [b - 1 for b in CU[1:]]] = -100  # no target across a document boundary
    return tokens, labels


def _transformers(folder) -> tuple[float, dict]:
    """transformers' model on each document alone: the summed loss and its gradients, per target."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokens, labels = _batch()
    targets = int((labels != -100).sum())
    total = 0.0
    for a, b in zip(CU, CU[1:]):
        logits = model(input_ids=tokens[:, a:b]).logits
        total = total + F.cross_entropy(logits[0], labels[0, a:b], ignore_index=-100, reduction="sum") / targets
    total.backward()
    return total.item(), {name: p.grad for name, p in model.named_parameters()}


def _loongtrain(folder: str, layout: dict) -> tuple[float, dict]:
    from loongtrain.apply import parallelize
    from loongtrain.data.batch import Microbatch
    from loongtrain.hf.load import load_weights, read_folder
    from loongtrain.hf.weights import to_hf_tensors
    from loongtrain.model import build_model
    from loongtrain.train.step import forward_backward

    from dist_pool import cached_state

    state = cached_state(**layout)
    hf = read_folder(folder)
    model = build_model(hf.model)
    parallelize(model, state, zero="dp_sp")
    model.to_empty(device="cpu")
    load_weights(model, hf)
    tokens, labels = _batch()
    loss = forward_backward(model, state, [Microbatch(tokens, labels, torch.tensor(CU))]).loss
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
    return loss, to_hf_tensors(hf.model, grads)


def _check_against_transformers(dist_pool, tmp_path, layouts: list[tuple[int, dict]]) -> None:
    for i, family in enumerate(FAMILIES):
        folder = make_hf_model(family, tmp_path / family, seed=40 + i)
        want_loss, want = _transformers(folder)
        for world, layout in layouts:
            for rank, (loss, grads) in enumerate(dist_pool(world).run(_loongtrain, str(folder), layout)):
                where = f"{family} {layout} rank {rank}"
                assert abs(loss - want_loss) / abs(want_loss) < 1e-5, f"{where}: loss {loss} vs {want_loss}"
                assert set(grads) == set(want), where
                for name, grad in grads.items():
                    err = rel_err(grad, want[name])
                    assert err < 1e-5, f"{where} grad {name}: rel err {err:.2e}"


@pytest.mark.dist
def test_loss_and_gradients_equal_transformers_on_packed_documents(dist_pool, tmp_path):
    layouts = [(1, {}), (4, {"hp": 2, "cp": 2}), (4, {"cp": 4, "ring_window": 2, "balance": "documents"})]
    _check_against_transformers(dist_pool, tmp_path, layouts)


@pytest.mark.dist
@pytest.mark.slow
def test_loss_and_gradients_equal_transformers_on_eight_processes(dist_pool, tmp_path):
    """The same at world 8 (issue 55's 1, 4 and 8 processes): 2D with the double ring, and a ring of 8
    on the documents balance (windows of 4)."""
    layouts = [(8, {"hp": 2, "cp": 4, "ring_window": 2}), (8, {"cp": 8, "ring_window": 4, "balance": "documents"})]
    _check_against_transformers(dist_pool, tmp_path, layouts)
