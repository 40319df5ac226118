"""The memory options change where and when tensors live, never what is computed.

- the chunked loss equals ``F.cross_entropy`` of the full logits (loss, gradients,
  ignore-index, accuracy), and its per-token scores equal the per-token cross entropy;
- the tiled MLP equals the plain SwiGLU, forward and backward;
- activation offload really moves what checkpointing keeps out of the compute tensors;
- at world 4, 2D head-context attention with a double ring and packed documents, training
  with every option on (sc++, offload of activations and states, tiled MLP, chunked loss)
  equals training with every option off, step after step and after a resume from a
  checkpoint.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from loongtrain.config import ConfigError, load_config
from loongtrain.model import config as model_config_module
from loongtrain.model.loss import lm_loss, token_scores
from loongtrain.model.norm import RMSNorm
from loongtrain.model.tiled_mlp import normed_swiglu, swiglu
from loongtrain.options import MemoryOptions

from dist_pool import cached_state

ALL_ON = dict(
    activation_checkpoint="sc++", loss_chunk=24, mlp_tile=8, offload_activations=True, offload_states=True,
    head_groups=2,
)  # fmt: skip


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("chunk", [1, 5, 16, 40, 1000])
def test_chunked_loss_equals_full_cross_entropy(chunk):
    gen = torch.Generator().manual_seed(chunk)
    h = torch.randn(2, 20, 12, generator=gen, requires_grad=True)
    w = torch.randn(37, 12, generator=gen, requires_grad=True)
    labels = torch.randint(0, 37, (2, 20), generator=gen)
    labels[0, ::3] = -100
    logits = F.linear(h, w)
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    ref_grads = torch.autograd.grad(2.5 * ref, (h, w))
    loss, correct = lm_loss(h, w, labels, chunk)
    grads = torch.autograd.grad(2.5 * loss, (h, w))
    assert abs(loss.item() - ref.item()) <= 1e-6 * abs(ref.item())
    for got, want in zip(grads, ref_grads):
        assert _rel(got, want) <= 1e-6
    scored = labels != -100
    assert correct.item() == int(((logits.argmax(-1) == labels) & scored).sum())
    per_token, hits = token_scores(h, w, labels, chunk)
    want = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")
    assert torch.allclose(per_token.flatten(), want.detach(), atol=1e-5)
    assert torch.equal(hits, (logits.argmax(-1) == labels) & scored)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_loss_with_the_final_norm_equals_norm_then_cross_entropy(dtype):
    """The training model's loss applies the final norm itself, chunk by chunk (no [T, dim]
    normed copy or its gradient): loss and the gradients of the block output, the output
    matrix and the norm weight equal the float64 norm-then-cross-entropy."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 20, 12, generator=gen, dtype=torch.float64)
    w = torch.randn(37, 12, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 37, (2, 20), generator=gen)
    labels[1, ::4] = -100
    norm = RMSNorm(12, 1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(12, generator=gen, dtype=torch.float64))
    leaves = [t.clone().requires_grad_() for t in (x, w)]
    ref = F.cross_entropy(F.linear(norm(leaves[0]), leaves[1]).flatten(0, 1), labels.flatten(), reduction="sum")
    want = torch.autograd.grad(1.5 * ref, [*leaves, norm.weight])
    mine = [t.to(dtype).requires_grad_() for t in (x, w)]
    low = RMSNorm(12, 1e-5).to(dtype)
    with torch.no_grad():
        low.weight.copy_(norm.weight)
    loss, _ = lm_loss(mine[0], mine[1], labels, 7, None, low)
    got = torch.autograd.grad(1.5 * loss, [*mine, low.weight])
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    assert abs(loss.item() / ref.item() - 1) <= tol
    for name, g, r in zip(("x", "weight", "norm"), got, want):
        assert g.dtype == dtype and _rel(g, r) <= tol, (name, _rel(g, r))


def test_chunked_loss_without_targets_is_zero_and_has_zero_gradients():
    h = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(9, 4, requires_grad=True)
    loss, correct = lm_loss(h, w, torch.full((6,), -100), chunk=4)
    loss.backward()
    assert loss.item() == 0.0 and correct.item() == 0
    assert h.grad.abs().max() == 0 and w.grad.abs().max() == 0


