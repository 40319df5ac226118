"""Pure cost formulas of one transformer layer under a 2D head-context layout.

FLOPs count multiply-adds as 2. Attention FLOPs of one ring step: with the zigzag split
every step of a causal ring is half of a (S/cp x S/cp) block (the first one a causal
diagonal block, the others exactly half a block), so every step does
``2 * B * (S/cp)^2 * (H/hp) * d`` forward FLOPs; non-causal steps do twice that.
Backward kernels do 2.5x the forward FLOPs (FlashAttention recomputes the scores).

Bytes are what one rank sends per attention call, in the units ``AttentionStats``
counts (the packed all-to-all buffer, own chunk included; one ring block per hop).
"""

from __future__ import annotations

from dataclasses import dataclass

from loongtrain.model.config import ModelConfig
from loongtrain.parallel.config import ParallelConfig
from loongtrain.planner.specs import ClusterSpec
from loongtrain.planner.topology import HeadTraffic, RingTraffic, Topology

BWD_FLOP_RATIO = 2.5


@dataclass(frozen=True)
class Layout:
    """One candidate: the parallel degrees and placement plus the memory options."""

    dp: int
    hp: int
    cp: int
    window: int = 1
    placement: str = "head_first"
    zero: str = "dp_sp"
    checkpoint: str = "full"

    @property
    def sp(self) -> int:
        return self.hp * self.cp

    @property
    def devices(self) -> int:
        return self.dp * self.sp

    @property
    def n_windows(self) -> int:
        return self.cp // self.window

    def parallel_config(self) -> ParallelConfig:
        """The :class:`ParallelConfig` that ``init_parallel`` takes for this layout."""
        return ParallelConfig(hp=self.hp, cp=self.cp, window=self.window, placement=self.placement, dp=self.dp)

    def label(self) -> str:
        ring = "-" if self.cp == 1 else (f"w{self.window}" if 1 < self.window < self.cp else "ring")
        return f"dp{self.dp} hp{self.hp} cp{self.cp} {ring} {self.placement} zero={self.zero} ckpt={self.checkpoint}"


@dataclass(frozen=True)
class Workload:
    """What one optimizer step processes: ``batch`` sequences of ``seq_len`` tokens in
    total (each replica runs ``batch / dp`` of them, ``micro_batch`` at a time)."""

    model: ModelConfig
    seq_len: int
    batch: int = 1
    micro_batch: int = 1
    dtype_bytes: int = 2  # activations and communication (bf16)
    causal: bool = True

    @property
    def accum_bytes(self) -> int:
        """Bytes of the gradient-accumulation dtype (fp32, or fp64 for fp64 inputs)."""
        return max(4, self.dtype_bytes)


# -- FLOPs ------------------------------------------------------------------------------
def linear_params_per_layer(m: ModelConfig) -> int:
    """Weights of one layer's matmuls (q, k, v, o projections and the SwiGLU MLP)."""
    d, hd = m.dim, m.head_dim
    return d * m.n_heads * hd + 2 * d * m.n_kv_heads * hd + m.n_heads * hd * d + 3 * d * m.ffn_dim


def params_per_layer(m: ModelConfig) -> int:
    """All parameters of one layer (matmuls and the two norms)."""
    return linear_params_per_layer(m) + 2 * m.dim


def ring_step_flops(w: Workload, hp: int, cp: int) -> float:
    """Forward FLOPs of one ring step (one block kernel) on one rank."""
    m = w.model
    full_block = 4.0 * w.micro_batch * (w.seq_len / cp) ** 2 * (m.n_heads / hp) * m.head_dim
    return full_block / 2 if w.causal else full_block


def attention_flops_fwd(w: Workload, hp: int, cp: int) -> float:
    """Forward attention FLOPs of one layer on one rank (``cp`` ring steps)."""
    return cp * ring_step_flops(w, hp, cp)


def linear_flops_fwd(w: Workload, sp: int) -> float:
    """Forward FLOPs of one layer's matmuls on one rank (``S/sp`` tokens)."""
    return 2.0 * w.micro_batch * (w.seq_len / sp) * linear_params_per_layer(w.model)


