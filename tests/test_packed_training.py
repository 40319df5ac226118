"""Training on packed documents is the same computation as the unsharded model.

Each microbatch is one packed row with document boundaries. The reference is the plain
model in the same worker with PyTorch SDPA under a dense boolean document/window mask
(``reference.visibility``) and RoPE positions restarting per document, computed here
independently of the library. The parallel model runs the distributed attention on
shards laid out by the configured balance.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from loongtrain.apply import MemoryOptions, materialize, parallelize
from loongtrain.attention import sequence_layout
from loongtrain.data.batch import Microbatch
from loongtrain.model import build_model, model_config
from loongtrain.model.config import LayerKind, RopeScaling
from loongtrain.train.step import forward_backward

from dist_pool import cached_state
from reference import lm_loss_sum, visibility

SEED = 5


def _dense_attention(keep: torch.Tensor):
    def attention(q, k, v, layout=None, sliding_window=None):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep, enable_gqa=True
        )
        return out.transpose(1, 2)

    return attention


def _packed_row(index: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    rng = random.Random(index)
    cu = [0]
    while cu[-1] < seq:
        cu.append(min(seq, cu[-1] + rng.choice([1, 3, 5, 9, 17, 40])))
    gen = torch.Generator().manual_seed(index)
    tokens = torch.randint(0, vocab, (1, seq), generator=gen)
    labels = torch.randint(0, vocab, (1, seq), generator=gen)
    labels[0, [b - 1 for b in cu[1:]]] = -100  # the label across a document boundary is not scored
    return tokens, labels, cu


def _positions(cu: list[int]) -> torch.Tensor:
    return torch.tensor([p for a, b in zip(cu, cu[1:]) for p in range(b - a)]).unsqueeze(0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _packed_equivalence(cfg: dict, ckpt: str, overrides: dict, micro: int, others: tuple = ()) -> dict:
    state = cached_state(**cfg)
    # other hp x cp splits of the same ranks; a balance alone: a view of the state (its groups)
    alternatives = [state.with_balance(o["balance"]) if set(o) == {"balance"} else cached_state(**{**cfg, **o})
                    for o in others]  # fmt: skip
    overrides = dict(overrides)
    groups = overrides.pop("head_groups", 1)  # a memory option, not the model's
    mcfg = model_config("debug", **overrides)
    device = torch.device("cpu")
    ref = build_model(mcfg)
    materialize(ref, device, SEED)
    memory = MemoryOptions(activation_checkpoint=ckpt, head_groups=groups)
    par = parallelize(build_model(mcfg), state, memory=memory, zero="dp_sp", alternatives=alternatives)
    materialize(par, device, SEED)
    seq = 16 * max(state.sp, 2)  # one rank too: several documents
    rows = [_packed_row(100 * m + d, seq, mcfg.vocab_size) for m in range(micro) for d in range(state.dp)]
    targets = sum(int((lab != -100).sum()) for _, lab, _ in rows)
    ref_loss = 0.0
    for tokens, labels, cu in rows:
        for layer, window in zip(ref.layers, mcfg.windows):  # each layer its own window (layer kinds)
            layer.attention.attention_fn = _dense_attention(visibility(seq, cu, True, window or None))
        loss = lm_loss_sum(ref(tokens, _positions(cu)), labels) / targets
        loss.backward()
        ref_loss += loss.item()
    mine = [Microbatch(t, lab, torch.tensor(cu)) for t, lab, cu in rows[state.coords.dp :: state.dp]]
    turns = iter(range(len(mine)))  # microbatch m runs on layout m % (1 + alternatives), on every rank
    states = [state, *alternatives]
    result = forward_backward(
        par, state, mine, choose=(lambda mb: states[next(turns) % len(states)]) if others else None
    )
    par_loss = result.loss
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    grad_err = 0.0
    for name, p in par.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grad_err = max(grad_err, _rel(grad, ref_grads[name]))
    return {
        "loss": abs(par_loss - ref_loss) / abs(ref_loss), "grad": grad_err, "docs": len(rows[0][2]) - 1,
        "layouts": result.layouts,
    }  # fmt: skip


# Gemma 3 in small: a sliding layer (window 6, RoPE base 10K) and a full one (base 1M, linear x8)
KINDS = (LayerKind(6, rope_theta=10000.0), LayerKind(rope_theta=1e6, rope_scaling=RopeScaling("linear", 8.0)))

# (world, layout, checkpoint mode, model overrides, microbatches)
CASES = [
    (2, {"cp": 2, "balance": "documents"}, "sc++", {}, 2),
    (4, {"hp": 2, "cp": 2, "ring_window": 2, "balance": "documents"}, "sc++", {}, 1),
    (4, {"cp": 4, "ring_window": 2}, "full", {"sliding_window": 7}, 1),
    (4, {"hp": 2, "cp": 2, "placement": "context_first"}, "none", {"sliding_window": 20}, 1),
    (4, {"cp": 2, "dp": 2, "balance": "documents"}, "sc++", {"sliding_window": 5}, 2),
    (4, {"hp": 4, "balance": "documents"}, "full", {"n_heads": 4, "n_kv_heads": 1}, 1),
    # the attention over head groups on packed documents with a sliding window
    (4, {"cp": 4, "ring_window": 2, "balance": "documents"}, "none", {"sliding_window": 7, "head_groups": 4}, 1),
    # layer kinds: a sliding layer with its own RoPE base beside a full one, and a NoPE layer
    (1, {}, "sc++", {"layer_kinds": (LayerKind(5, rope_theta=100.0), LayerKind(rope=False))}, 1),
    (4, {"cp": 4, "ring_window": 2, "balance": "documents"}, "full", {"layer_kinds": KINDS}, 1),
    (4, {"hp": 2, "cp": 2}, "none", {"layer_kinds": KINDS, "head_groups": 2}, 1),
]
# a layout per microbatch: three microbatches of one step on 2D, the double ring and Ulysses
PER_BATCH = [
    (
        {"hp": 2, "cp": 2, "ring_window": 2, "balance": "locality"},
        "sc++",
        {},
        ({"hp": 1, "cp": 4}, {"hp": 4, "cp": 1, "ring_window": 1}),
    ),
    ({"hp": 2, "cp": 2, "balance": "locality"}, "full", {"sliding_window": 7}, ({"hp": 1, "cp": 4, "ring_window": 2},)),
    ({"hp": 2, "cp": 2}, "sc++", {}, ({"balance": "locality"}, {"hp": 1, "cp": 4, "balance": "locality"})),
    # head groups: each microbatch's groups on its own layout's state
    ({"hp": 2, "cp": 2, "balance": "locality"}, "full", {"head_groups": 2}, ({"hp": 1, "cp": 4, "ring_window": 2},)),
]


@pytest.mark.dist
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"w{c[0]}-{c[1]}-{c[2]}-{c[3]}")
def test_packed_training_matches_the_unsharded_model(dist_pool, case):
    world, cfg, ckpt, overrides, micro = case
    for result in dist_pool(world).run(_packed_equivalence, cfg, ckpt, overrides, micro):
        assert result["docs"] >= 3
        assert result["loss"] < 1e-5, result
        assert result["grad"] < 1e-5, result


@pytest.mark.dist
@pytest.mark.parametrize("case", PER_BATCH, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def test_a_layout_per_microbatch_matches_the_unsharded_model(dist_pool, case):
    cfg, ckpt, overrides, others = case
    for result in dist_pool(4).run(_packed_equivalence, cfg, ckpt, overrides, len(others) + 1, others):
        assert len(set(result["layouts"])) == len(others) + 1, result["layouts"]  # each microbatch on its own
        assert result["loss"] < 1e-5, result
        assert result["grad"] < 1e-5, result


def test_unsharded_model_masks_documents():
    """The plain model's own masked attention equals the dense-mask reference model."""
    mcfg = model_config("debug", sliding_window=6)
    ref, mine = build_model(mcfg), build_model(mcfg)
    materialize(ref, torch.device("cpu"), SEED)
    materialize(mine, torch.device("cpu"), SEED)
    tokens, labels, cu = _packed_row(7, 48, mcfg.vocab_size)
    for layer in ref.layers:
        layer.attention.attention_fn = _dense_attention(visibility(48, cu, True, 6))
    positions = _positions(cu)
    want = ref(tokens, positions)
    got = mine(tokens, positions, sequence_layout(tokens.shape[1], None, torch.tensor(cu)))
    assert _rel(got, want) < 1e-5
    assert _rel(mine(tokens, positions), want) > 1e-2  # without the boundaries it is another model


