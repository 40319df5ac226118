"""What ``loongtrain plan --validate`` compares: the layouts it runs, the predicted time of
each, and the summary of measured against predicted. Pure (the measuring side is
``loongtrain.tools.calibrate.validate``).

Targets: median absolute error of forward+backward at most 15%, and the layout
predicted fastest among the two measured fastest.

The machine is shared: how fast its cores run for these processes drifts with other
users' load between ``--calibrate`` and ``--validate``. So validation times a probe (the
calibration's non-causal ring-step block, every rank at once) around its runs and
rescales the cluster's attention rates by measured / predicted probe time; it reports
the errors with that rescaling and without it.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from loongtrain.model.config import ModelConfig
from loongtrain.planner.cost import Candidate, Workload, attention_seconds, block_seconds, candidate_topology
from loongtrain.planner.search import head_degree_ok
from loongtrain.planner.specs import ClusterSpec

MEDIAN_ERROR_TARGET = 0.15
PROBE_TOKENS = 2048  # local tokens of the drift probe's block (one of the calibration's sizes)


def validation_layouts(world: int, heads: int, kv_heads: int) -> list[tuple[str, Candidate]]:
    """At least six distinct layouts of ``world`` ranks: rings, double ring, Ulysses, 2D, data parallel."""
    m = ModelConfig(dim=heads * 8, n_heads=heads, n_kv_heads=kv_heads)
    out: list[tuple[str, Candidate]] = [(f"ring cp={world}", Candidate.of(cp=world))]
    for w in (x for x in range(2, world) if world % x == 0):
        out.append((f"double ring cp={world} w={w}", Candidate.of(cp=world, ring_window=w)))
    if head_degree_ok(m, world):
        out.append((f"ulysses hp={world}", Candidate.of(hp=world)))
    for hp in (x for x in range(2, world) if world % x == 0 and head_degree_ok(m, x)):
        cp = world // hp
        out.append((f"2D {hp}x{cp} head_first", Candidate.of(hp=hp, cp=cp, placement="head_first")))
        out.append((f"2D {hp}x{cp} context_first", Candidate.of(hp=hp, cp=cp, placement="context_first")))
    if world % 2 == 0 and world >= 4:
        half = world // 2
        out.append((f"dp=2 x ring cp={half}", Candidate.of(dp=2, cp=half)))
        if head_degree_ok(m, half):
            out.append((f"dp=2 x ulysses hp={half}", Candidate.of(dp=2, hp=half)))
    return out


def predict(
    c: ClusterSpec, candidate: Candidate, seq: int, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int
) -> tuple[float, float]:
    """Predicted (forward, backward) seconds of one attention call of ``candidate``."""
    model = ModelConfig(vocab_size=8, dim=heads * head_dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads)
    w = Workload(model, seq, batch=candidate.parallel.dp, dtype_bytes=dtype_bytes)
    topo = candidate_topology(c, candidate)
    t = attention_seconds(c, w, candidate, topo)
    return t.fwd, t.bwd


def probe_seconds(c: ClusterSpec, heads: int, head_dim: int, tokens: int = PROBE_TOKENS) -> tuple[float, float]:
    """Predicted (forward, backward) seconds of the probe: one non-causal half block of a
    context rank holding ``tokens`` tokens (calibration's ``KV_FIRST_HALF`` step)."""
    model = ModelConfig(vocab_size=8, dim=heads * head_dim, n_layers=1, n_heads=heads, n_kv_heads=heads)
    bt = block_seconds(c, Workload(model, 2 * tokens, dtype_bytes=4), 1, 2)
    return bt.kernel_fwd, bt.kernel_bwd


def rescaled(c: ClusterSpec, measured: tuple[float, float], predicted: tuple[float, float]) -> ClusterSpec:
    """``c`` with its attention kernels (rates and per-call overheads) slowed by measured /
    predicted probe time, forward and backward separately."""
    slow_fwd, slow_bwd = measured[0] / predicted[0], measured[1] / predicted[1]
    bwd_overhead = c.bwd_overhead_us
    return replace(
        c,
        attn_fwd_tflops=c.attn_fwd_tflops / slow_fwd,
        attn_bwd_tflops=c.attn_bwd_tflops / slow_bwd,
        kernel_overhead_us=c.kernel_overhead_us * slow_fwd,
        kernel_bwd_overhead_us=bwd_overhead * slow_bwd,
    )


def summarize(rows: list[dict]) -> dict:
    """Median absolute error of fwd+bwd and whether the predicted fastest is among the measured best two."""

    def total(row, kind):
        return row[f"{kind}_fwd_s"] + row[f"{kind}_bwd_s"]

    median = statistics.median(abs(r["error"]) for r in rows)
    predicted_fastest = min(rows, key=lambda r: total(r, "predicted"))["layout"]
    best_two = [r["layout"] for r in sorted(rows, key=lambda r: total(r, "measured"))[:2]]
    return {
        "median_abs_error": median,
        "median_ok": median <= MEDIAN_ERROR_TARGET,
        "predicted_fastest": predicted_fastest,
        "measured_best_two": best_two,
        "fastest_ok": predicted_fastest in best_two,
    }