def head_flops_fwd(w: Workload, sp: int) -> float:
    """Forward FLOPs of the output layer on one rank."""
    return 2.0 * w.micro_batch * (w.seq_len / sp) * w.model.dim * w.model.vocab_size


def model_flops_per_microbatch(w: Workload, layout: Layout) -> float:
    """Model FLOPs (forward + backward = 3x forward, no recompute) of one rank per micro-batch."""
    per_layer = linear_flops_fwd(w, layout.sp) + attention_flops_fwd(w, layout.hp, layout.cp)
    return 3.0 * (w.model.n_layers * per_layer + head_flops_fwd(w, layout.sp))


# -- communication volumes --------------------------------------------------------------
def replicated_kv_heads(m: ModelConfig, hp: int) -> int:
    """KV heads after the head all-to-all's replication: ``max(G, hp)``."""
    return max(m.n_kv_heads, hp)


@dataclass(frozen=True)
class CommVolume:
    """Transfers one rank starts per attention call: ``{stats kind: (count, bytes)}``."""

    kinds: dict[str, tuple[int, int]]

    def count(self, kind: str) -> int:
        return self.kinds.get(kind, (0, 0))[0]

    def bytes(self, kind: str) -> int:
        return self.kinds.get(kind, (0, 0))[1]


def dkv_hops(cp: int, window: int) -> int:
    """dK/dV ring transfers per rank in backward: ``cp`` for a plain ring, ``cp + cp/window`` otherwise."""
    n = cp // window
    return (cp if window > 1 else 0) + (n if n > 1 else 0)


