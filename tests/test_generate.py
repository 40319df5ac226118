"""Generation on the training layout (``loongtrain.generate``): the cache placement (pure),
the cache's window, sampling, and greedy generation equal to transformers' ``generate`` on
tiny models of every family, in one process and on 2D / ring / Ulysses layouts, with several
prompts of different lengths at once."""

from __future__ import annotations

import pytest
import torch

from loongtrain.attention.layout import sequence_layout
from loongtrain.generate.cache import PromptCache, context_positions, first_owners, owner, prompt_entries
from loongtrain.generate.engine import padded_length
from loongtrain.generate.sampling import Sampling, next_tokens
from loongtrain.parallel import ParallelConfig

from hf_tiny import FAMILIES, make_hf_model

NEW = 8  # new tokens per prompt
PROMPT_LENGTHS = (5, 13, 9)


# -- placement (pure) -------------------------------------------------------------------------


@pytest.mark.parametrize("config", [dict(cp=4), dict(hp=2, cp=2), dict(cp=4, balance="documents"),
                                    dict(cp=4, balance="locality"), dict(hp=4)])  # fmt: skip
def test_every_prompt_token_is_kept_once_in_position_order(config):
    cfg = ParallelConfig(**config)
    cu = [0, 5, 18, 27, padded_length(27, cfg.hp, cfg.cp)]
    layout = sequence_layout(cu[-1], cfg, cu)
    seen = {}
    for c in range(cfg.cp):
        positions = context_positions(layout, c)
        for p, (index, inside) in enumerate(prompt_entries(positions, cu, 3)):
            assert inside.tolist() == sorted(inside.tolist())
            assert (positions[index] - cu[p]).tolist() == inside.tolist()
            for g in positions[index].tolist():
                assert g not in seen
                seen[g] = c
    assert sorted(seen) == list(range(27))  # every prompt token once, the padding never
    counts = [[sum(1 for g, c in seen.items() if c == k and cu[p] <= g < cu[p + 1]) for k in range(cfg.cp)]
              for p in range(3)]  # fmt: skip
    for p, first in enumerate(first_owners(layout, cu, 3)):
        assert counts[p][first] == min(counts[p])
        assert first == counts[p].index(min(counts[p]))


def test_decoded_entries_go_round_robin_and_stay_balanced():
    placed = [owner(2, t, 4) for t in range(10)]
    assert placed == [2, 3, 0, 1, 2, 3, 0, 1, 2, 3]


def test_padded_length_is_the_shortest_shardable():
    assert padded_length(27, 1, 1) == 27
    assert padded_length(27, 2, 2) == 32 and padded_length(32, 2, 2) == 32
    assert padded_length(1, 3, 1) == 6


def test_a_window_cache_keeps_only_what_the_window_sees_and_reuses_its_room():
    kv = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 1, 3)
    cache = PromptCache(kv, torch.tensor([3, 4, 5, 6]), capacity=5)
    cache.evict(5)  # a window that starts at position 5
    k, _ = cache.live()
    assert k.shape[0] == 2 and torch.equal(k, kv[0, 2:])
    for position in (7, 8, 9):  # a window of 3; the second append finds the buffer full: live entries move
        cache.evict(position - 3 + 1)
        cache.append(torch.full((2, 1, 3), float(position)), position)
    k, v = cache.live()
    assert cache.positions[cache.start : cache.length].tolist() == [7, 8, 9]
    assert k[:, 0, 0].tolist() == [7.0, 8.0, 9.0] and v.shape == (3, 1, 3)
    assert cache.kv.shape[1] == 5  # no growth


# -- sampling ---------------------------------------------------------------------------------


