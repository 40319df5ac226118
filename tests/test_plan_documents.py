"""``loongtrain plan --documents``: the documents cut into packed sequences as the loader
cuts them, and what a layout per microbatch would gain, priced with the chooser's model."""

from __future__ import annotations

import numpy as np
import pytest

from loongtrain.data import write_tokens
from loongtrain.planner.cli import parse_candidate
from loongtrain.planner.cost import Workload
from loongtrain.planner.specs import PlanError, cluster_spec, model_spec
from loongtrain.tools.calibrate.per_batch import document_lengths, packed_sequences, predict_per_batch


def test_sequences_are_cut_from_the_documents_stream():
    lengths = np.array([5, 3, 10, 2, 4])  # stream ends at 5, 8, 18, 20, 24
    assert packed_sequences(lengths, 8, 3) == [(0, 5, 8), (0, 8), (0, 2, 4, 8)]
    with pytest.raises(PlanError, match="fewer than 4 sequences of 8"):
        packed_sequences(lengths, 8, 4)


def test_document_mixes_and_files(tmp_path):
    a, about = document_lengths("lognormal:median=512,sigma=1,max=4096", 100_000, seed=1)
    b, _ = document_lengths("lognormal:median=512,sigma=1,max=4096", 100_000, seed=1)
    assert (a == b).all() and a.sum() >= 100_000 and a.max() <= 4096 and 400 < np.median(a) < 650
    assert "median 512" in about
    eos = 7
    write_tokens(tmp_path / "d.tok", np.array([1, 2, eos, 3, eos, 4, 5, 6, eos]), 10, eos=eos)
    lengths, about = document_lengths(str(tmp_path / "d.tok"), 20)
    assert lengths.tolist() == [3, 2, 4] * 3 and "3 documents" in about
    for spec, message in [("lognormal:mean=3", "unknown key 'mean'"), ("lognormal:sigma=x", "is not a number"),
                          ("nothing.tok", "neither a token file nor a mix")]:  # fmt: skip
        with pytest.raises(PlanError, match=message):
            document_lengths(spec, 10)


def test_short_documents_run_without_ring_transfers():
    cluster, model = cluster_spec("h100"), model_spec("llama3-8b")
    work = Workload.from_tokens(model, 128 * 1024, 16 * 128 * 1024)
    candidate = parse_candidate("hp=8,cp=2,ckpt=sc++", 64)  # sp = 16 over two nodes, dp = 4
    short, _ = document_lengths("lognormal:median=256,sigma=1,max=1024", work.tokens, seed=0)  # <= 1/64 of a shard
    pred = predict_per_batch(cluster, work, candidate, short, "short", steps=1)
    # zigzag cuts documents across both context ranks; the locality balance keeps each whole on
    # one (but one document may have to straddle the two shards, which are of equal size)
    assert 0 <= pred.locality.ring_mib < pred.fixed.ring_mib / 2
    assert pred.per_batch.ring_mib <= pred.locality.ring_mib
    assert pred.per_batch.step_s <= pred.locality.step_s < pred.fixed.step_s and pred.gain > 1
    # the chooser's model and the planner's price a one-document sequence alike
    assert pred.one_document_attention_s == pytest.approx(pred.planner_attention_s, rel=0.25)
    with pytest.raises(PlanError, match="--micro-batch 1"):
        predict_per_batch(cluster, Workload(model, 1024, batch=4, micro_batch=2), candidate, short, "", 1)