def _disagreeing_batches() -> str:
    from loongtrain.train.step import forward_backward as step

    state = cached_state(cp=2)
    model = parallelize(build_model(model_config("debug")), state, zero="dp_sp")
    materialize(model, torch.device("cpu"), SEED)
    tokens = torch.zeros(1, 32, dtype=torch.long)
    cu = torch.tensor([0, 10, 32] if state.rank == 0 else [0, 12, 32])
    try:
        step(model, state, [Microbatch(tokens, tokens, cu)])
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.dist
def test_ranks_given_different_batches_are_told_on_every_rank(dist_pool):
    for message in dist_pool(2).run(_disagreeing_batches):
        assert "ranks of sequence-parallel group [0, 1] were given different batches" in message


@pytest.mark.dist
@pytest.mark.slow
def test_layer_kinds_world8_match_the_unsharded_model(dist_pool):
    """Gemma 3's layer kinds in small on 2D attention with the double ring (hp 2 x cp 4, window 2)."""
    cfg = {"hp": 2, "cp": 4, "ring_window": 2, "balance": "documents"}
    for result in dist_pool(8).run(_packed_equivalence, cfg, "sc++", {"layer_kinds": KINDS}, 1):
        assert result["loss"] < 1e-5, result
        assert result["grad"] < 1e-5, result