def test_chunked_loss_in_bfloat16_equals_float64_cross_entropy(monkeypatch):
    """bf16 weights: dL/dW summed in float32 over chunks, its products a vocabulary slice at a
    time (a slice smaller than the vocabulary here), against float64 autograd."""
    monkeypatch.setattr(model_config_module, "VOCAB_SLICE", 20)
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(40, 24, generator=gen).bfloat16()
    w = (0.5 * torch.randn(50, 24, generator=gen)).bfloat16()
    labels = torch.randint(0, 50, (40,), generator=gen)
    labels[::4] = -100
    ref_in = [t.double().requires_grad_() for t in (h, w)]
    ref = F.cross_entropy(F.linear(*ref_in), labels, ignore_index=-100, reduction="sum")
    ref.backward()
    got_in = [t.clone().requires_grad_() for t in (h, w)]
    loss, _ = lm_loss(*got_in, labels, chunk=7)
    loss.backward()
    assert abs(loss.item() - ref.item()) <= 1e-2 * abs(ref.item())
    for got, want in zip(got_in, ref_in):
        assert got.grad.dtype == torch.bfloat16 and _rel(got.grad, want.grad) <= 1e-2


@pytest.mark.parametrize("wants", [(True, False), (False, True)])
def test_chunked_loss_makes_only_the_gradients_asked_for(wants):
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(9, 6, generator=gen, requires_grad=wants[0])
    w = torch.randn(11, 6, generator=gen, requires_grad=wants[1])
    labels = torch.randint(0, 11, (9,), generator=gen)
    ref = F.cross_entropy(F.linear(h.double(), w.double()), labels, reduction="sum")
    (want,) = torch.autograd.grad(ref, h if wants[0] else w)
    loss, _ = lm_loss(h, w, labels, chunk=4)
    (got,) = torch.autograd.grad(loss, h if wants[0] else w)
    assert _rel(got, want) <= 1e-6


