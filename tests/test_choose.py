"""A layout per microbatch (pure): the candidate splits, and the choice the documents make."""

import pytest

from loongtrain.attention.choose import (
    CPU_GLOO,
    GPU_NODE,
    AttentionShape,
    candidate_configs,
    choose_layout,
    layout_cost,
    layout_seconds,
)
from loongtrain.config import ConfigError, load_config
from loongtrain.parallel import ParallelConfig

pytestmark = pytest.mark.unit

SHAPE = AttentionShape(heads=8, kv_heads=2, head_dim=64, elem_bytes=4)


def test_candidates_are_the_splits_the_heads_allow():
    base = ParallelConfig(hp=2, cp=4, ring_window=2, balance="locality")
    got = [(c.hp, c.cp, c.ring_window) for c in candidate_configs(base, heads=8, kv_heads=2)]
    # the configured one first; hp=8 replicates 2 KV heads 4x; cp=8 keeps the window 2, cp=1 a plain ring
    assert got == [(2, 4, 2), (1, 8, 2), (4, 2, 2), (8, 1, 1)]
    assert all(c.balance == "locality" and c.sp == 8 for c in candidate_configs(base, 8, 2))
    # 6 heads over 3 KV heads: hp must divide 3 or be a multiple of it
    assert [c.hp for c in candidate_configs(ParallelConfig(cp=6), 6, 3)] == [1, 3, 6]
    # two head groups of 4 query heads over 1 KV head: no split over 8 head ranks
    assert [c.hp for c in candidate_configs(base, 8, 2, head_groups=2)] == [2, 1, 4]


def test_a_refused_microbatch_is_named_under_a_layout_per_batch():
    """The chooser's refusal (or the chosen split's) names the microbatch, its documents and the
    layout, as under the fixed layout."""
    from types import SimpleNamespace

    import torch

    from loongtrain.data.batch import Microbatch
    from loongtrain.train.step import _shard

    mb = Microbatch(
        torch.zeros(1, 12, dtype=torch.long), torch.zeros(1, 12, dtype=torch.long), torch.tensor([0, 5, 12])
    )

    def refuse(batch):
        raise ValueError("no split fits")

    with pytest.raises(ValueError, match=r"microbatch 3 \(tokens \(1, 12\), documents of \[5, 7\] tokens\) cannot "
                                         r"run under parallel.layout=per_batch: no split fits"):  # fmt: skip
        _shard(3, mb, SimpleNamespace(hp=2, cp=2), refuse)
    odd = SimpleNamespace(hp=1, cp=5, config=ParallelConfig(cp=5))  # 12 tokens do not split over 2 x 5
    with pytest.raises(
        ValueError, match=r"microbatch 0 .* on hp=1 x cp=5 \(chosen for it by parallel.layout=per_batch\)"
    ):
        _shard(0, mb, None, lambda batch: odd)


@pytest.mark.parametrize("speeds", [CPU_GLOO, GPU_NODE])
def test_documents_that_fit_a_shard_take_the_layout_that_sends_nothing(speeds):
    seq = 8192
    configs = candidate_configs(ParallelConfig(hp=2, cp=2, ring_window=2, balance="locality"), 8, 2)
    local = tuple(range(0, seq + 1, 256))  # 32 documents of 256 tokens: 8 whole ones per rank of a ring of 4
    chosen = configs[choose_layout(configs, seq, local, None, SHAPE, speeds)]
    assert (chosen.hp, chosen.cp) == (1, 4)
    # its price is its kernels alone: 4 ranks x 8 documents of 256 x 257 / 2 keys each
    kernels = 8 * 256 * 257 / 2 * 8 * 64 * 4 * 3.5 / speeds.flops
    assert layout_seconds(chosen, seq, local, None, SHAPE, speeds) == pytest.approx(kernels)


