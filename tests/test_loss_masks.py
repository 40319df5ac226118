"""Loss masks through training: a token file's per-token target flags (a chat's prompts are
not targets) reach the loss, which stays normalised by the global target count.

- the loader never yields a sequence without targets (drawn from an index of the windows that
  have some, so the sample of an index is the same on every layout and after a resume) and a
  file without any is refused;
- a packed, loss-masked chat batch trained on 2D layouts and with dp=2 x 2 microbatches equals
  the unsharded model's loss and gradients, computed here from full logits; the two wrong
  normalisations (prompt tokens counted, a per-rank normaliser) are shown to differ on it;
- a model trained on records whose prompts it must not learn does not learn them.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from loongtrain.apply import MemoryOptions, materialize, parallelize
from loongtrain.attention import sequence_layout, shard_sequence
from loongtrain.data import BatchLoader, TokenFile, TokenFileError, TokenFileSource, write_tokens
from loongtrain.data.batch import Microbatch
from loongtrain.data.tokens import DOC_START, TARGET
from loongtrain.model import build_model, model_config

from dist_pool import cached_state
from reference import visibility

SEED = 2  # a batch on which the documents balance shards otherwise than zigzag
SEQ = 64  # tokens per sample (window)
BATCH = 4  # samples per global batch
BOS, EOS = 1, 2


def _chat_stream(seed: int, documents: int = 24) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Packed chat documents ``[BOS, prompt..., completion..., EOS]``: long prompts (ids 3..127,
    not targets) and short completions (ids 128..249 and the EOS, targets), so that targets
    fall unevenly on the ranks. Returns (tokens, is_target, starts_document)."""
    rng = random.Random(seed)
    tokens, target, start = [], [], []
    for _ in range(documents):
        prompt = [rng.randrange(3, 128) for _ in range(rng.choice([6, 20, 45, 70]))]
        completion = [rng.randrange(128, 250) for _ in range(rng.choice([2, 5, 12]))] + [EOS]
        tokens += [BOS, *prompt, *completion]
        target += [False] * (1 + len(prompt)) + [True] * len(completion)
        start += [True] + [False] * (len(prompt) + len(completion))
    return np.array(tokens), np.array(target), np.array(start)


def _write_chat_file(path, seed: int = SEED) -> None:
    tokens, target, start = _chat_stream(seed)
    flags = (target * TARGET | start * DOC_START).astype(np.uint8)
    write_tokens(path, tokens, 256, eos=EOS, flags=flags)


# -- the loader ----------------------------------------------------------------------------


def test_sequences_without_targets_are_never_drawn(tmp_path):
    """Windows whose labels are all prompt are left out of the order by construction; the
    sample of an index is fixed (any layout, any resume) and every one has targets."""
    seq, rng = 16, np.random.default_rng(3)
    tokens = rng.integers(3, 200, 40 * seq + 1)
    flags = np.zeros(tokens.size, dtype=np.uint8)
    flags[::37] |= DOC_START
    with_targets = [w for w in range(40) if w % 3 == 0]  # targets in every third window only
    for w in with_targets:
        flags[w * seq + 5 : w * seq + 9] |= TARGET  # labels 4..7 of window w predict them
    write_tokens(tmp_path / "t.tok", tokens, 256, eos=None, flags=flags)
    for pack in (False, True):
        source = TokenFileSource(TokenFile(tmp_path / "t.tok"), seq, seed=1, pack=pack)
        assert source.untargeted_sequences == 40 - len(with_targets)
        assert source.train_sequences + source.eval_sequences == len(with_targets)
        scored = [i for i in range(1, 40 * seq + 1) if flags[i] & TARGET and not (pack and flags[i] & DOC_START)]
        assert source.target_tokens == len(scored)
        drawn = [source.sample(i)[1] for i in range(3 * source.train_sequences)]
        assert all(bool((labels != -100).any()) for labels in drawn)
        again = TokenFileSource(TokenFile(tmp_path / "t.tok"), seq, seed=1, pack=pack)
        assert all(torch.equal(again.sample(i)[1], drawn[i]) for i in (0, 7, 20))
        assert f"{40 - len(with_targets)} sequence(s) without a target skipped" in source.describe()
        assert bool((source.sample(0, "eval")[1] != -100).any())


