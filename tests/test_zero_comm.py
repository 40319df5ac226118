"""ZeRO's collectives counted into ``state.stats``, against counts by hand from the model's
parameter shapes: FSDP2 pads each parameter's dim 0 to a multiple of the shard group, a
unit's all-gather sends the rank's padded shard to the ``n - 1`` others, a reduce-scatter
(float32) moves the same shard ``n - 1`` times, and HSDP's all-reduce over ``r`` replicas
``2 (r - 1) / r`` of it. Blocks reshard after forward (gathered again in backward); the
root does not."""

from __future__ import annotations

import math
import weakref

import pytest
import torch

from loongtrain.apply import MemoryOptions, materialize, parallelize
from loongtrain.apply.zero_comm import zero_comm_countable
from loongtrain.data.batch import Microbatch
from loongtrain.model import build_model, model_config
from loongtrain.train.step import shard_microbatch

from dist_pool import cached_state
from reference import lm_loss_sum


def _shard_numel(shapes: list[torch.Size], n: int) -> int:
    return sum(math.ceil(s[0] / n) * math.prod(s[1:]) for s in shapes)


def _hand_counts(model, n: int, replicas: int, bytes_per: int = 4) -> dict[str, int]:
    layer_ids = {id(p) for layer in model.layers for p in layer.parameters()}
    units = [[p.shape for p in layer.parameters()] for layer in model.layers]
    root = [p.shape for p in model.parameters() if id(p) not in layer_ids]
    shards = [_shard_numel(u, n) * bytes_per for u in units]
    root_shard = _shard_numel(root, n) * bytes_per
    counts = {
        "zero.all_gather": (2 * sum(shards) + root_shard) * (n - 1),
        "zero.reduce_scatter": (sum(shards) + root_shard) * (n - 1),
    }
    if replicas > 1:
        counts["zero.all_reduce"] = sum(2 * (replicas - 1) * s // replicas for s in shards + [root_shard])
    return counts


def _counted(layout: dict, zero: str) -> dict:
    state = cached_state(**layout)
    mcfg = model_config("debug", n_layers=2)
    model = parallelize(build_model(mcfg), state, memory=MemoryOptions(activation_checkpoint="none"), zero=zero)
    materialize(model, torch.device("cpu"), 0)
    data = torch.randint(0, mcfg.vocab_size, (1, 8 * state.sp + 1), generator=torch.Generator().manual_seed(0))
    shard = shard_microbatch(Microbatch(data[:, :-1], data[:, 1:]), state)
    state.stats.reset()
    lm_loss_sum(model(shard.tokens, shard.positions), shard.labels).backward()
    n, replicas = {"dp_sp": (4, 1), "sp": (2, 2), "dp": (2, 2), "none": (1, 4)}[zero]
    measured = {k: (state.stats.bytes.get(k, 0), state.stats.received.get(k, 0)) for k in
                ("zero.all_gather", "zero.reduce_scatter", "zero.all_reduce")}  # fmt: skip
    expected = {k: (v, v) for k, v in _hand_counts(model, n, replicas).items() if v}
    return {"counted": model.zero_comm_counted, "measured": {k: v for k, v in measured.items() if v[0]},
            "expected": expected}  # fmt: skip


@pytest.mark.dist
@pytest.mark.skipif(not zero_comm_countable(), reason="this torch's FSDP2 takes no custom collectives")
def test_zero_bytes_equal_counts_by_hand(dist_pool):
    pool = dist_pool(4)
    # ZeRO over all four ranks, and HSDP (shard over sp=2, replicate over dp=2)
    for layout, zero in [({"hp": 2, "cp": 2}, "dp_sp"), ({"cp": 2, "dp": 2}, "sp")]:
        for rank, got in enumerate(pool.run(_counted, layout, zero)):
            assert got["counted"]
            assert got["measured"] == got["expected"], (layout, zero, rank)


@pytest.mark.skipif(not zero_comm_countable(), reason="this torch's FSDP2 takes no custom collectives")
def test_one_rank_reduce_scatter_hands_its_input_over_and_never_a_dropped_one():
    """FSDP2's one-rank reduce allocates its input, then, holding it, its output: the output is
    the input. An input whose reduce never asked for its output (an error in between) is not
    handed to the next reduce, whose input and output pair again; on more ranks, two buffers."""
    from loongtrain.apply.zero_comm import _CountingReduceScatter
    from loongtrain.parallel.stats import AttentionStats

    cpu = torch.device("cpu")
    one = _CountingReduceScatter(AttentionStats(), single_shard=True)
    reduce_input = one.allocate((12,), dtype=torch.float32, device=cpu)
    assert one.allocate((12,), dtype=torch.float32, device=cpu) is reduce_input
    dropped = weakref.ref(one.allocate((12,), dtype=torch.float32, device=cpu))  # its reduce failed before
    reduce_input = one.allocate((12,), dtype=torch.float32, device=cpu)  # asking for the output
    assert dropped() is None  # let go, not handed out as this input
    assert one.allocate((12,), dtype=torch.float32, device=cpu) is reduce_input
    held = one.allocate((12,), dtype=torch.float32, device=cpu)
    assert one.allocate((12,), dtype=torch.bfloat16, device=cpu) is not held  # another dtype: a new buffer
    many = _CountingReduceScatter(AttentionStats(), single_shard=False)
    first = many.allocate((12,), dtype=torch.float32, device=cpu)
    assert many.allocate((12,), dtype=torch.float32, device=cpu) is not first