def test_one_long_document_prices_the_ring_and_the_all_to_all():
    """By hand, S=8192, sp=4, fp32, 8 heads of 64 over 2 KV heads, CPU_GLOO. Ring of 4: every rank
    does S^2/2/4 pairs x 8 heads; it sends 3 KV blocks each way and 3 fp32 partials of
    2 x 2048 x 2 x 64 x 4 B = 2 MiB. Ulysses (hp=4): a quarter of the heads over all of S, and
    the all-to-alls: (q + k, v replicated to 4 heads + out) of 2048 tokens, both ways, 3/4 sent."""
    seq, pairs = 8192, 8192 * 8193 / 2
    ring = ParallelConfig(cp=4)
    block = 2 * 2048 * 2 * 64 * 4
    compute = pairs / 4 * 8 * 64 * 14 / 40e9
    # CPU processes copy with the cores that compute: the ring adds; a GPU's ring hides behind the kernels
    assert layout_seconds(ring, seq, None, None, SHAPE, CPU_GLOO) == pytest.approx(compute + 9 * block / 1e9, rel=1e-3)
    gpu_compute = pairs / 4 * 8 * 64 * 14 / GPU_NODE.flops
    assert layout_seconds(ring, seq, None, None, SHAPE, GPU_NODE) == pytest.approx(
        max(gpu_compute, 9 * block / GPU_NODE.ring_bytes_per_s), rel=1e-3
    )
    ulysses = ParallelConfig(hp=4)
    a2a = 2 * (2048 * (8 + 2 * 4) * 64 * 4 + 2048 * 8 * 64 * 4) * 3 / 4 / 1e9
    assert layout_seconds(ulysses, seq, None, None, SHAPE, CPU_GLOO) == pytest.approx(pairs * 2 * 64 * 14 / 40e9 + a2a)


def test_a_sliding_layer_is_priced_by_its_halo():
    """By hand, S=8192 on a ring of 4 (chunks of 1024; rank c holds chunks c and 7 - c), window 256:
    every chunk but the first reads the 255 columns before it from the previous chunk's owner
    (chunk 4 reads its own rank's chunk 3). Ranks 1 and 2 each send two such pieces in both passes
    and the float32 dK/dV of the two pieces they read back: (2 x 2 x 255 + 2 x 255) columns of
    2 x 2 KV heads x 64 fp32. The ring would send 3 whole K/V blocks each way and 3 partials."""
    column = 2 * 2 * 64 * 4
    sliding = layout_cost(ParallelConfig(cp=4), 8192, None, 256, SHAPE, CPU_GLOO)
    assert sliding.ring_bytes == (2 * 2 * 255 + 2 * 255) * column == 1_566_720
    full = layout_cost(ParallelConfig(cp=4), 8192, None, None, SHAPE, CPU_GLOO)
    assert full.ring_bytes == 2 * 3 * 2048 * column + 3 * 2048 * column


def test_each_layer_is_priced_by_its_own_window():
    """OLMo 3's pattern (three sliding layers, here of 128 tokens, per full one) at 8192 tokens on 8
    GPUs: priced by its full layers alone hp 2 x cp 4 wins; every layer by its own window, the pure
    ring (its sliding layers send only their halos and no all-to-all), the cheapest sum of three
    sliding layers and one full."""
    configs = candidate_configs(ParallelConfig(hp=2, cp=4), 8, 2)
    full_only = configs[choose_layout(configs, 8192, None, None, SHAPE, GPU_NODE)]
    chosen = choose_layout(configs, 8192, None, (128, 0, 128, 128), SHAPE, GPU_NODE)
    assert (full_only.hp, full_only.cp) == (2, 4) and (configs[chosen].hp, configs[chosen].cp) == (1, 8)
    sums = [3 * layout_seconds(c, 8192, None, 128, SHAPE, GPU_NODE) + layout_seconds(c, 8192, None, None, SHAPE,
            GPU_NODE) for c in configs]  # fmt: skip
    assert chosen == sums.index(min(sums))
    # one window on every layer chooses as that window alone
    assert choose_layout(configs, 8192, None, (128,) * 4, SHAPE, GPU_NODE) == choose_layout(
        configs, 8192, None, 128, SHAPE, GPU_NODE
    )


def test_a_layout_per_microbatch_does_not_compile():
    with pytest.raises(ConfigError, match="parallel.layout='per_batch' changes it per microbatch"):
        load_config(None, ["parallel.layout=per_batch", "run.compile=true"])
    with pytest.raises(ConfigError, match="layout"):
        load_config(None, ["parallel.layout=sometimes"])