def test_a_file_without_targets_is_refused(tmp_path):
    tokens = np.arange(200) % 50
    flags = np.zeros(200, dtype=np.uint8)
    flags[[0, 150]] = DOC_START
    flags[120:125] = TARGET  # one window of 64 holds targets: none left to evaluate on
    write_tokens(tmp_path / "t.tok", tokens, 64, flags=flags)
    with pytest.raises(TokenFileError, match=r"1 of its 3 sequence\(s\) of 64\+1 tokens hold a loss target"):
        TokenFileSource(TokenFile(tmp_path / "t.tok"), 64, pack=True)


# -- the equivalence -----------------------------------------------------------------------


def _dense_attention(keep: torch.Tensor):
    def attention(q, k, v, layout=None, sliding_window=None):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep, enable_gqa=True
        )
        return out.transpose(1, 2)

    return attention


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _reference(path: str, windows: list[int], positions_of_rank: list[list[int]], world: int):
    """The unsharded model on the global batch (sample slot s = file window ``windows[s]``),
    with labels and documents from the generator (not the loader), the loss from full logits.
    Returns the correct loss and two wrong ones (prompt tokens counted; each rank normalising
    by its own target count), each with its gradients, and the global target count."""
    tokens, target, start = _chat_stream(SEED)
    assert np.array_equal(np.asarray(TokenFile(path).tokens), tokens)
    ref = build_model(model_config("debug"))
    materialize(ref, torch.device("cpu"), SEED)
    logits, labels, every = [], [], []  # over the global batch, slot after slot
    for w in windows:
        span = slice(w * SEQ, w * SEQ + SEQ + 1)
        ids, tgt, first = torch.tensor(tokens[span]), torch.tensor(target[span]), torch.tensor(start[span])
        cu = [0, *[i for i in range(1, SEQ) if first[i]], SEQ]
        labels.append(torch.where(tgt[1:] & ~first[1:], ids[1:], -100))  # targets, not across a boundary
        every.append(torch.where(~first[1:], ids[1:], -100))  # every token but the boundaries
        positions = torch.tensor([p for a, b in zip(cu, cu[1:]) for p in range(b - a)]).unsqueeze(0)
        for layer in ref.layers:
            layer.attention.attention_fn = _dense_attention(visibility(SEQ, cu, True))
        logits.append(ref(ids[:-1].unsqueeze(0), positions)[0])
    logits, labels, every = torch.cat(logits), torch.cat(labels), torch.cat(every)
    valid = labels != -100
    total = int(valid.sum())
    loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / total
    prompts_counted = F.cross_entropy(logits, every, ignore_index=-100, reduction="sum") / int((every != -100).sum())
    per_token = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    weights = torch.zeros(per_token.shape)
    for held in positions_of_rank:  # each rank's mean over its own targets, averaged over the ranks
        held = torch.tensor(held)
        if int(valid[held].sum()):
            weights[held] = valid[held].float() / (int(valid[held].sum()) * world)
    per_rank = (per_token * weights).sum()
    names, params = zip(*ref.named_parameters())
    out = {}
    for name, value in (("ref", loss), ("prompts_counted", prompts_counted), ("per_rank", per_rank)):
        grads = torch.autograd.grad(value, params, retain_graph=True)
        out[name] = (value.item(), dict(zip(names, grads)))
    return out, total


def _masked_chat_equivalence(path: str, layout: dict, micro: int) -> dict:
    import torch.distributed as dist

    state = cached_state(**layout)
    source = TokenFileSource(TokenFile(path), SEQ, seed=SEED, pack=True)
    loader = BatchLoader(source, BATCH, micro, state.dp, state.coords.dp)
    mine = loader.next()
    # the file window of each sample slot of the global batch (found by its tokens), and the
    # global positions of the tokens this rank's shards hold
    stream = np.asarray(TokenFile(path).tokens)
    windows = []
    for slot in range(BATCH):
        inputs = source.sample(slot)[0].numpy()
        found = [w for w in range(source.sequences) if np.array_equal(stream[w * SEQ : (w + 1) * SEQ], inputs)]
        windows.append(found[0])
    rows = BATCH // (state.dp * micro)
    held = []  # slot * SEQ + offset
    for m, mb in enumerate(mine):
        first = (m * state.dp + state.coords.dp) * rows
        index = torch.arange(first * SEQ, (first + rows) * SEQ).unsqueeze(0)
        seq_layout = sequence_layout(mb.tokens.shape[1], state, mb.attention_documents)
        held += shard_sequence(index, state, layout=seq_layout).flatten().tolist()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held)

    from loongtrain.train.step import forward_backward

    par = parallelize(build_model(model_config("debug")), state, memory=MemoryOptions(activation_checkpoint="sc++"))
    materialize(par, torch.device("cpu"), SEED)
    result = forward_backward(par, state, mine)
    grads = {}
    for name, p in par.named_parameters():
        grads[name] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    ref, total = _reference(path, windows, everyone, dist.get_world_size())
    errors = {}
    for name, (loss, ref_grads) in ref.items():
        errors[name] = {
            "loss": abs(result.loss - loss) / abs(loss),
            "grad": max(_rel(grads[n], ref_grads[n]) for n in grads),
        }
    return {"errors": errors, "targets": result.targets, "ref_targets": total}


