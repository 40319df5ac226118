"""Selective Checkpoint++ keeps the distributed attention out of recompute.

Counts what the distributed attention does during the backward pass, per checkpoint
mode: with ``full`` the recompute re-runs the attention forward (its all-to-alls, ring
hops and block kernels); with ``sc++`` none of that happens, only the attention's own
backward; ``none`` is the baseline.
"""

from __future__ import annotations

import gc

import pytest
import torch

from loongtrain.apply import MemoryOptions, materialize, parallelize
from loongtrain.data.batch import Microbatch
from loongtrain.model import build_model, model_config
from loongtrain.train.step import shard_microbatch

from dist_pool import cached_state
from reference import lm_loss_sum


def _backward_counts(cfg: dict, mode: str, every: int, first: int = 0) -> dict:
    state = cached_state(**cfg)
    mcfg = model_config("debug", n_layers=4)
    model = parallelize(
        build_model(mcfg),
        state,
        memory=MemoryOptions(
            activation_checkpoint=mode, activation_checkpoint_every=every, activation_checkpoint_layers=first
        ),
        zero="dp_sp",
    )
    materialize(model, torch.device("cpu"), 0)
    seq = 8 * state.sp
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, mcfg.vocab_size, (2, seq + 1), generator=gen)
    shard = shard_microbatch(Microbatch(data[:, :-1], data[:, 1:]), state)
    tokens, labels, positions = shard.tokens, shard.labels, shard.positions

    def step():
        loss = lm_loss_sum(model(tokens, positions), labels)
        state.stats.reset()
        loss.backward()
        model.zero_grad(set_to_none=False)
        return state.stats.snapshot()

    counts = step()
    gc.collect()
    live_after_first = sum(1 for o in gc.get_objects() if torch.is_tensor(o))
    step()
    gc.collect()
    live_after_second = sum(1 for o in gc.get_objects() if torch.is_tensor(o))
    return {"counts": counts, "live_tensor_growth": live_after_second - live_after_first}


@pytest.mark.dist
@pytest.mark.parametrize(
    "mode, every, first, recomputed_layers",
    [("none", 1, 0, 0), ("full", 1, 0, 4), ("full", 2, 0, 2), ("full", 1, 3, 3), ("sc++", 1, 0, 0), ("sc++", 2, 0, 0)],
)
def test_backward_reruns_attention_only_under_full(dist_pool, mode, every, first, recomputed_layers):
    layers, cp = 4, 2
    for result in dist_pool(4).run(_backward_counts, {"hp": 2, "cp": 2}, mode, every, first):
        counts = result["counts"]
        # the attention backward itself: 3 all-to-alls, cp-1 KV hops, cp-1 dKV partials, cp blocks per layer
        assert counts["bwd.all_to_all"] == 3 * layers
        assert counts["bwd.ring_kv"] == (cp - 1) * layers
        assert counts["bwd.ring_dkv"] == (cp - 1) * layers
        assert counts["bwd.block"] == cp * layers
        # attention forward work repeated during backward (recompute)
        assert counts.get("fwd.all_to_all", 0) == 3 * recomputed_layers
        assert counts.get("fwd.ring_kv", 0) == (cp - 1) * recomputed_layers
        assert counts.get("fwd.block", 0) == cp * recomputed_layers
        assert result["live_tensor_growth"] == 0, "tensors kept past the step"
