"""transformers models on loongtrain attention (AttentionInterface): the recipe of docs/attention.md on
4 processes (2D layout hp=2 x cp=2, zigzag shards with position ids) gives the loss and
every gradient of the same HF model run unsharded, for every supported family."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_tiny import FAMILIES, make_hf_model, rel_err

pytest.importorskip("transformers")
SEQ = 32
ROOT = Path(__file__).resolve().parents[1]


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 96, (2, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]  # labels shifted once, globally, before sharding


def _recipe(folder: str, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[float, dict]:
    import torch.distributed as dist
    import transformers

    import loongtrain as lt
    from loongtrain.hf.attention import register_attention

    from dist_pool import cached_state

    state = cached_state(hp=2, cp=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.set_attn_implementation(register_attention(state))
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    input_ids, position_ids, local_labels = (lt.shard_sequence(x, state) for x in (tokens, positions, labels))
    logits = model(input_ids=input_ids, position_ids=position_ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1), local_labels.flatten(), reduction="sum") / labels.numel()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # every rank saw other tokens: the sum is the full gradient
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.dist
def test_attention_interface_recipe_equals_unsharded(dist_pool, tmp_path):
    import transformers

    pool = dist_pool(4)
    for i, family in enumerate(FAMILIES):
        folder = make_hf_model(family, tmp_path / family, seed=30 + i)
        tokens, labels = _batch(i)
        results = pool.run(_recipe, str(folder), tokens, labels)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        logits = model(input_ids=tokens).logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
        for rank, (got_loss, grads) in enumerate(results):
            assert abs(got_loss - loss.item()) <= 1e-5 * abs(loss.item()), f"{family} rank {rank}"
            for name, p in model.named_parameters():
                err = rel_err(grads[name], p.grad)
                assert err < 1e-5, f"{family} rank {rank} grad {name}: rel err {err:.2e}"


def _bad_mask(folder: str) -> str:
    import transformers

    import loongtrain as lt
    from loongtrain.hf.attention import make_attention

    from dist_pool import cached_state

    state = cached_state(hp=2, cp=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    q = torch.zeros(1, 4, 8, 16)
    try:
        make_attention(state)(model.model.layers[0].self_attn, q, q, q, torch.zeros(1, 1, 8, 8))
    except ValueError as e:
        return str(e)
    return lt.__name__


@pytest.mark.dist
def test_attention_mask_is_refused(dist_pool, tmp_path):
    folder = make_hf_model("llama", tmp_path / "m")
    for message in dist_pool(4).run(_bad_mask, str(folder)):
        assert "an attention mask is not supported" in message and "pack documents" in message


@pytest.mark.slow
@pytest.mark.e2e
def test_example_script_checks_itself(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "hf_attention.py"), "--nproc", "4", "--steps", "2", "--check"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gradients match the unsharded model" in proc.stdout


def _packed_logits(folder: str, tokens: torch.Tensor, cu: list[int]) -> torch.Tensor:
    import transformers

    import loongtrain as lt
    from loongtrain.hf.attention import register_attention

    from dist_pool import cached_state

    state = cached_state(hp=2, cp=2)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.set_attn_implementation(register_attention(state))
    positions = torch.cat([torch.arange(b - a) for a, b in zip(cu, cu[1:])]).unsqueeze(0)
    layout = lt.sequence_layout(tokens.shape[1], state, cu)
    input_ids, position_ids = (lt.shard_sequence(x, state, layout=layout) for x in (tokens, positions))
    with torch.no_grad():
        logits = model(input_ids=input_ids, position_ids=position_ids, cu_seq_lens_q=torch.tensor(cu)).logits
    return lt.unshard_sequence(logits, state, layout=layout)


@pytest.mark.dist
def test_packed_documents_through_the_attention_interface(dist_pool, tmp_path):
    """Packed documents (global cu_seq_lens_q, restarting positions) equal each document run alone."""
    import transformers

    folder = make_hf_model("mistral-window", tmp_path / "m", seed=3)
    tokens, _ = _batch(9)
    tokens, cu = tokens[:1], [0, 5, 13, 27, 32]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.cat([model(input_ids=tokens[:, a:b]).logits for a, b in zip(cu, cu[1:])], dim=1)
    for got in dist_pool(4).run(_packed_logits, str(folder), tokens, cu):
        assert rel_err(got, ref) < 1e-5