def _rank_targets(path: str, layout: dict, micro: int) -> list[int]:
    """This rank's targets in each of its microbatches (how unevenly the masks fall)."""
    from loongtrain.train.step import shard_microbatch

    state = cached_state(**layout)
    source = TokenFileSource(TokenFile(path), SEQ, seed=SEED, pack=True)
    batch = BatchLoader(source, BATCH, micro, state.dp, state.coords.dp).next()
    return [int((shard_microbatch(mb, state).labels != -100).sum()) for mb in batch]


# (layout, microbatches): 2D head x context (double ring of 2) with both balances, and dp=2 x 2 microbatches
EQUIVALENCE = [
    ({"hp": 2, "cp": 2, "ring_window": 2, "balance": "documents"}, 1),
    ({"hp": 2, "cp": 2, "ring_window": 2, "balance": "zigzag"}, 1),
    ({"cp": 2, "dp": 2, "balance": "documents"}, 2),
]
TOLERANCE = 1e-5


@pytest.mark.dist
def test_masked_chat_batch_matches_the_unsharded_model(dist_pool, tmp_path, capsys):
    from loongtrain.attention.sharding import sequence_sharding

    path = tmp_path / "chat.tok"
    _write_chat_file(path)
    (row,) = BatchLoader(TokenFileSource(TokenFile(path), SEQ, seed=SEED, pack=True), BATCH, 1, 1, 0).next()
    cu = tuple(row.cu_seqlens.tolist())
    zigzag, documents = (sequence_sharding(BATCH * SEQ, 2, 2, cu, b).content for b in ("zigzag", "documents"))
    assert zigzag != documents, "the two balances must lay this batch out differently"
    pool = dist_pool(4)
    report = []
    for layout, micro in EQUIVALENCE:
        results = pool.run(_masked_chat_equivalence, str(path), layout, micro)
        for result in results:
            errors = result["errors"]
            assert result["targets"] == result["ref_targets"], "the normaliser is the global batch's targets"
            assert errors["ref"]["loss"] <= TOLERANCE and errors["ref"]["grad"] <= TOLERANCE, errors
            # what would be computed if prompt tokens were counted, or each rank divided by its own
            # count: the loss moves little (a random model's per-token losses are all near ln 256),
            # the gradients a lot
            for wrong in ("prompts_counted", "per_rank"):
                assert errors[wrong]["loss"] > 10 * TOLERANCE, (wrong, errors)
                assert errors[wrong]["grad"] > 1000 * TOLERANCE, (wrong, errors)
        per_rank = [sum(r) for r in pool.run(_rank_targets, str(path), layout, micro)]
        assert max(per_rank) >= 2 * max(1, min(per_rank)), f"the masks fall evenly on the ranks: {per_rank}"
        report.append((layout, micro, results[0]["errors"], per_rank))
    with capsys.disabled():
        for layout, micro, errors, per_rank in report:
            print(
                f"\n{layout} x{micro}: loss {errors['ref']['loss']:.1e} grad {errors['ref']['grad']:.1e}; "
                f"prompts counted: loss {errors['prompts_counted']['loss']:.1e} grad "
                f"{errors['prompts_counted']['grad']:.1e}; per-rank normaliser: loss {errors['per_rank']['loss']:.1e} "
                f"grad {errors['per_rank']['grad']:.1e}; targets per rank {per_rank}"
            )


# -- the behaviour -------------------------------------------------------------------------

LETTERS = "abcdefghijklmnopqrstuvwxyz"
PROMPT_LETTERS = 8


