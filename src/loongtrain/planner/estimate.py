"""Step time, throughput, MFU and memory of one layout: the cost formulas put together. Pure.

Per micro-batch and rank: every layer runs its matmuls (forward, backward = 2x), the
head all-to-alls (not overlapped: attention waits for them) and the double ring
(transfers overlapped with block kernels as :func:`cost.ring_forward_seconds` says);
checkpointing adds a forward of the matmuls (``sc++``) or of the whole layer with its
attention communication (``full``); a tiled MLP adds one more MLP forward per layer. ZeRO
collectives overlap neighbouring layers. The loss costs the output layer's FLOPs three
times whether it is chunked or not (a chunked loss makes its gradients in the forward).
Offload: a layer's host transfers (activations out in forward and back in backward;
with offloaded states its parameters in and gradients out) overlap that layer's compute
(activations coming back: its q/k/v projections' backward only) and only the excess is
exposed; the CPU optimizer step (offloaded states) is exposed.
Elementwise work (norms, RoPE, SwiGLU activation, casts) and launches cost the cluster's
``layer_token_ns`` per token and layer forward (2x in backward, 1x per recompute), fitted from
measured steps (0 in the datasheet presets: not counted); the device optimizer step is not.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from loongtrain.options import checkpointed_count
from loongtrain.parallel.config import ParallelConfig
from loongtrain.planner.cost import (
    AttentionTimes,
    Candidate,
    Workload,
    candidate_topology,
    head_flops_fwd,
    layer_attention_seconds,
    linear_flops_fwd,
    mlp_flops_fwd,
    model_flops_per_microbatch,
)
from loongtrain.planner.float8 import cast_seconds
from loongtrain.planner.memory import MemoryBreakdown, layer_bytes, memory_bytes
from loongtrain.planner.specs import ClusterSpec
from loongtrain.planner.topology import Topology
from loongtrain.planner.zero import ZeroTimes, exposed_zero_seconds, shard_degree, zero_seconds

#: bytes of host memory one AdamW step moves per parameter on the CPU (offloaded states):
#: torch.optim.AdamW's foreach path reads and writes the fp32 parameter, gradient and both
#: moments in about nine passes (lerp, mul, addcmul, sqrt, div, add, addcdiv, weight decay)
CPU_ADAMW_BYTES_PER_PARAM = 80.0


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
    offload_s: float = 0.0  # host transfers not hidden behind layers, and the CPU optimizer step
    host_per_node: float = 0.0  # pinned host bytes of one node (offloaded activations and states)
    host_limit: float = 0.0  # the cluster's host memory per node usable for offload
    blocked: str | None = None  # why the layout cannot run on this cluster at all (offload without a host)

    @property
    def fits(self) -> bool:
        return self.blocked is None and self.memory.total <= self.memory_limit and self.host_per_node <= self.host_limit


@functools.lru_cache(maxsize=8192)
def _layout_times(
    c: ClusterSpec, w: Workload, parallel: ParallelConfig, zero: str
) -> tuple[Topology, AttentionTimes, ZeroTimes]:
    """What does not depend on the memory options: shared by every option of one layout."""
    layout = Candidate(parallel, zero)
    topo = candidate_topology(c, layout)
    zero_times = zero_seconds(c, w.model, layout, w.dtype_bytes, w.float8_all_gather)
    return topo, layer_attention_seconds(c, w, layout, topo), zero_times


def estimate(c: ClusterSpec, w: Workload, layout: Candidate) -> Estimate:
    """Predict ``layout`` on cluster ``c`` for workload ``w``."""
    p, mem = layout.parallel, layout.memory
    topo, at, z = _layout_times(c, w, p, layout.zero)
    m, mm = w.model, c.matmul_tflops * 1e12
    lin = linear_flops_fwd(w, p.sp) / mm
    head = head_flops_fwd(w, p.sp) / mm
    # float8 (planner/float8.py): the blocks' matmuls at the FP8 rate, plus their casts; lin_bwd
    # is backward's two products (the weight gradient's in bf16 for rowwise_with_gw_hp)
    lin_bwd = 2 * lin
    if w.float8 and c.fp8_matmul_tflops > 0:
        fp8 = linear_flops_fwd(w, p.sp) / (c.fp8_matmul_tflops * 1e12)
        cast_fwd, cast_bwd = cast_seconds(m, w.micro_batch * w.seq_len / p.sp, w.float8, c.hbm_bw_gbs)
        lin_bwd = fp8 + (lin if w.float8 == "rowwise_with_gw_hp" else fp8) + cast_bwd
        lin = fp8 + cast_fwd
    tile = mlp_flops_fwd(w, p.sp) / mm if mem.mlp_tile else 0.0
    n_layers = m.n_layers
    ckpt = mem.activation_checkpoint
    n_ckpt = checkpointed_count(mem, n_layers)
    full = ckpt == "full"
    # a checkpointed layer's forwards in backward: its own recompute, and with spans its span's too
    passes = 2 if mem.activation_checkpoint_span > 1 else 1
    recompute = passes * (lin + (at.kernels_fwd if full else 0.0)) if n_ckpt else 0.0  # per checkpointed layer
    qkv_fwd = lin * m.qkv_params() / m.layer_matmul_params()
    ring_fwd = at.ring_fwd - at.kernels_fwd
    # head groups (model/head_groups.py): backward recomputes each group's q/k/v projections and,
    # with hp > 1, runs the head all-to-alls of q/k/v and of the output again; under full
    # checkpointing no output is kept, and backward runs each group's attention forward again
    grouped = mem.head_groups > 1
    again = grouped and full
    regroup = (qkv_fwd + (at.kernels_fwd if again else 0.0)) if grouped else 0.0
    # elementwise work and launches (calibrated): 3 passes a layer, one more per recompute
    other = c.layer_token_ns * 1e-9 * w.micro_batch * w.seq_len / p.sp
    recompute += passes * other if n_ckpt else 0.0
    compute = n_layers * (lin + lin_bwd + 3 * other + at.kernels_fwd + at.kernels_bwd + tile + regroup)
    compute += n_ckpt * recompute + 3 * head
    a2a = n_layers * (at.a2a_fwd + at.a2a_bwd) + (n_ckpt * at.a2a_fwd * passes if full else 0.0)
    a2a += n_layers * at.a2a_fwd * (2 if again else 1) if grouped else 0.0
    ring = n_layers * (ring_fwd + (at.ring_bwd - at.kernels_bwd))
    ring += n_ckpt * ring_fwd * passes if full else 0.0
    ring += n_layers * ring_fwd if again else 0.0
    layer_fwd = lin + other + at.fwd
    layer_bwd = lin_bwd + 2 * other + at.bwd + tile + regroup
    if grouped:  # the all-to-alls run again and, not kept, the ring's forward
        layer_bwd += at.a2a_fwd * (2 if again else 1) + (ring_fwd if again else 0.0)
    # a checkpointed layer's recompute, comms included
    redo = passes * (lin + other + (at.fwd if full else 0.0)) if n_ckpt else 0.0
    mean_bwd = layer_bwd + redo * n_ckpt / n_layers
    zero = exposed_zero_seconds(z, n_layers, layer_fwd, mean_bwd)
    # the previous layer's kept tensors come back behind this layer's q/k/v projections' backward
    # (over head groups that backward is inside the attention's: they come back when read)
    qkv_bwd = 2 * qkv_fwd if mem.head_groups == 1 else 0.0
    offload = _offload_seconds(c, w, layout, n_ckpt, layer_fwd, layer_bwd, layer_bwd + redo, qkv_bwd)
    micro = compute + a2a + ring + zero + offload
    steps = w.batch // (p.dp * w.micro_batch)
    cpu_step = _cpu_optimizer_seconds(c, layout, m.num_params()) if mem.offload_states else 0.0
    step = steps * micro + cpu_step
    mfu = steps * model_flops_per_microbatch(w, layout) / (step * c.peak_tflops * 1e12)
    breakdown = memory_bytes(w, layout)
    blocked = None
    if w.float8 and c.fp8_matmul_tflops <= 0:
        blocked = f"cluster {c.name!r} has no FP8 matmul units (fp8_matmul_tflops=0): float8 runs emulated, no faster"
    if w.float8 and (mem.mlp_tile or mem.head_groups > 1):  # options.check_float8_memory refuses them
        blocked = "the tiled MLP and head groups would bypass the float8 linears (the trainer refuses them)"
    if mem.offload_activations and n_ckpt:
        blocked = blocked or c.offload_gap("activations")
    if mem.offload_states:
        blocked = blocked or c.offload_gap("states")
    return Estimate(
        candidate=layout,
        step_s=step,
        compute_s=steps * compute,
        a2a_s=steps * a2a,
        ring_s=steps * ring,
        zero_s=steps * zero,
        memory=breakdown,
        memory_limit=c.usable_memory_bytes,
        tokens_per_s_per_device=w.tokens / (step * layout.devices),
        mfu=mfu,
        attention=at,
        topology=topo,
        microbatches=steps,
        offload_s=steps * offload + cpu_step,
        host_per_node=breakdown.host * min(layout.devices, c.devices_per_node),
        host_limit=c.host_memory_bytes,
        blocked=blocked,
    )


def _offload_seconds(
    c: ClusterSpec,
    w: Workload,
    layout: Candidate,
    n_ckpt: int,
    fwd: float,
    bwd: float,
    bwd_ckpt: float,
    fetch_window: float,
) -> float:
    """Host transfers of one micro-batch not hidden behind the layer they belong to.

    Per layer and direction the link carries ``bytes / host_copy_gbs``; only what exceeds
    that layer's compute is exposed. Forward sends the kept tensors out (offloaded
    activations) and brings the parameter shard in (offloaded states); backward brings
    both in again and sends the gradient shard out (the other direction). In backward the
    kept tensors start coming back after the attention's backward (``apply/offload.py``),
    so they hide behind ``fetch_window`` (the q/k/v projections' backward) alone.
    """
    mem, p = layout.memory, layout.parallel
    if not (mem.offload_states or (mem.offload_activations and n_ckpt)) or c.host_copy_gbs <= 0:
        return 0.0
    bw = c.host_copy_gbs * 1e9
    tokens = w.micro_batch * w.seq_len / p.sp
    kept = 0.0
    if mem.offload_activations and n_ckpt:
        lb = layer_bytes(w.model, p.hp, p.cp, w.dtype_bytes, mem.activation_checkpoint, mem.mlp_tile > 0)
        kept = lb.kept * tokens / mem.activation_checkpoint_span  # a span's input, over its layers
    params = 4.0 * w.model.layer_params() / shard_degree(layout) if mem.offload_states else 0.0
    plain = w.model.n_layers - n_ckpt
    fetch = max(0.0, kept / bw - fetch_window, (kept + params) / bw - bwd_ckpt)
    exposed = n_ckpt * (max(0.0, (kept + params) / bw - fwd) + fetch)
    exposed += plain * (max(0.0, params / bw - fwd) + max(0.0, params / bw - bwd))
    return exposed


def _cpu_optimizer_seconds(c: ClusterSpec, layout: Candidate, params: int) -> float:
    """AdamW over this rank's parameter shard on the CPU: memory-bound, the node's host
    memory bandwidth shared by the ranks of the node."""
    if c.host_mem_bw_gbs <= 0:
        return 0.0
    ranks = min(layout.devices, c.devices_per_node)
    return params / shard_degree(layout) * CPU_ADAMW_BYTES_PER_PARAM / (c.host_mem_bw_gbs * 1e9 / ranks)
