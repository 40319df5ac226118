"""What a layout per microbatch would gain on a cluster, for a mix of document lengths:
``loongtrain plan ... --documents FILE|lognormal:median=1024,sigma=1.5``.

The documents (a token file's, or a synthetic mix) are cut into packed sequences of the
plan's length as the loader cuts them (a document longer than a sequence continues in the
next one), ``dp`` replicas taking turns. Each sequence's attention is priced per layer with
the per-batch chooser's own model (:func:`~loongtrain.attention.choose.layout_cost`) at the
cluster's speeds for each layout's rank placement:

- ``fixed``: the plan's layout and its balance, for every sequence (today's run);
- ``locality``: the same split with the ``locality`` balance (the placement alone);
- ``per_batch``: the cheapest split of the same sp group per sequence, under the plan's
  balance or ``locality`` (what ``parallel.layout = "per_batch"`` chooses among).

The rest of a microbatch (linear layers, loss, exposed ZeRO: the planner's
:func:`~loongtrain.planner.estimate.estimate` less its own attention terms) does not depend
on the documents and is added to each. A step takes as long as its slowest replica (the
gradient reduction waits for it). Here, on the planner's measuring side, because it runs the
attention's layout code (torch); the planner itself stays pure.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from loongtrain.attention.choose import FLOPS_PER_PAIR, AttentionShape, LinkSpeeds, candidate_configs, layout_cost
from loongtrain.data.tokens import TokenFile, TokenFileError
from loongtrain.options import checkpointed_count
from loongtrain.planner.cost import Candidate, Workload, candidate_topology
from loongtrain.planner.estimate import estimate
from loongtrain.planner.specs import ClusterSpec, PlanError

__all__ = ["PerBatchPrediction", "document_lengths", "packed_sequences", "predict_per_batch"]

_MIX = re.compile(r"^lognormal(?::(.*))?$")


def document_lengths(spec: str, tokens: int, seed: int = 0) -> tuple[np.ndarray, str]:
    """Document lengths for at least ``tokens`` tokens and a description: ``spec`` is a token
    file (its documents, repeated in order until ``tokens``) or
    ``lognormal[:median=M,sigma=S,max=L]`` (seeded draws; defaults 1024, 1.5, no cap)."""
    m = _MIX.match(spec)
    if m is None:
        path = Path(spec)
        if not path.is_file():
            raise PlanError(
                f"--documents {spec!r} is neither a token file nor a mix; use a file from `loongtrain prepare` "
                f"or lognormal:median=1024,sigma=1.5"
            )
        try:
            file = TokenFile(path)
            starts = file.document_starts()
        except TokenFileError as exc:
            raise PlanError(f"--documents: {exc}") from None
        lengths = np.diff(np.append(starts, file.count))
        lengths = lengths[lengths > 0]
        if not len(lengths):
            raise PlanError(f"--documents {spec}: the file holds no documents")
        reps = math.ceil(tokens / lengths.sum())
        about = f"{path.name}: {len(lengths):,} documents, median {int(np.median(lengths)):,} tokens"
        return np.tile(lengths, reps), about
    params = {"median": 1024.0, "sigma": 1.5, "max": 0.0}
    for part in filter(None, (m.group(1) or "").split(",")):
        key, _, value = part.partition("=")
        if key not in params:
            raise PlanError(f"--documents {spec!r}: unknown key {key!r}; use median=, sigma=, max=")
        try:
            params[key] = float(value)
        except ValueError:
            raise PlanError(f"--documents {spec!r}: {key}={value!r} is not a number") from None
    if params["median"] < 1 or params["sigma"] < 0 or params["max"] < 0:
        raise PlanError(f"--documents {spec!r}: median must be >= 1, sigma and max >= 0")
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    total = 0
    while total < tokens:
        draw = np.maximum(1, rng.lognormal(math.log(params["median"]), params["sigma"], 4096).astype(np.int64))
        if params["max"]:
            draw = np.minimum(draw, int(params["max"]))
        lengths.extend(draw.tolist())
        total += int(draw.sum())
    about = f"lognormal mix: median {params['median']:,.0f}, sigma {params['sigma']}"
    if params["max"]:
        about += f", at most {params['max']:,.0f}"
    return np.asarray(lengths), about


def packed_sequences(lengths: np.ndarray, seq_len: int, count: int) -> list[tuple[int, ...]]:
    """The first ``count`` sequences of ``seq_len`` tokens cut from the documents' stream, each
    as its document boundaries ``(0, ..., seq_len)`` (a document split at a sequence's end
    continues at the next one's start)."""
    ends = np.cumsum(lengths)
    if ends[-1] < seq_len * count:
        raise PlanError(f"{ends[-1]:,} tokens of documents make fewer than {count} sequences of {seq_len:,}")
    out = []
    for i in range(count):
        lo, hi = i * seq_len, (i + 1) * seq_len
        inner = ends[(ends > lo) & (ends < hi)] - lo
        out.append((0, *inner.tolist(), seq_len))
    return out


@dataclass(frozen=True)
class LayoutTotals:
    """One way of running the sampled steps: mean seconds per step, a replica's attention seconds per step,
    the MiB one device sends per step on the ring and in all-to-alls, and the layouts used."""

    step_s: float
    attention_s: float
    ring_mib: float
    all_to_all_mib: float
    layouts: dict[str, int]


@dataclass(frozen=True)
class PerBatchPrediction:
    documents: str
    sequences: int
    steps: int
    rest_s: float  # per microbatch, outside the attention
    one_document_attention_s: float  # chooser's model, one sequence-long document, fixed layout (per microbatch)
    planner_attention_s: float  # the planner's own for the same (per microbatch)
    fixed: LayoutTotals
    locality: LayoutTotals
    per_batch: LayoutTotals

    @property
    def gain(self) -> float:
        return self.fixed.step_s / self.per_batch.step_s


def cluster_speeds(c: ClusterSpec, candidate: Candidate) -> LinkSpeeds:
    """The chooser's :class:`LinkSpeeds` for ``candidate`` on ``c``: the attention kernels'
    achieved rate (forward and backward at their own), the slower ring family's hop
    bandwidth (a hop off the node shares its NIC), the head group's all-to-all bandwidth."""
    topo = candidate_topology(c, candidate)
    flops = FLOPS_PER_PAIR / (4 / (c.attn_fwd_tflops * 1e12) + 10 / (c.attn_bwd_tflops * 1e12))

    def ring_bw(ring) -> float:
        if ring.crosses:
            return c.nic_bw_gbs * 1e9 / max(1, ring.per_nic)
        return min(c.intra_bw_gbs, c.intra_node_bw_gbs / max(1, ring.on_node)) * 1e9

    rings = [r for r in (topo.inner, topo.outer) if r.size > 1]
    ring = min((ring_bw(r) for r in rings), default=c.intra_bw_gbs * 1e9)
    a2a = c.a2a_bw_gbs * 1e9
    if topo.head.off_peers:
        a2a = min(a2a, c.nic_bw_gbs * 1e9 * c.nics_per_node / max(1, topo.head.ranks_off))
    return LinkSpeeds(flops=flops, ring_bytes_per_s=ring, all_to_all_bytes_per_s=a2a)


def predict_per_batch(
    c: ClusterSpec, w: Workload, candidate: Candidate, lengths: np.ndarray, about: str, steps: int = 8
) -> PerBatchPrediction:
    """Price ``steps`` optimizer steps of ``w`` (its ``batch`` sequences each, cut from
    ``lengths``) on ``candidate``'s fixed layout, with the locality balance, and with a layout
    per microbatch (see the module docstring)."""
    if w.micro_batch != 1:
        raise PlanError("--documents packs one sequence per microbatch; use --micro-batch 1")
    p, m = candidate.parallel, w.model
    est = estimate(c, w, candidate)
    at, n_layers = est.attention, m.n_layers
    full = candidate.memory.activation_checkpoint == "full"
    n_ckpt = checkpointed_count(candidate.memory, n_layers) if full else 0
    micro = est.step_s / est.microbatches
    attention_model = n_layers * (at.fwd + at.bwd) + n_ckpt * at.fwd
    rest = micro - attention_model
    redo = 1 + (n_ckpt / n_layers) / 3.5  # full checkpointing re-runs the forward (1 of its 3.5 parts)
    shape = AttentionShape(m.n_heads, m.n_kv_heads, m.head_dim, w.dtype_bytes)
    window = m.sliding_window or None
    local_cfg = replace(p, balance="locality")
    choices = candidate_configs(p, m.n_heads, m.n_kv_heads, ("locality",))  # holds p and local_cfg
    speeds = {cfg: cluster_speeds(c, replace(candidate, parallel=cfg)) for cfg in choices}
    count = w.batch * steps
    sequences = packed_sequences(lengths, w.seq_len, count)

    def cost(cfg, bounds):
        return layout_cost(cfg, w.seq_len, bounds, window, shape, speeds[cfg])

    def label(cfg) -> str:
        return f"{cfg.hp}x{cfg.cp}" + ("" if cfg.balance == p.balance else f" {cfg.balance}")

    runs: dict[str, list] = {"fixed": [], "locality": [], "per_batch": []}
    for bounds in sequences:
        priced = [(cfg, cost(cfg, bounds)) for cfg in choices]  # choices[0] is the fixed layout
        runs["fixed"].append(priced[0])
        runs["locality"].append(next(x for x in priced if x[0] == local_cfg))
        runs["per_batch"].append(min(priced, key=lambda x: x[1].seconds))  # ties: the first (the run's own)

    def totals(run: list) -> LayoutTotals:
        step_times, attention = [], 0.0
        for s in range(steps):
            part = run[s * w.batch : (s + 1) * w.batch]
            per_replica = [0.0] * p.dp
            for i, (_, lc) in enumerate(part):
                per_replica[i % p.dp] += rest + n_layers * redo * lc.seconds
                attention += n_layers * redo * lc.seconds / (steps * p.dp)  # per replica and step
            step_times.append(max(per_replica))
        per_device = count / p.dp / steps  # microbatches one device runs per step
        ring = sum(lc.ring_bytes for _, lc in run) / count * n_layers * per_device / 2**20
        a2a = sum(lc.all_to_all_bytes for _, lc in run) / count * n_layers * per_device / 2**20
        used = Counter(label(cfg) for cfg, _ in run)
        return LayoutTotals(sum(step_times) / steps, attention, ring, a2a, dict(used))

    one_doc = cost(p, (0, w.seq_len)).seconds * n_layers * redo
    return PerBatchPrediction(
        documents=about, sequences=count, steps=steps, rest_s=rest, one_document_attention_s=one_doc,
        planner_attention_s=attention_model, fixed=totals(runs["fixed"]), locality=totals(runs["locality"]),
        per_batch=totals(runs["per_batch"]),
    )  # fmt: skip


def per_batch_text(pred: PerBatchPrediction, candidate: Candidate, cluster: str) -> str:
    """The prediction as a few lines for ``loongtrain plan``."""
    lines = [
        f"per-batch layouts on '{cluster}' for {candidate.label()}: {pred.documents}; "
        f"{pred.sequences} sequences ({pred.steps} steps)",
        f"  attention of a one-document sequence per microbatch: {pred.one_document_attention_s:.3f} s by the "
        f"chooser's model, {pred.planner_attention_s:.3f} s by the planner's; the rest of a microbatch "
        f"{pred.rest_s:.3f} s",
        f"  {'':10s} {'step s':>8s} {'attn s':>8s} {'ring MiB':>10s} {'a2a MiB':>10s}  layouts (hp x cp: microbatches)",
    ]
    for name, t in (("fixed", pred.fixed), ("locality", pred.locality), ("per_batch", pred.per_batch)):
        used = ", ".join(f"{k}: {v}" for k, v in sorted(t.layouts.items()))
        lines.append(
            f"  {name:10s} {t.step_s:8.3f} {t.attention_s:8.3f} {t.ring_mib:10.1f} {t.all_to_all_mib:10.1f}  {used}"
        )
    lines.append(
        f"  predicted gain of per-batch layouts: {pred.gain:.2f}x step time "
        f"(locality alone {pred.fixed.step_s / pred.locality.step_s:.2f}x)"
    )
    return "\n".join(lines)