def _train(path, steps: int, seq: int = 128, batch: int = 8) -> torch.nn.Module:
    """The debug model trained on ``path`` with the library's loss (labels from the loader)."""
    source = TokenFileSource(TokenFile(path), seq, seed=0, pack=True, eval_fraction=0.05)
    loader = BatchLoader(source, batch, 1, 1, 0)
    model = build_model(model_config("debug", vocab_size=257))  # the byte tokenizer's 256 bytes + EOS
    materialize(model, torch.device("cpu"), 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    for _ in range(steps):
        (mb,) = loader.next()
        layout = sequence_layout(mb.tokens.shape[1], None, mb.cu_seqlens)
        loss_sum, _ = model(mb.tokens, mb.positions(), layout, labels=mb.labels)
        (loss_sum / (mb.labels != -100).sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return model


@torch.no_grad()
def _prompt_and_completion_loss(model, path, seq: int = 128) -> tuple[float, float]:
    """Mean per-token loss on held-out windows of the masked file: on the prompt letters
    (labels that are not targets and predict a letter) and on the completions (targets)."""
    source = TokenFileSource(TokenFile(path), seq, seed=0, pack=True, eval_fraction=0.05)
    prompt, completion = [], []
    for i in range(source.eval_sequences):
        tokens, labels, cu = source.sample(i, "eval")
        following = torch.cat([tokens[1:], labels[-1:]])  # the next token at every position
        following[cu[1:-1] - 1] = -100  # across a document boundary: not scored
        mb = Microbatch(tokens[None], following[None], cu)
        loss, _ = model(mb.tokens, mb.positions(), sequence_layout(seq, None, cu), labels=mb.labels, reduction="none")
        loss = loss.flatten()
        letter = (following >= ord("a")) & (following <= ord("z"))
        prompt.append(loss[letter & (labels == -100)])
        completion.append(loss[labels != -100])
    return torch.cat(prompt).mean().item(), torch.cat(completion).mean().item()


def _trained_figures(files: list[str], masked_file: str) -> tuple[float, float]:
    """On rank r: the model trained on ``files[r]`` (one thread, as every pool worker), scored
    on the masked file's held-out windows."""
    torch.manual_seed(0)
    model = _train(files[torch.distributed.get_rank()], steps=200)
    return _prompt_and_completion_loss(model, masked_file)


@pytest.mark.e2e  # two training runs (one process each, at once), a behaviour test
def test_masked_training_does_not_learn_the_prompts(dist_pool, tmp_path):
    """Records ``{"prompt": 8 random letters + "=", "completion": the letters in upper case}``
    through `loongtrain prepare` (byte tokenizer): the prompts are not targets. Trained on the
    file's masks, the model learns the completions and nothing about the prompts: its loss on
    prompt letters does not fall below what an untrained model scores, ln(257). The ablation
    (the same file with every token a target) learns the prompt distribution, its loss falling
    to that distribution's entropy ln(26); only masked training passes the first assertion."""
    from loongtrain.data.prepare import prepare

    torch.manual_seed(0)
    rng = random.Random(0)
    with open(tmp_path / "records.jsonl", "w") as f:
        for _ in range(3000):
            letters = "".join(rng.choice(LETTERS) for _ in range(PROMPT_LETTERS))
            f.write(json.dumps({"prompt": letters + "=", "completion": letters.upper()}) + "\n")
    prepare([str(tmp_path / "records.jsonl")], str(tmp_path / "masked.tok"), None, workers=1)
    masked = TokenFile(tmp_path / "masked.tok")
    assert 0.4 < float((masked.flags & TARGET).mean()) < 0.6  # upper-case letters and EOS
    write_tokens(
        tmp_path / "unmasked.tok", masked.tokens, masked.vocab_size, eos=masked.eos,
        flags=np.asarray(masked.flags) | TARGET, fingerprint=masked.tokenizer_fingerprint,
    )  # fmt: skip
    untrained_chance, prompt_entropy = math.log(257), math.log(len(LETTERS))
    # the two trainings at once on two pool processes of one thread each (small matmuls: one
    # thread is several times faster than two on a busy machine, and both cores stay busy)
    names = ("masked", "unmasked")
    files = [str(tmp_path / f"{name}.tok") for name in names]
    results = dist_pool(2).run(_trained_figures, files, str(tmp_path / "masked.tok"))
    figures = dict(zip(names, results))
    print(f"\nprompt / completion loss: {figures}; ln(257) = {untrained_chance:.3f}, ln(26) = {prompt_entropy:.3f}")
    (masked_prompt, masked_completion), (ablation_prompt, ablation_completion) = figures["masked"], figures["unmasked"]
    assert masked_completion < 0.5 and ablation_completion < 0.5, "the completions are learned either way"
    assert masked_prompt > 0.97 * untrained_chance, "with masks nothing of the prompt distribution is learned"
    assert abs(ablation_prompt - prompt_entropy) < 0.05 * prompt_entropy, "without masks it is"