def test_greedy_is_the_first_maximum_and_sampling_follows_its_seed():
    logits = torch.tensor([[0.0, 2.0, 2.0, -1.0], [5.0, 1.0, 0.0, 0.0]])
    assert next_tokens(logits, Sampling(), None).tolist() == [1, 0]
    sampling = Sampling(temperature=1.0, seed=3)
    draws = [next_tokens(logits.repeat(50, 1), sampling, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    nucleus = Sampling(temperature=1.0, top_p=0.5)
    sharp = torch.tensor([[3.0, 0.0, 0.0, 0.0]]).repeat(200, 1)  # the first token alone holds > 0.5
    assert set(next_tokens(sharp, nucleus, torch.Generator().manual_seed(0)).tolist()) == {0}
    wide = next_tokens(sharp, Sampling(temperature=1.0), torch.Generator().manual_seed(0))
    assert len(set(wide.tolist())) > 1


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_sampling_is_refused(bad):
    with pytest.raises(ValueError):
        Sampling(**bad)


# -- against transformers -----------------------------------------------------------------------


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 96, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _hf_generate(folder, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False, output_logits=True,
        return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), torch.stack([step[0] for step in out.logits])


def _generate_on(folders: dict, config: dict, prompts, zero: bool = True, head_groups: int = 1) -> dict:
    """Body on every rank: each family's greedy tokens and logits [steps, P, V] (``zero``:
    the model under FSDP, gathered for the generation; else a plain module; ``head_groups``:
    parallelized with the attention over head groups, which generation runs whole)."""
    from loongtrain.apply import MemoryOptions, parallelize
    from loongtrain.generate import Sampling, generate
    from loongtrain.hf.load import load_weights, read_folder
    from loongtrain.model import build_model

    from dist_pool import cached_state

    state = cached_state(**config)
    out = {}
    for family, folder in folders.items():
        hf = read_folder(folder)
        model = build_model(hf.model)
        if zero:  # head groups run Llama's blocks only (not OLMo 3's)
            groups = head_groups if hf.model.pre_norm_blocks else 1
            parallelize(model, state, zero="dp_sp", memory=MemoryOptions(head_groups=groups))
        model.to_empty(device="cpu")
        load_weights(model, hf)
        done = generate(model, state, prompts, Sampling(max_new_tokens=NEW), keep_logits=True)
        out[family] = (done.tokens, torch.stack(done.logits), done.decode_steps)
        if family == "llama":  # a stop condition on the text (here: the third token) ends a prompt there
            early = generate(model, state, prompts, Sampling(max_new_tokens=NEW), stop_when=lambda p, t: len(t) == 3)
            assert early.tokens == [t[:3] for t in done.tokens] and early.stopped == [True] * len(prompts)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("gen")
    folders = {f: str(make_hf_model(f, root / f, seed=i)) for i, f in enumerate(FAMILIES)}
    folders["ulysses3"] = str(make_hf_model("qwen3", root / "ulysses3", seed=9, num_attention_heads=6,
                                            num_key_value_heads=3, head_dim=16))  # fmt: skip
    expected = {f: [_hf_generate(folder, p) for p in _prompts()] for f, folder in folders.items()}
    return folders, expected


def _assert_same(results: dict, expected: dict, where: str) -> None:
    for family, (tokens, logits, steps) in results.items():
        assert steps == NEW - 1
        for p, (ref_tokens, ref_logits) in enumerate(expected[family]):
            assert tokens[p] == ref_tokens, f"{family} prompt {p} {where}: {tokens[p]} vs {ref_tokens}"
            for t in range(NEW):
                err = ((logits[t, p] - ref_logits[t]).norm() / ref_logits[t].norm()).item()
                assert err < 1e-4, f"{family} prompt {p} step {t} {where}: logits rel err {err:.1e}"


@pytest.mark.dist
def test_one_process_generates_as_transformers(dist_pool, reference):
    folders, expected = reference
    (result,) = dist_pool(1).run(_generate_on, {f: folders[f] for f in FAMILIES}, {}, _prompts(), False)
    _assert_same(result, expected, "1 rank")


@pytest.mark.dist
@pytest.mark.parametrize("world,config", [
    (4, dict(cp=4, ring_window=2)), (4, dict(hp=2, cp=2, ring_window=2, balance="locality")), (3, dict(hp=3)),
])  # fmt: skip
def test_sharded_generation_equals_transformers(dist_pool, reference, world, config):
    folders, expected = reference
    chosen = {"ulysses3": folders["ulysses3"]} if config.get("hp") == 3 else {f: folders[f] for f in FAMILIES}
    groups = 2 if config.get("balance") == "locality" else 1  # a model trained over head groups generates whole
    results = dist_pool(world).run(_generate_on, chosen, config, _prompts(), True, groups)
    for rank, result in enumerate(results):
        _assert_same(result, expected, f"rank {rank} of {config}")


def test_a_sliding_layers_cache_is_priced_by_its_window():
    """OLMo 3 7B, one 128K-token prompt on one rank, bf16: a full layer's cache is 128K x (k, v) x
    32 heads x 128 x 2 B = 2 GiB, a sliding layer's 4096 tokens of it (64 MiB); 8 full + 24 sliding."""
    from types import SimpleNamespace

    from loongtrain.generate.cli import layer_cache_bytes_per_rank
    from loongtrain.model import PRESETS

    one_rank = SimpleNamespace(parallel=SimpleNamespace(hp=1, cp=1))
    got = layer_cache_bytes_per_rank(PRESETS["olmo3-7b"], one_rank, 131072, 1, 2)
    assert got == 8 * 2 * 2**30 + 24 * 64 * 2**20  # 17.5 GiB, not 64