def comm_volume(w: Workload, hp: int, cp: int, window: int) -> CommVolume:
    """Per-rank transfers of one attention forward and backward (matches ``state.stats``)."""
    m = w.model
    e, hd, b = w.dtype_bytes, m.head_dim, w.micro_batch
    gr = replicated_kv_heads(m, hp)
    local = b * w.seq_len // (hp * cp)  # tokens of one rank before the all-to-all
    kinds: dict[str, tuple[int, int]] = {}
    if hp > 1:
        q_or_out = local * m.n_heads * hd * e
        kv = 2 * local * gr * hd * e
        kinds["fwd.all_to_all"] = (3, 2 * q_or_out + kv)  # q, kv; out
        kinds["bwd.all_to_all"] = (3, 2 * q_or_out + kv)  # dout; dq, dkv
    if cp > 1:
        block = 2 * b * (w.seq_len // cp) * (gr // hp) * hd
        kinds["fwd.ring_kv"] = (cp - 1, (cp - 1) * block * e)
        kinds["bwd.ring_kv"] = (cp - 1, (cp - 1) * block * e)
        hops = dkv_hops(cp, window)
        kinds["bwd.ring_dkv"] = (hops, hops * block * w.accum_bytes)
    return CommVolume(kinds)


def kv_block_bytes(w: Workload, hp: int, cp: int, dtype_bytes: int | None = None) -> float:
    """Bytes of one ring block (stacked K and V of one context rank) in ``dtype_bytes``."""
    gr = replicated_kv_heads(w.model, hp)
    e = w.dtype_bytes if dtype_bytes is None else dtype_bytes
    return 2.0 * w.micro_batch * (w.seq_len / cp) * (gr / hp) * w.model.head_dim * e


# -- link times -------------------------------------------------------------------------
def transfer_seconds(nbytes: float, latency_us: float, bw_gbs: float) -> float:
    """Alpha-beta time of one transfer."""
    return latency_us * 1e-6 + nbytes / (bw_gbs * 1e9)


def ring_hop_seconds(c: ClusterSpec, ring: RingTraffic, concurrent: RingTraffic | None, nbytes: float) -> float:
    """One ring step's transfer of ``nbytes`` per rank; ``concurrent`` is the other ring
    of a double ring when its hops are in flight at the same time (they share links)."""
    if nbytes <= 0:
        return 0.0
    other_off = concurrent.off_node if concurrent is not None else 0
    other_on = concurrent.on_node if concurrent is not None else 0
    if ring.crosses:  # the slowest hop leaves the node: NIC speed, NICs shared
        flows = ring.off_node + other_off
        bw = min(c.nic_bw_gbs, c.nic_bw_gbs * c.nics_per_node / flows)
        return transfer_seconds(nbytes, c.inter_latency_us, bw)
    flows = max(1, ring.on_node + other_on)
    bw = min(c.intra_bw_gbs, c.intra_node_bw_gbs / flows)
    return transfer_seconds(nbytes, c.intra_latency_us, bw)


def all_to_all_seconds(c: ClusterSpec, head: HeadTraffic, nbytes: float) -> float:
    """All-to-all of a packed buffer of ``nbytes`` over the head group (every rank at once)."""
    hp = head.size
    if hp < 2 or nbytes <= 0:
        return 0.0
    chunk = nbytes / hp
    on = hp - 1 - head.off_peers
    t_on = on * chunk / (c.a2a_bw_gbs * 1e9)
    t_off = 0.0
    if head.off_peers:
        share = min(c.a2a_bw_gbs, c.nic_bw_gbs * c.nics_per_node / max(1, head.ranks_off))
        t_off = head.off_peers * chunk / (share * 1e9)
    latency = (c.inter_latency_us if head.off_peers else c.a2a_latency_us) * (hp - 1)
    return latency * 1e-6 + max(t_on, t_off)


# -- the ring schedule with overlap -----------------------------------------------------
def overlapped(compute: float, transfer: float, overlap: float) -> float:
    """Duration of ``compute`` with ``transfer`` in flight: ``max(transfer, compute + (1-overlap)*transfer)``."""
    if transfer <= 0:
        return compute
    return max(transfer, compute + (1.0 - overlap) * transfer)


def ring_forward_seconds(n: int, w: int, t_c: float, hop_in: float, hop_out: float, overlap: float = 1.0) -> float:
    """Double-ring forward: per outer step ``w`` block computes, each inner hop hidden behind
    one compute, the outer hop behind the whole outer step (as ``ring_forward`` runs)."""
    inner_part = (w - 1) * overlapped(t_c, hop_in, overlap) + t_c
    return (n - 1) * overlapped(inner_part, hop_out, overlap) + inner_part


def ring_backward_seconds(n: int, w: int, t_c: float, hop_in, hop_out, kv: float, dkv: float, overlap: float = 1.0):
    """Double-ring backward (as ``ring_backward`` runs); ``hop_in``/``hop_out`` map bytes to
    seconds, ``kv``/``dkv`` are the bytes of one block and of its fp32 gradient.

    During inner step ``s`` the next KV block and the previous step's dK/dV partial share
    the inner link; during outer step ``j`` the next KV block and the previous outer
    step's dK/dV total share the outer link; the last dK/dV hop(s) are exposed.
    """

    def inner_part(first_outer: bool) -> float:
        if w == 1:
            return t_c
        total = 0.0
        for s in (0, 1, w - 1) if w > 2 else (0, w - 1):
            nbytes = (kv if s + 1 < w else 0.0) + (dkv if (s > 0 or not first_outer) else 0.0)
            repeat = w - 2 if (s == 1 and w > 2) else 1
            total += repeat * overlapped(t_c, hop_in(nbytes), overlap)
        return total

    total = 0.0
    for j in sorted({0, min(1, n - 1), n - 1}):
        nbytes = (kv if j + 1 < n else 0.0) + (dkv if j > 0 else 0.0)
        repeat = n - 2 if (j == 1 and j != n - 1) else 1
        total += repeat * overlapped(inner_part(j == 0), hop_out(nbytes), overlap)
    tail = (hop_in(dkv) if w > 1 else 0.0) + (hop_out(dkv) if n > 1 else 0.0)
    return total + tail


@dataclass(frozen=True)
class AttentionTimes:
    """Seconds of one layer's attention on one rank, per micro-batch."""

    a2a_fwd: float
    a2a_bwd: float
    ring_fwd: float  # the whole ring loop (compute and exposed transfers)
    ring_bwd: float
    kernels_fwd: float  # block kernels alone
    kernels_bwd: float

    @property
    def fwd(self) -> float:
        return self.a2a_fwd + self.ring_fwd

    @property
    def bwd(self) -> float:
        return self.a2a_bwd + self.ring_bwd


@dataclass(frozen=True)
class BlockTimes:
    """One ring step's block kernel: ``fwd``/``bwd`` for the half blocks, ``*_first`` for
    the first step (the causal diagonal block; the same as the others when not causal)."""

    fwd: float
    bwd: float
    fwd_first: float
    bwd_first: float


def block_seconds(c: ClusterSpec, w: Workload, hp: int, cp: int) -> BlockTimes:
    """Forward and backward time of one ring step's block kernel."""
    flops = ring_step_flops(w, hp, cp)
    overhead = c.kernel_overhead_us * 1e-6
    fwd = flops / (c.attn_fwd_tflops * 1e12)
    bwd = BWD_FLOP_RATIO * flops / (c.attn_bwd_tflops * 1e12)
    # a causal diagonal block of S/cp tokens also computes the masked halves of its diagonal tiles
    first = 1.0 + c.causal_tile * cp / w.seq_len if w.causal else 1.0
    return BlockTimes(overhead + fwd, overhead + bwd, overhead + fwd * first, overhead + bwd * first)


def attention_seconds(c: ClusterSpec, w: Workload, layout: Layout, topo: Topology) -> AttentionTimes:
    """All-to-alls and the double ring of one layer, forward and backward."""
    hp, cp, win = layout.hp, layout.cp, layout.window
    n = cp // win
    bt = block_seconds(c, w, hp, cp)
    a2a_fwd = a2a_bwd = 0.0
    if hp > 1:  # the packed buffers whose bytes comm_volume counts
        m, e = w.model, w.dtype_bytes
        local = w.micro_batch * w.seq_len / layout.sp
        qkv = local * m.head_dim * e * (m.n_heads + 2 * replicated_kv_heads(m, hp))
        out = local * m.head_dim * e * m.n_heads
        a2a_fwd = all_to_all_seconds(c, topo.head, qkv) + all_to_all_seconds(c, topo.head, out)
        a2a_bwd = all_to_all_seconds(c, topo.head, out) + all_to_all_seconds(c, topo.head, qkv)
    if cp == 1:
        return AttentionTimes(a2a_fwd, a2a_bwd, bt.fwd_first, bt.bwd_first, bt.fwd_first, bt.bwd_first)
    both = topo.double_ring_concurrent
    inner_other = topo.outer if both else None
    outer_other = topo.inner if both else None

    def hop_in(nbytes: float) -> float:
        return ring_hop_seconds(c, topo.inner, inner_other, nbytes)

    def hop_out(nbytes: float) -> float:
        return ring_hop_seconds(c, topo.outer, outer_other, nbytes)

    kv = kv_block_bytes(w, hp, cp)
    dkv = kv_block_bytes(w, hp, cp, w.accum_bytes)
    ov = c.overlap
    ring_fwd = ring_forward_seconds(n, win, bt.fwd, hop_in(kv), hop_out(kv), ov)
    ring_bwd = ring_backward_seconds(n, win, bt.bwd, hop_in, hop_out, kv, dkv, ov)
    # the first step is the causal diagonal block; its transfer is one KV block
    first_hop = hop_in(kv) if win > 1 else hop_out(kv)
    ring_fwd += overlapped(bt.fwd_first, first_hop, ov) - overlapped(bt.fwd, first_hop, ov)
    ring_bwd += overlapped(bt.bwd_first, first_hop, ov) - overlapped(bt.bwd, first_hop, ov)
    kernels_fwd = (cp - 1) * bt.fwd + bt.fwd_first
    kernels_bwd = (cp - 1) * bt.bwd + bt.bwd_first
    return AttentionTimes(a2a_fwd, a2a_bwd, ring_fwd, ring_bwd, kernels_fwd, kernels_bwd)
