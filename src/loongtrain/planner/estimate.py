"""Step time, throughput, MFU and memory of one layout: the cost formulas put together. Pure.

Per micro-batch and rank: every layer runs its matmuls (forward, backward = 2x), the
head all-to-alls (not overlapped: attention waits for them) and the double ring
(transfers overlapped with block kernels as :func:`cost.ring_forward_seconds` says);
checkpointing adds a forward of the matmuls (``sc++``) or of the whole layer with its
attention communication (``full``). ZeRO collectives overlap neighbouring layers.
Elementwise work (norms, RoPE, SwiGLU activation, loss) and the optimizer step are not
counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from loongtrain.planner.cost import (
    AttentionTimes,
    Candidate,
    Workload,
    attention_seconds,
    candidate_topology,
    head_flops_fwd,
    linear_flops_fwd,
    model_flops_per_microbatch,
)
from loongtrain.planner.memory import MemoryBreakdown, memory_bytes
from loongtrain.planner.specs import ClusterSpec
from loongtrain.planner.topology import Topology
from loongtrain.planner.zero import exposed_zero_seconds, zero_seconds


@dataclass(frozen=True)
class Estimate:
    """Predicted cost of one candidate layout for one optimizer step (seconds per step)."""

    candidate: Candidate
    step_s: float
    compute_s: float  # kernels: matmuls, attention ring steps (with their merges), recompute
    a2a_s: float  # head all-to-alls (all exposed)
    ring_s: float  # ring transfers not hidden behind block kernels
    zero_s: float  # ZeRO collectives not hidden behind layers
    memory: MemoryBreakdown
    memory_limit: float
    tokens_per_s_per_device: float
    mfu: float
    attention: AttentionTimes  # one layer, one micro-batch
    topology: Topology
    microbatches: int

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.memory_limit


def estimate(c: ClusterSpec, w: Workload, layout: Candidate) -> Estimate:
    """Predict ``layout`` on cluster ``c`` for workload ``w``."""
    topo = candidate_topology(c, layout)
    at = attention_seconds(c, w, layout, topo)
    mm = c.matmul_tflops * 1e12
    lin = linear_flops_fwd(w, layout.sp) / mm
    head = head_flops_fwd(w, layout.sp) / mm
    n_layers = w.model.n_layers
    full, sc = layout.checkpoint == "full", layout.checkpoint == "sc++"
    recompute_kernels = lin + (at.kernels_fwd if full else 0.0) if (full or sc) else 0.0
    compute = n_layers * (3 * lin + at.kernels_fwd + at.kernels_bwd + recompute_kernels) + 3 * head
    a2a = n_layers * (at.a2a_fwd + at.a2a_bwd + (at.a2a_fwd if full else 0.0))
    ring_fwd = at.ring_fwd - at.kernels_fwd
    ring = n_layers * (ring_fwd + (at.ring_bwd - at.kernels_bwd) + (ring_fwd if full else 0.0))
    layer_fwd = lin + at.fwd
    layer_bwd = 2 * lin + at.bwd + (lin + at.fwd if full else lin if sc else 0.0)
    zero = exposed_zero_seconds(zero_seconds(c, w.model, layout, w.dtype_bytes), n_layers, layer_fwd, layer_bwd)
    micro = compute + a2a + ring + zero
    steps = w.batch // (layout.dp * w.micro_batch)
    step = steps * micro
    tokens = w.tokens
    mfu = steps * model_flops_per_microbatch(w, layout) / (step * c.peak_tflops * 1e12)
    return Estimate(
        candidate=layout,
        step_s=step,
        compute_s=steps * compute,
        a2a_s=steps * a2a,
        ring_s=steps * ring,
        zero_s=steps * zero,
        memory=memory_bytes(w, layout),
        memory_limit=c.usable_memory_bytes,
        tokens_per_s_per_device=tokens / (step * layout.devices),
        mfu=mfu,
        attention=at,
        topology=topo,
        microbatches=steps,
    )