def test_chunked_loss_hands_its_float32_weight_gradient_over_without_a_copy():
    """The [vocab, dim] accumulator is the gradient backward returns: the step's tensor peak
    (allocation tracking) holds one such buffer, not the two (accumulator and scaled copy) it
    held before; and a second backward through the graph is refused in one line."""
    from loongtrain.tools.bench.memory import TensorPeak

    vocab, dim, tokens = 8192, 64, 16
    matrix = vocab * dim * 4
    h = torch.randn(tokens, dim, requires_grad=True)
    w = torch.randn(vocab, dim, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    with TensorPeak(torch.device("cpu")) as peak:
        loss, _ = lm_loss(h, w, labels, chunk=8)
        (0.5 * loss).backward(retain_graph=True)
    assert matrix <= peak.bytes - peak.base < 1.5 * matrix
    ref = F.cross_entropy(F.linear(h.detach().double(), w.detach().double()), labels, reduction="sum")
    assert abs(loss.item() - ref.item()) <= 1e-5 * ref.item()
    with pytest.raises(RuntimeError, match="a second backward through the same graph"):
        loss.backward()


class _DenseSink:
    """A GradientSink that sums what it is given into one dense float32 matrix."""

    def __init__(self, shape) -> None:
        self.grad = torch.zeros(shape)
        self.calls = 0

    def add(self, grad: torch.Tensor) -> None:
        self.grad += grad
        self.calls += 1

    def add_rows(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        assert rows.dtype == torch.float32
        self.grad.index_add_(0, ids, rows)
        self.calls += 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocabulary_gradients_go_to_the_sink_in_float32(dtype):
    """The embedding lookup and the chunked loss hand their weight's float32 gradient to a sink
    (model/vocab.py) and none to autograd: the sink's sum equals float64 autograd's gradient of
    the tied matrix (lookup + loss), and the hidden states' gradient is unchanged."""
    from loongtrain.model.vocab import embedding

    gen = torch.Generator().manual_seed(11)
    w = (0.5 * torch.randn(30, 8, generator=gen)).to(dtype)
    tokens = torch.randint(0, 30, (2, 9), generator=gen)
    tokens[0, :3] = 4  # a repeated id: its rows summed
    labels = torch.randint(0, 30, (18,), generator=gen)
    mix = torch.randn(8, 8, generator=gen).to(dtype)
    ref_w = w.double().requires_grad_()
    ref = F.cross_entropy(F.linear(F.embedding(tokens, ref_w).reshape(18, 8) @ mix.double(), ref_w), labels,
                          reduction="sum")  # fmt: skip
    (1.5 * ref).backward()
    sink, got_w = _DenseSink(w.shape), w.clone().requires_grad_()
    h = embedding(tokens, got_w, sink).reshape(18, 8) @ mix
    loss, _ = lm_loss(h, got_w, labels, chunk=5, sink=sink)
    (1.5 * loss).backward()
    assert got_w.grad is None and sink.calls == 2
    assert _rel(sink.grad, ref_w.grad) <= (1e-6 if dtype == torch.float32 else 2e-2)
    with torch.no_grad():  # no graph: the plain lookup, nothing sent
        embedding(tokens, got_w, sink)
    assert sink.calls == 2


@pytest.mark.parametrize("with_norm", [False, True])
def test_chunked_loss_reads_a_float32_master_matrix_a_vocabulary_slice_at_a_time(monkeypatch, with_norm):
    """The output matrix as its float32 master beside bf16 hidden states (what the model passes
    where one shard holds the whole matrix, model/vocab.py), cast 20 rows at a time (3 slices):
    the loss, dL/dh, the sink's dL/dW, the final norm's weight gradient and the per-token scores
    against float64 (bf16's tolerance); the logits, so the loss, dL/dW and the scores, the same
    bits as the same loss on the bf16 matrix (the gathered copy the master replaces). dL/dh sums
    the slices' bf16 products in float32: not the same bits."""
    from loongtrain.model.norm import rms_norm

    monkeypatch.setattr(model_config_module, "VOCAB_SLICE", 20)
    gen = torch.Generator().manual_seed(17)
    h = torch.randn(40, 24, generator=gen).bfloat16()
    master = 0.5 * torch.randn(50, 24, generator=gen)
    norm_w = (1 + 0.1 * torch.randn(24, generator=gen)).bfloat16()
    labels = torch.randint(0, 50, (40,), generator=gen)
    labels[::5] = -100
    ref_h, ref_w, ref_n = (t.double().requires_grad_() for t in (h, master, norm_w))
    x = rms_norm(ref_h, ref_n, 1e-5)[0] if with_norm else ref_h
    ref_scores = F.cross_entropy(F.linear(x, ref_w), labels, ignore_index=-100, reduction="none")
    (1.5 * ref_scores.sum()).backward()

    def run(weight: torch.Tensor) -> list[torch.Tensor]:
        sink, got_h, got_w = _DenseSink(weight.shape), h.clone().requires_grad_(), weight.clone().requires_grad_()
        norm = None
        if with_norm:
            norm = RMSNorm(24, 1e-5).bfloat16()
            norm.weight.data.copy_(norm_w)
        loss, _ = lm_loss(got_h, got_w, labels, chunk=7, sink=sink, norm=norm)
        (1.5 * loss).backward()
        assert got_w.grad is None
        with torch.no_grad():
            scores, _ = token_scores(norm(h) if with_norm else h, weight, labels, chunk=7)
        return [loss, got_h.grad, sink.grad, scores] + ([norm.weight.grad] if with_norm else [])

    wants = [ref_scores.sum(), ref_h.grad, ref_w.grad, ref_scores] + ([ref_n.grad] if with_norm else [])
    from_master, from_copy = run(master), run(master.bfloat16())
    assert from_master[1].dtype == torch.bfloat16
    for got, want in zip(from_master, wants):
        assert _rel(got, want) <= 1e-2
    for i in (0, 2, 3):  # loss, dL/dW, scores
        assert torch.equal(from_master[i], from_copy[i])


def test_the_embedding_reads_its_rows_from_a_float32_master_in_the_compute_dtype():
    from loongtrain.model.vocab import embedding

    gen = torch.Generator().manual_seed(19)
    master = torch.randn(30, 8, generator=gen, requires_grad=True)
    tokens = torch.tensor([[3, 7, 3, 29]])
    sink = _DenseSink(master.shape)
    rows = embedding(tokens, master, sink, torch.bfloat16)
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, master.detach()[tokens].bfloat16())
    grad = torch.randn(1, 4, 8, generator=gen).bfloat16()
    rows.backward(grad)
    want = torch.zeros(30, 8).index_add_(0, tokens[0], grad[0].float())
    assert master.grad is None and torch.equal(sink.grad, want)


def _one_rank_vocabulary_reads(vocab: int, slice_rows: int) -> list:
    """One bf16 forward+backward at world 1 under ZeRO (one shard), the vocabulary matrices read
    from their float32 masters (``slice_rows`` vocabulary rows cast at a time) and (the sink's
    ``master`` hidden) through FSDP2's gathered copies: (loss, every gradient, step peak,
    embedding-phase peak, the chunked loss's peak on the last block's output) of each."""
    from loongtrain.apply import materialize, parallelize
    from loongtrain.apply.vocab import ShardGradient
    from loongtrain.model import build_model, model_config
    from loongtrain.tools.bench.memory import TensorPeak

    state = cached_state()
    mcfg = model_config("debug", vocab_size=vocab, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128)
    gen = torch.Generator().manual_seed(23)
    tokens, labels = torch.randint(0, vocab, (2, 1, 48), generator=gen).to(state.device)
    positions = torch.arange(48, device=state.device)
    results, master, rows = [], ShardGradient.master, model_config_module.VOCAB_SLICE
    for hidden in (False, True):
        if hidden:
            ShardGradient.master = lambda self: None
        model_config_module.VOCAB_SLICE = slice_rows
        try:
            options = MemoryOptions(loss_chunk=16)
            model = parallelize(build_model(mcfg), state, memory=options, param_dtype=torch.bfloat16)
            materialize(model, state.device, seed=0)
            with TensorPeak(state.device, model) as peak:
                loss, _ = model(tokens, positions, labels=labels)
                loss.backward()
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            h = model.residual_stream(tokens, positions).detach()
            with TensorPeak(state.device) as loss_peak:  # the loss alone (the final norm left out)
                model.output.head(h, labels, "sum", options.loss_chunk)
        finally:
            ShardGradient.master, model_config_module.VOCAB_SLICE = master, rows
        embedding = peak.phases["embedding"] - peak.base
        results.append((loss.item(), grads, peak.bytes, embedding, loss_peak.bytes - loss_peak.base))
    return results


@pytest.mark.dist
def test_one_shard_reads_the_vocabulary_masters_without_gathered_copies(dist_pool):
    """World 1 (one shard holds the whole matrices): the embedding's rows and the chunked loss's
    vocabulary slices are read from the float32 masters, so neither bf16 ``[vocab, dim]`` copy
    FSDP2 would gather exists (allocation tracking: the embedding's phase two matrices lower --
    FSDP2's all-gather input and output --, the loss's at least 3/4 of one, a cast slice being
    1/8, and the step's peak not higher), with the same loss and the same gradients: bit for bit
    with one slice, within bf16's rounding with 8 (dL/dh then sums the slices' products)."""
    vocab = 8192
    matrix = vocab * 64 * 2
    (master, gathered) = dist_pool(1).run(_one_rank_vocabulary_reads, vocab, vocab)[0]
    assert master[0] == gathered[0]
    for name, grad in gathered[1].items():
        assert torch.equal(master[1][name], grad), name
    (master, gathered) = dist_pool(1).run(_one_rank_vocabulary_reads, vocab, vocab // 8)[0]
    assert master[0] == gathered[0]
    for name, grad in gathered[1].items():
        assert _rel(master[1][name], grad) <= 1e-2, name
    assert master[2] <= gathered[2], (gathered[2], master[2])
    assert gathered[3] - master[3] >= 1.9 * matrix, (gathered[3], master[3])
    assert gathered[4] - master[4] >= 0.75 * matrix, (gathered[4], master[4])


@pytest.mark.parametrize("tile", [1, 3, 8, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_mlp_equals_the_plain_norm_and_mlp(tile, dtype):
    """RMSNorm + SwiGLU over tiles (the norm recomputed per tile in backward) against float64
    autograd through the plain formulas: output and every gradient, the norm's weight included."""
    gen = torch.Generator().manual_seed(tile)
    x = torch.randn(2, 13, 8, generator=gen)
    norm_w = 1 + 0.1 * torch.randn(8, generator=gen)
    weights = [torch.randn(s, generator=gen) for s in ((24, 8), (24, 8), (8, 24))]
    dout = torch.randn(2, 13, 8, generator=gen)
    ref = [t.double().requires_grad_() for t in (x, norm_w, *weights)]
    h = ref[0] * torch.rsqrt(ref[0].pow(2).mean(-1, keepdim=True) + 1e-5) * ref[1]
    want = swiglu(h, *ref[2:])
    want.backward(dout.double())

    norm = RMSNorm(8, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(norm_w)
    got_in = [t.to(dtype).requires_grad_() for t in (x, *weights)]
    got = normed_swiglu(got_in[0], norm, *got_in[1:], tile)
    got.backward(dout.to(dtype))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert _rel(got, want) <= tol
    for g, r in zip((got_in[0].grad, norm.weight.grad, *(w.grad for w in got_in[1:])), ref):
        assert _rel(g, r.grad) <= tol


def test_memory_options_refuse_what_cannot_apply():
    with pytest.raises(ValueError, match="activation_checkpoint='none' keeps nothing to move"):
        MemoryOptions(offload_activations=True)
    with pytest.raises(ValueError, match="mlp_tile=-1 must be 0"):
        MemoryOptions(mlp_tile=-1)
    with pytest.raises(ConfigError, match=r"\[memory\] .*activation_checkpoint='none' keeps nothing to move"):
        load_config(None, ["memory.offload_activations=true", "memory.activation_checkpoint=none"])
    with pytest.raises(ConfigError, match=r"compiled blocks \(run.compile=true\) cannot run with memory.mlp_tile"):
        load_config(None, ["run.compile=true", "memory.mlp_tile=64"])
    for key in ("memory.head_groups=2", "memory.activation_checkpoint_span=2"):
        with pytest.raises(ConfigError, match=rf"cannot run with {key.split('=')[0]} "):
            load_config(None, ["run.compile=true", "memory.activation_checkpoint=full", key])
    with pytest.raises(ConfigError, match="memory.loss_chunk=-5 must not be negative"):
        load_config(None, ["memory.loss_chunk=-5"])


def _packed_batches(steps: int, micro: int, seq: int, vocab: int, dp: int, dp_rank: int) -> list:
    from loongtrain.data.batch import Microbatch

    out = []
    for step in range(steps):
        batch = []
        for m in range(micro):
            rng = random.Random(1000 * step + 10 * m + dp_rank)
            cu = [0]
            while cu[-1] < seq:
                cu.append(min(seq, cu[-1] + rng.choice([3, 9, 17, 40])))
            gen = torch.Generator().manual_seed(1000 * step + 10 * m + dp_rank)
            tokens = torch.randint(0, vocab, (1, seq), generator=gen)
            labels = torch.randint(0, vocab, (1, seq), generator=gen)
            labels[0, [b - 1 for b in cu[1:]]] = -100
            batch.append(Microbatch(tokens, labels, torch.tensor(cu)))
        out.append(batch)
    return out


def _grads(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for n, p in model.named_parameters()
    }


#: the other way to everything on: full checkpointing in spans of two layers, the attention over
#: head groups (no output kept), offload of both
SPANS_ON = dict(
    activation_checkpoint="full", activation_checkpoint_span=2, loss_chunk=24, mlp_tile=8, offload_activations=True,
    offload_states=True, head_groups=2,
)  # fmt: skip


def _options_on_vs_off(cfg: dict, run_dir: str, on_options: dict = ALL_ON) -> dict:
    """Two steps with every option off and on from the same weights; the 'on' model is
    checkpointed after step 1 and a fresh 'on' model resumes from it for step 2."""
    from loongtrain.apply import materialize, parallelize
    from loongtrain.model import build_model, model_config
    from loongtrain.train.checkpoint import CheckpointManager
    from loongtrain.train.step import forward_backward

    state = cached_state(**cfg)
    mcfg = model_config("debug", vocab_size=200)
    seq = 32 * state.sp
    batches = _packed_batches(2, 2, seq, mcfg.vocab_size, state.dp, state.coords.dp)

    def build(options: dict):
        model = parallelize(build_model(mcfg), state, memory=MemoryOptions(**options), zero="dp_sp")
        materialize(model, torch.device("cpu"), 7)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)

    def step(model, opt, batch):
        result = forward_backward(model, state, batch)
        grads = _grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return result.loss, grads

    off, off_opt = build(dict(loss_chunk=0))
    on, on_opt = build(on_options)
    assert all(p.device.type == "cpu" for p in on.parameters())
    report = {"loss": [], "grad": []}
    loss_off, grads_off = step(off, off_opt, batches[0])
    loss_on, grads_on = step(on, on_opt, batches[0])
    report["loss"].append(abs(loss_on - loss_off) / abs(loss_off))
    report["grad"].append(max(_rel(grads_on[n], grads_off[n]) for n in grads_off))
    manager = CheckpointManager(Path(run_dir), keep=1)
    manager.save(1, on, on_opt, {"model_shape": {}})
    resumed, resumed_opt = build(on_options)
    manager.load(manager.folder / "step-1", resumed, resumed_opt, {})
    loss_off, grads_off = step(off, off_opt, batches[1])
    loss_on, grads_on = step(resumed, resumed_opt, batches[1])
    report["loss"].append(abs(loss_on - loss_off) / abs(loss_off))
    report["grad"].append(max(_rel(grads_on[n], grads_off[n]) for n in grads_off))
    report["docs"] = len(batches[0][0].cu_seqlens) - 1
    return report


@pytest.mark.dist
@pytest.mark.parametrize(
    "cfg, on_options",
    [
        ({"hp": 2, "cp": 2, "ring_window": 2, "balance": "documents"}, ALL_ON),
        ({"cp": 4, "ring_window": 2}, {**ALL_ON, "activation_checkpoint_layers": 1}),
        ({"hp": 2, "cp": 2, "ring_window": 2, "balance": "documents"}, SPANS_ON),
    ],
    ids=["2d-hp2-cp2", "double-ring-cp4-w2-first-layer", "2d-spans-head-groups"],
)
def test_every_option_on_trains_like_every_option_off(dist_pool, tmp_path, cfg, on_options):
    for report in dist_pool(4).run(_options_on_vs_off, cfg, str(tmp_path / "ckpt"), on_options):
        assert report["docs"] >= 4
        assert max(report["loss"]) <= 1e-5, report
        assert max(report["grad"]) <= 1e-5, report


def _forward_recording_block_inputs(model, tokens: torch.Tensor) -> tuple:
    """The loss of ``tokens`` (33 of them) and a weak reference to each block input's storage,
    in call order (a recompute in backward would add more)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    inputs: list[StorageWeakRef] = []

    def record(module, args):
        inputs.append(StorageWeakRef(args[0].untyped_storage()))

    hooks = [layer.register_forward_pre_hook(record) for layer in model.layers]
    loss, _ = model(tokens[:, :-1], torch.arange(32), labels=tokens[:, 1:])
    for h in hooks:
        h.remove()
    return loss, inputs


@pytest.mark.parametrize("mode", ["full", "sc++"])
def test_offload_frees_the_device_copy_of_each_block_input(mode):
    """After the forward, no checkpointed block's input is alive in compute memory: its only
    copy is the host one (a hook that held the original, as the pack hook's closure once
    did, would keep every layer's input on the device). Backward then equals no offload."""
    from loongtrain.apply import materialize
    from loongtrain.apply.activation_checkpoint import apply_activation_checkpoint
    from loongtrain.apply.offload import ActivationOffload
    from loongtrain.model import build_model, model_config

    mcfg = model_config("debug", n_layers=3)
    tokens = torch.randint(0, mcfg.vocab_size, (1, 33), generator=torch.Generator().manual_seed(0))
    grads = []
    for offload in (False, True):
        model = build_model(mcfg)
        materialize(model, torch.device("cpu"), 3)
        apply_activation_checkpoint(model, mode, offload=ActivationOffload(torch.device("cpu")) if offload else None)
        loss, inputs = _forward_recording_block_inputs(model, tokens)
        if offload:
            assert [ref.expired() for ref in inputs] == [True] * 3
        else:  # the check can fail: without offload the checkpoints keep every input
            assert not any(ref.expired() for ref in inputs)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert torch.equal(grads[1][name], g), name


@pytest.mark.parametrize("offload", [False, True])
def test_checkpoint_spans_keep_one_input_per_span_and_train_like_no_checkpoint(offload):
    """``activation_checkpoint_span=2`` on 5 layers: after the forward only the inputs of
    layers 0, 2, 4 (the spans') are alive, on the device or (offload) on the host alone; the
    loss and every gradient equal the model without checkpointing (float64)."""
    from loongtrain.apply import materialize
    from loongtrain.apply.activation_checkpoint import apply_activation_checkpoint
    from loongtrain.apply.offload import ActivationOffload
    from loongtrain.model import build_model, model_config

    mcfg = model_config("debug", n_layers=5)
    tokens = torch.randint(0, mcfg.vocab_size, (1, 33), generator=torch.Generator().manual_seed(0))
    results = []
    for span in (0, 2):
        model = build_model(mcfg)
        materialize(model, torch.device("cpu"), 3)
        model.double()
        if span:
            store = ActivationOffload(torch.device("cpu")) if offload else None
            apply_activation_checkpoint(model, "full", offload=store, span=span)
        loss, inputs = _forward_recording_block_inputs(model, tokens)
        alive = [not ref.expired() for ref in inputs[:5]]  # the forward's (recompute adds more)
        if span:
            assert alive == ([False] * 5 if offload else [True, False, True, False, True]), alive
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain_loss, plain), (loss, grads) = results
    assert abs(loss / plain_loss - 1) < 1e-12
    for name, g in plain.items():
        assert torch.allclose(grads[name], g, rtol=1e-10, atol=1e-14), name
    with pytest.raises(ValueError, match="activation_checkpoint_span=2 .* needs activation_checkpoint='full'"):
        MemoryOptions(activation_checkpoint="sc++", activation_checkpoint_span=2)


@pytest.mark.parametrize("mode", ["full", "sc++"])
def test_offload_fetches_the_previous_layer_after_the_attention_backward(monkeypatch, mode):
    """The previous layer's kept tensors start coming back once a layer's attention backward
    is done (its peak), not when the layer's backward starts."""
    from loongtrain.apply import materialize
    from loongtrain.apply.activation_checkpoint import apply_activation_checkpoint
    from loongtrain.apply.offload import ActivationOffload, LayerStash
    from loongtrain.model import build_model, model_config
    from loongtrain.model.llama import sdpa_attention

    events, stashes = [], []

    class Probe(torch.autograd.Function):  # inside the attention: its backward is the attention's
        @staticmethod
        def forward(ctx, layer, q):
            ctx.layer = layer
            return q.view_as(q)

        @staticmethod
        def backward(ctx, grad):
            events.append(("attention", ctx.layer))
            return None, grad

    def probed(layer):
        return lambda q, k, v, **kw: sdpa_attention(Probe.apply(layer, q), k, v, **kw)

    new_stash, prefetch = ActivationOffload.new_stash, LayerStash.prefetch
    monkeypatch.setattr(ActivationOffload, "new_stash", lambda self, **kw: stashes.append(new_stash(self, **kw))
                        or stashes[-1])  # fmt: skip
    monkeypatch.setattr(LayerStash, "prefetch", lambda self: events.append(("prefetch", stashes.index(self)))
                        or prefetch(self))  # fmt: skip
    mcfg = model_config("debug", n_layers=3)
    model = build_model(mcfg)
    materialize(model, torch.device("cpu"), 3)
    for i, layer in enumerate(model.layers):
        layer.attention.attention_fn = probed(i)
    apply_activation_checkpoint(model, mode, offload=ActivationOffload(torch.device("cpu")))
    tokens = torch.randint(0, mcfg.vocab_size, (1, 33), generator=torch.Generator().manual_seed(0))
    loss, _ = model(tokens[:, :-1], torch.arange(32), labels=tokens[:, 1:])
    loss.backward()
    assert events == [("attention", 2), ("prefetch", 1), ("attention", 1), ("prefetch", 0), ("attention", 0)]


def _offloaded_bytes(cfg: dict) -> dict:
    """Host bytes the offload holds after a forward (before its backward) and after the backward."""
    from loongtrain.apply import materialize, parallelize
    from loongtrain.model import build_model, model_config
    from loongtrain.train.step import shard_microbatch

    state = cached_state(**cfg)
    mcfg = model_config("debug", n_layers=3)
    model = parallelize(build_model(mcfg), state, memory=MemoryOptions(**ALL_ON), zero="dp_sp")
    materialize(model, torch.device("cpu"), 7)
    (batch,) = _packed_batches(1, 1, 16 * state.sp, mcfg.vocab_size, state.dp, state.coords.dp)[0]
    shard = shard_microbatch(batch, state)
    loss, _ = model(shard.tokens, shard.positions, shard.layout, labels=shard.labels)
    held = model.activation_offload.host_bytes()
    loss.backward()
    tokens = shard.tokens.numel()
    return {"held": held, "after": model.activation_offload.host_bytes(), "per_layer_input": tokens * mcfg.dim * 4}


@pytest.mark.dist
def test_offload_holds_the_kept_tensors_on_the_host_until_backward(dist_pool):
    for r in dist_pool(4).run(_offloaded_bytes, {"hp": 2, "cp": 2, "ring_window": 2}):
        # three checkpointed layers: each block input, plus sc++'s kept attention results
        assert r["held"] > 3 * r["per_layer_input"], r
        assert r["after"] == 0, r


# The memory model against the real code, measured live (the static table of
# tests/test_planner_memory.py records one day's peaks; this follows the code as it changes).
# (hp, cp, activation checkpoint, ZeRO scope, checkpointed layers: 0 every one) on 4 ranks, fp32,
# one 4096-token sequence, the whole-shard loss: the debug model scaled as in that table.
LIVE_ROWS = [
    (2, 2, "sc++", "dp_sp", 0),
    (2, 2, "none", "dp_sp", 0),
    (1, 4, "full", "none", 0),
    (2, 2, "sc++", "dp_sp", 2),
]
LIVE_SEQ = 4096


def _live_model():
    from loongtrain.model import model_config

    return model_config("debug", dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=704, vocab_size=1024)


def _live_peaks(rows: list) -> list[int]:
    from loongtrain.tools.bench.memory import measure

    peaks = []
    for hp, cp, checkpoint, zero, layers in rows:
        state = cached_state(hp=hp, cp=cp)
        options = MemoryOptions(activation_checkpoint=checkpoint, loss_chunk=0, activation_checkpoint_layers=layers)
        peaks.append(measure(_live_model(), state, options, LIVE_SEQ, torch.device("cpu"), False, zero)["device"])
    return peaks


@pytest.mark.dist
def test_memory_model_follows_the_peaks_of_the_real_code(dist_pool):
    from loongtrain.planner.cost import Candidate
    from loongtrain.planner.memory import predict_peak_memory

    per_rank = dist_pool(4).run(_live_peaks, LIVE_ROWS)
    measured = [max(rank[i] for rank in per_rank) for i in range(len(LIVE_ROWS))]
    predicted = [
        predict_peak_memory(
            _live_model(), LIVE_SEQ, 1, 4,
            Candidate.of(
                dp=1, hp=hp, cp=cp, zero=zero, activation_checkpoint=checkpoint, loss_chunk=0,
                activation_checkpoint_layers=layers,
            ),
            optimizer=False, gpu=False,
        ).total
        for hp, cp, checkpoint, zero, layers in LIVE_ROWS
    ]  # fmt: skip
    ratios = [p / m for p, m in zip(predicted, measured)]
    print("live peaks MiB", [round(m / 2**20, 1) for m in measured], "predicted / measured", ratios)
    # each peak within the memory model's acceptance bound
    assert all(0.80 <= r <= 1.20 for r in ratios), (measured, predicted)
    # what checkpointing saves (no checkpointing minus sc++ on the same layout): the activations
    # the model counts per layer, the part that changes when the real code changes what it keeps
    saved_measured, saved_predicted = measured[1] - measured[0], predicted[1] - predicted[0]
    assert 0.80 <= saved_predicted / saved_measured <= 1.20, (saved_measured, saved_predicted)
    # sc++ on the first 2 of 4 layers: between none and sc++ on all, and what it saves as predicted
    assert measured[0] < measured[3] < measured[1], measured
    half_measured, half_predicted = measured[1] - measured[3], predicted[1] - predicted[3]
    assert 0.80 <= half_predicted / half_measured <= 1.20, (half_measured, half_predicted)
