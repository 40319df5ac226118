"""Pure cost formulas of one transformer layer under a 2D head-context layout.

FLOPs count multiply-adds as 2. Attention FLOPs of one ring step: with the zigzag split
every step of a causal ring is half of a (S/cp x S/cp) block (the first one a causal
diagonal block, the others exactly half a block), so every step does
``2 * B * (S/cp)^2 * (H/hp) * d`` forward FLOPs; non-causal steps do twice that.
Backward kernels do 2.5x the forward FLOPs (FlashAttention recomputes the scores).
Model FLOPs (MFU) come from :meth:`ModelConfig.flops_per_token`, the trainer's definition.

Bytes are what one rank sends per attention call, in the units ``AttentionStats``
counts (the packed all-to-all buffer, own chunk included; one ring block per hop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from loongtrain.model.config import ModelConfig, causal_keys_per_query
from loongtrain.options import AUTO_CHECKPOINT, MemoryOptions
from loongtrain.parallel.config import ParallelConfig
from loongtrain.planner.specs import ClusterSpec, PlanError
from loongtrain.planner.topology import HeadTraffic, RingTraffic, Topology, analyze

BWD_FLOP_RATIO = 2.5


_PARALLEL_KEYS = ("hp", "cp", "ring_window", "placement", "dp")
_MEMORY_KEYS = tuple(f.name for f in fields(MemoryOptions))


@dataclass(frozen=True)
class Candidate:
    """One layout the planner prices: the library's own option holders, nothing re-declared.

    ``parallel`` holds the degrees, ring window and placement (``dp`` set: the planner
    always knows the device count); everything derived from them (``sp``,
    ``n_ring_windows``, the groups) comes from it. ``zero`` is the ZeRO scope of the model
    states and ``memory`` the :class:`MemoryOptions` (activation checkpointing, chunked
    loss, tiled MLP, offload) that ``parallelize`` takes.
    """

    parallel: ParallelConfig
    zero: str = "dp_sp"
    memory: MemoryOptions = MemoryOptions()

    def __post_init__(self) -> None:
        if not isinstance(self.parallel, ParallelConfig) or self.parallel.dp is None:
            raise PlanError(f"Candidate: parallel must be a ParallelConfig with dp set, got {self.parallel!r}")
        if not isinstance(self.memory, MemoryOptions):
            raise PlanError(f"Candidate: memory must be a MemoryOptions, got {self.memory!r}")
        if self.memory.activation_checkpoint == AUTO_CHECKPOINT:
            raise PlanError(
                "Candidate: activation_checkpoint='auto' is what the planner chooses "
                "(loongtrain.planner.choose_checkpoint_policy), not a layout to price; give full, sc++ or none"
            )

    @classmethod
    def of(cls, *, zero: str = "dp_sp", dp: int = 1, **options) -> Candidate:
        """A candidate from flat keyword options: ``hp``, ``cp``, ``ring_window``, ``placement``,
        ``dp`` go to :class:`ParallelConfig`, the :class:`MemoryOptions` fields to ``memory``."""
        unknown = sorted(set(options) - set(_PARALLEL_KEYS) - set(_MEMORY_KEYS))
        if unknown:
            raise PlanError(f"Candidate.of: unknown option(s) {unknown}")
        parallel = ParallelConfig(dp=dp, **{k: v for k, v in options.items() if k in _PARALLEL_KEYS})
        return cls(parallel, zero, MemoryOptions(**{k: v for k, v in options.items() if k in _MEMORY_KEYS}))

    def with_(self, **changes) -> Candidate:
        """A copy with flat options changed (routed to ``parallel``, ``memory`` or ``zero``)."""
        unknown = sorted(set(changes) - set(_PARALLEL_KEYS) - set(_MEMORY_KEYS) - {"zero"})
        if unknown:
            raise PlanError(f"Candidate.with_: unknown option(s) {unknown}")
        parallel = {k: v for k, v in changes.items() if k in _PARALLEL_KEYS}
        memory = {k: v for k, v in changes.items() if k in _MEMORY_KEYS}
        return Candidate(
            replace(self.parallel, **parallel) if parallel else self.parallel,
            changes.get("zero", self.zero),
            replace(self.memory, **memory) if memory else self.memory,
        )

    @property
    def devices(self) -> int:
        """Ranks of the layout: ``dp * hp * cp``."""
        return self.parallel.dp * self.parallel.sp

    @property
    def checkpoint(self) -> str:
        """The activation checkpoint mode (``memory.activation_checkpoint``)."""
        return self.memory.activation_checkpoint

    def options_label(self) -> str:
        """The memory options beyond checkpointing, short: ``"ch1024 tile8192 off:act+states"``
        (``logits``: the whole shard's loss at once)."""
        m = self.memory
        parts = [f"ch{m.loss_chunk}" if m.loss_chunk else "logits"]
        if m.mlp_tile:
            parts.append(f"tile{m.mlp_tile}")
        offload = [name for name, on in (("act", m.offload_activations), ("states", m.offload_states)) if on]
        if offload:
            parts.append("off:" + "+".join(offload))
        if m.activation_checkpoint_every > 1:
            parts.append(f"every{m.activation_checkpoint_every}")
        if m.activation_checkpoint_layers:
            parts.append(f"first{m.activation_checkpoint_layers}")
        if m.head_groups > 1:
            parts.append(f"heads/{m.head_groups}")
        if m.activation_checkpoint_span > 1:
            parts.append(f"span{m.activation_checkpoint_span}")
        return " ".join(parts)

    def label(self) -> str:
        p = self.parallel
        ring = "-" if p.cp == 1 else (f"w{p.ring_window}" if 1 < p.ring_window < p.cp else "ring")
        return (
            f"dp{p.dp} hp{p.hp} cp{p.cp} {ring} {p.placement} zero={self.zero} ckpt={self.checkpoint} "
            f"{self.options_label()}"
        )


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
    float8: str = ""  # the blocks' linears in float8 with this torchao recipe ("": the compute dtype)
    float8_all_gather: bool = False  # ZeRO gathers the blocks' weights as float8 (tensorwise)

    def __post_init__(self) -> None:
        from loongtrain.planner.float8 import check_float8_recipe

        try:
            check_float8_recipe(self.float8, self.float8_all_gather)
        except ValueError as exc:
            raise PlanError(str(exc)) from None

    @classmethod
    def from_tokens(
        cls, model: ModelConfig, seq_len: int, global_batch_tokens: int, micro_batch: int = 1, **float8
    ) -> Workload:
        """A step of ``global_batch_tokens`` tokens: ``global_batch_tokens / seq_len`` sequences
        (``float8``: the ``float8`` and ``float8_all_gather`` fields)."""
        if global_batch_tokens < seq_len:
            raise PlanError(
                f"global batch {global_batch_tokens} tokens is less than one sequence of {seq_len}; "
                f"use --global-batch {seq_len} or more"
            )
        if global_batch_tokens % seq_len != 0:
            raise PlanError(
                f"global batch {global_batch_tokens} tokens is not a whole number of {seq_len}-token sequences; "
                f"use a multiple of {seq_len} (e.g. {global_batch_tokens // seq_len * seq_len})"
            )
        return cls(model, seq_len, batch=global_batch_tokens // seq_len, micro_batch=micro_batch, **float8)

    @property
    def tokens(self) -> int:
        """Tokens per optimizer step (the global batch)."""
        return self.batch * self.seq_len

    @property
    def accum_bytes(self) -> int:
        """Bytes of the gradient-accumulation dtype (fp32, or fp64 for fp64 inputs)."""
        return max(4, self.dtype_bytes)


def candidate_topology(c: ClusterSpec, candidate: Candidate) -> Topology:
    """Where ``candidate``'s transfers go on ``c``'s nodes and NICs."""
    return analyze(candidate.parallel, c.devices_per_node, c.nics_per_node)


# -- FLOPs ------------------------------------------------------------------------------
def ring_step_flops(w: Workload, hp: int, cp: int) -> float:
    """Forward FLOPs of one ring step (one block kernel) on one rank."""
    m = w.model
    full_block = 4.0 * w.micro_batch * (w.seq_len / cp) ** 2 * (m.n_heads / hp) * m.head_dim
    return full_block / 2 if w.causal else full_block


def linear_flops_fwd(w: Workload, sp: int) -> float:
    """Forward FLOPs of one layer's matmuls on one rank (``S/sp`` tokens)."""
    return 2.0 * w.micro_batch * (w.seq_len / sp) * w.model.layer_matmul_params()


def mlp_flops_fwd(w: Workload, sp: int) -> float:
    """Forward FLOPs of one layer's SwiGLU MLP on one rank (what a tiled MLP recomputes)."""
    return 2.0 * w.micro_batch * (w.seq_len / sp) * 3 * w.model.dim * w.model.ffn_dim


def head_flops_fwd(w: Workload, sp: int) -> float:
    """Forward FLOPs of the output layer on one rank."""
    return 2.0 * w.micro_batch * (w.seq_len / sp) * w.model.dim * w.model.vocab_size


def model_flops_per_microbatch(w: Workload, candidate: Candidate) -> float:
    """Model FLOPs of one rank per micro-batch: its tokens x :meth:`ModelConfig.flops_per_token`."""
    tokens = w.micro_batch * w.seq_len / candidate.parallel.sp
    return tokens * w.model.flops_per_token(w.seq_len, causal=w.causal)


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


def dkv_hops(config: ParallelConfig) -> int:
    """dK/dV partials per rank in backward when every rank reads every block: one per remote
    reader, ``cp - 1`` (:mod:`loongtrain.attention.routes`)."""
    return config.cp - 1


def comm_volume(w: Workload, config: ParallelConfig) -> CommVolume:
    """Per-rank transfers of one attention forward and backward (matches ``state.stats``)."""
    m, hp, cp = w.model, config.hp, config.cp
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
        hops = dkv_hops(config)
        kinds["bwd.ring_dkv"] = (hops, hops * block * w.accum_bytes)
    return CommVolume(kinds)


def kv_block_bytes(w: Workload, hp: int, cp: int, dtype_bytes: int | None = None) -> float:
    """Bytes of one ring block (stacked K and V of one context rank) in ``dtype_bytes``."""
    gr = replicated_kv_heads(w.model, hp)
    e = w.dtype_bytes if dtype_bytes is None else dtype_bytes
    return 2.0 * w.micro_batch * (w.seq_len / cp) * (gr / hp) * w.model.head_dim * e


def head_all_to_all_bytes(w: Workload, sp: int, hp: int) -> tuple[float, float]:
    """Packed all-to-all buffers of one rank: ``(q + kv, out)`` bytes (KV heads replicated to ``max(G, hp)``)."""
    m = w.model
    local = w.micro_batch * w.seq_len / sp
    qkv = local * m.head_dim * w.dtype_bytes * (m.n_heads + 2 * replicated_kv_heads(m, hp))
    return qkv, local * m.head_dim * w.dtype_bytes * m.n_heads


# -- link times -------------------------------------------------------------------------
def transfer_seconds(nbytes: float, latency_us: float, bw_gbs: float) -> float:
    """Alpha-beta time of one transfer."""
    return latency_us * 1e-6 + nbytes / (bw_gbs * 1e9)


def ring_hop_seconds(c: ClusterSpec, ring: RingTraffic, nbytes: float) -> float:
    """One step of ``ring`` moving ``nbytes`` per rank, with only this ring's hops in flight.

    The step runs at the speed of its slowest hop: a hop that leaves its node goes through
    its rank's NIC, shared by the ``ring.per_nic`` hops that use that NIC at once; a hop
    inside the node runs at ``intra_bw_gbs``, capped by the node fabric shared by the
    ``ring.on_node`` hops inside it.
    """
    if nbytes <= 0:
        return 0.0
    if ring.crosses:
        return transfer_seconds(nbytes, c.inter_latency_us, c.nic_bw_gbs / max(1, ring.per_nic))
    bw = min(c.intra_bw_gbs, c.intra_node_bw_gbs / max(1, ring.on_node))
    return transfer_seconds(nbytes, c.intra_latency_us, bw)


def shared_outer_step_seconds(
    c: ClusterSpec, topo: Topology, t_c: float, inner_bytes: list[float], outer_bytes: float, overlap: float = 1.0
) -> float:
    """One outer step of a double ring whose two rings share links: ``inner_bytes[s]`` per
    rank leave on inner step ``s`` (each hop hidden behind one block of ``t_c``) while the
    outer transfer of ``outer_bytes`` per rank is in flight.

    This is how the double ring shares the hardware: the outer transfer crosses its NIC
    once per outer step, next to the inner hops of that step that use the same NIC. On
    each NIC both rings use (``topo.nic_loads``: ``i`` inner and ``o`` outer hops), flows
    share it fairly: an inner hop runs at ``1/(i+o)`` of the NIC while the outer transfer
    lasts (which slows the steps it overlaps), at ``1/i`` after; the outer transfer takes
    ``1/o`` of the NIC while no inner hop runs. The node's fabric bounds the step too.
    """
    bw, latency = c.nic_bw_gbs * 1e9, c.inter_latency_us * 1e-6
    runs: list[list] = []  # [bytes, count]: consecutive inner steps that send the same
    for b in inner_bytes:
        if runs and runs[-1][0] == b:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    worst = 0.0
    for i, o in topo.nic_loads:
        if i == 0 or o == 0:
            continue
        left, total = outer_bytes, 0.0
        for b, count in runs:
            solo = overlapped(t_c, latency + b * i / bw, overlap) if b > 0 else t_c
            if left <= 0 or b <= 0:  # no sharing in this run (or nothing to share with)
                if b <= 0 and left > 0:  # compute only: the outer transfer has the NIC to itself
                    left = max(0.0, left - count * t_c * bw / o)
                total += count * solo
                continue
            hop = latency + b * (i + o) / bw  # a hop while the outer transfer is in flight
            step = overlapped(t_c, hop, overlap)
            per_step = b + (step - hop) * bw / o  # outer bytes moved per such step
            full = min(count, int(left // per_step))
            total += full * step
            left -= full * per_step
            if full < count:  # the outer transfer ends during this step; the rest run alone
                shared = min(b, left)
                hop = latency + shared * (i + o) / bw + (b - shared) * i / bw
                step = overlapped(t_c, hop, overlap)
                left = max(0.0, left - shared - (step - hop) * bw / o)
                total += step + (count - full - 1) * solo
        worst = max(worst, total + left * o / bw)
    fabric = (topo.inner.on_node * sum(inner_bytes) + topo.outer.on_node * outer_bytes) / (c.intra_node_bw_gbs * 1e9)
    return max(worst, fabric)


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
    return latency * 1e-6 + max(t_on, t_off) + c.hop_sync_us * 1e-6


# -- the ring schedule with overlap -----------------------------------------------------
def overlapped(compute: float, transfer: float, overlap: float) -> float:
    """Duration of ``compute`` with ``transfer`` in flight: ``max(transfer, compute + (1-overlap)*transfer)``."""
    if transfer <= 0:
        return compute
    return max(transfer, compute + (1.0 - overlap) * transfer)


def ring_forward_seconds(
    n: int, w: int, t_c: float, hop_in: float, hop_out: float, overlap: float = 1.0, shared_step: float = 0.0
) -> float:
    """Double-ring forward: per outer step ``w`` block computes, each inner hop hidden behind
    one compute, the outer hop behind the whole outer step (as ``ring_forward`` runs).

    ``shared_step`` is the time of one outer step with its outer transfer in flight when both
    rings share links (:func:`shared_outer_step_seconds`; 0: they share none).
    """
    inner_part = (w - 1) * overlapped(t_c, hop_in, overlap) + t_c
    return (n - 1) * max(overlapped(inner_part, hop_out, overlap), shared_step) + inner_part


def ring_backward_seconds(
    n: int,
    w: int,
    t_c: float,
    hop_in: Callable[[float], float],
    hop_out: Callable[[float], float],
    kv: float,
    dkv: float,
    overlap: float = 1.0,
    shared: Callable[[list[float], float], float] | None = None,
) -> float:
    """Double-ring backward (as ``ring_backward`` runs, every rank reading every block);
    ``hop_in``/``hop_out`` map bytes to seconds, ``kv``/``dkv`` are the bytes of one block and
    of its fp32 gradient, and ``shared(inner_bytes, outer_bytes)`` is an outer step's time
    when both rings share links (:func:`shared_outer_step_seconds`; ``inner_bytes`` per inner
    step).

    During inner step ``s`` the next KV block and the previous step's dK/dV partial (the
    chain of a window's readers, :mod:`loongtrain.attention.routes`) share the inner link;
    a window's total goes home across windows after its last step, beside the next outer
    step's KV block; the last total's trip home is exposed.
    """

    def inner_bytes(j: int) -> list[float]:
        """Bytes each inner step of outer step ``j`` sends on the inner ring."""
        if w == 1:
            return [0.0]
        out = []
        for s in range(w):
            partial = (s >= 1 and not (j == 0 and s == 1)) or (s == 0 and j == 1)  # the previous slot's, inner
            out.append((kv if s + 1 < w else 0.0) + (dkv if partial else 0.0))
        return out

    classes = sorted({0, min(1, n - 1), min(2, n - 1), n - 1})
    total = 0.0
    for j in classes:
        nbytes = (kv if j + 1 < n else 0.0) + (dkv if j >= 2 else 0.0)  # the previous window total goes home
        repeat = n - 3 if (j == 2 and j != n - 1) else 1
        steps = inner_bytes(j)
        seconds = sum(  # the steps send at most three distinct sizes: price each once
            steps.count(b) * (overlapped(t_c, hop_in(b), overlap) if b > 0 else t_c) for b in set(steps)
        )
        step = overlapped(seconds, hop_out(nbytes), overlap)
        if shared is not None and n > 1:
            step = max(step, shared(steps, nbytes))
        total += repeat * step
    tail = hop_out(dkv) if n > 1 else (hop_in(dkv) if w > 1 else 0.0)
    return total + tail


# -- one ring step's work on the device -------------------------------------------------
def merge_bytes(w: Workload, hp: int, cp: int) -> tuple[float, float, float]:
    """Device-memory bytes moved per ring step outside the block kernels, by this library's
    ring step (``attention/blocks.py``, ``merge.py``): ``(forward, forward first, backward)``.

    Forward: the block output is cast to the fp32 accumulator and merged into it with one
    in-place ``lerp_`` (read both, write one), over the local query rows the block covers
    (all of them for the larger of the two half-block kinds). First step: the cast only.
    Backward: ``dq`` and the block's ``dk``/``dv`` are added into fp32 accumulators (read
    both, write one) over the rows the larger kind touches.
    """
    m, e, a = w.model, w.dtype_bytes, w.accum_bytes
    rows = w.micro_batch * w.seq_len / cp  # local query (and key) rows of a context rank
    heads, kv_heads = m.n_heads / hp, replicated_kv_heads(m, hp) / hp
    out = rows * heads * m.head_dim
    cast = out * (e + a) if e != a else 0.0
    forward = cast + out * 3 * a
    q_grad = out * (2 * a + e)
    kv_grad = 2 * rows * kv_heads * m.head_dim * (2 * a + e)
    return forward, cast, q_grad + kv_grad


@dataclass(frozen=True)
class BlockTimes:
    """One ring step on the device: the block kernel, the merge/accumulation around it and
    the hop's launch/sync cost. ``fwd``/``bwd`` for the half blocks, ``*_first`` for the
    first step (the causal diagonal block; the same as the others when not causal)."""

    fwd: float
    bwd: float
    fwd_first: float
    bwd_first: float
    kernel_fwd: float  # the half-block kernel alone (no merge, no hop cost)
    kernel_bwd: float
    kernel_fwd_first: float  # the first step's kernel alone
    kernel_bwd_first: float


def wave_efficiency(c: ClusterSpec, rows: float) -> float:
    """Fraction of the kernel rate a block of ``rows`` (rows x heads x batch) reaches:
    ``rows / (rows + attn_wave_rows / 2)`` (half a wave of tiles lost on average); 1 when
    ``attn_wave_rows`` is 0."""
    return rows / (rows + c.attn_wave_rows / 2) if c.attn_wave_rows > 0 else 1.0


def block_seconds(c: ClusterSpec, w: Workload, hp: int, cp: int) -> BlockTimes:
    """Forward and backward time of one ring step.

    The kernel: ``overhead + FLOPs / (rate * wave_efficiency)`` -- both make small blocks
    slower per FLOP -- with the causal diagonal block's masked tile halves. The rows of a
    step are those of its smaller block kind (the slowest rank sets the ring's pace):
    half the local rows in a causal ring (query rows forward, key rows backward), all of
    them for the diagonal block and without a causal mask. Around the kernel: the merge
    (:func:`merge_bytes` at ``hbm_bw_gbs``) and ``hop_sync_us`` for posting the step's
    transfer and waiting for it.
    """
    flops = ring_step_flops(w, hp, cp)
    rows = w.micro_batch * w.seq_len / cp * w.model.n_heads / hp
    eff_first = wave_efficiency(c, rows)
    eff = wave_efficiency(c, rows / 2) if w.causal else eff_first
    bwd_overhead = c.bwd_overhead_us
    fwd = c.kernel_overhead_us * 1e-6 + flops / (c.attn_fwd_tflops * 1e12 * eff)
    bwd = bwd_overhead * 1e-6 + BWD_FLOP_RATIO * flops / (c.attn_bwd_tflops * 1e12 * eff)
    # a causal diagonal block of S/cp tokens also computes the masked halves of its diagonal tiles
    first = 1.0 + c.causal_tile * cp / w.seq_len if w.causal else 1.0
    fwd_first = c.kernel_overhead_us * 1e-6 + first * flops / (c.attn_fwd_tflops * 1e12 * eff_first)
    bwd_first = bwd_overhead * 1e-6 + first * BWD_FLOP_RATIO * flops / (c.attn_bwd_tflops * 1e12 * eff_first)
    merge_fwd, merge_first, merge_bwd = merge_bytes(w, hp, cp)
    hbm = c.hbm_bw_gbs * 1e9 if c.hbm_bw_gbs > 0 else float("inf")
    hop = c.hop_sync_us * 1e-6 if cp > 1 else 0.0
    return BlockTimes(
        fwd=fwd + merge_fwd / hbm + hop,
        bwd=bwd + merge_bwd / hbm + hop,
        fwd_first=fwd_first + merge_first / hbm + hop,
        bwd_first=bwd_first + merge_bwd / hbm + hop,
        kernel_fwd=fwd,
        kernel_bwd=bwd,
        kernel_fwd_first=fwd_first,
        kernel_bwd_first=bwd_first,
    )


@dataclass(frozen=True)
class AttentionTimes:
    """Seconds of one layer's attention on one rank, per micro-batch."""

    a2a_fwd: float
    a2a_bwd: float
    ring_fwd: float  # the whole ring loop (compute and exposed transfers)
    ring_bwd: float
    kernels_fwd: float  # the ring steps' device work alone (kernels, merges, hop costs)
    kernels_bwd: float

    @property
    def fwd(self) -> float:
        return self.a2a_fwd + self.ring_fwd

    @property
    def bwd(self) -> float:
        return self.a2a_bwd + self.ring_bwd


def attention_seconds(c: ClusterSpec, w: Workload, candidate: Candidate, topo: Topology) -> AttentionTimes:
    """All-to-alls and the double ring of one layer, forward and backward."""
    p = candidate.parallel
    hp, cp, win, n = p.hp, p.cp, p.ring_window, p.n_ring_windows
    bt = block_seconds(c, w, hp, cp)
    a2a_fwd = a2a_bwd = 0.0
    if hp > 1:  # the packed buffers whose bytes comm_volume counts
        qkv, out = head_all_to_all_bytes(w, p.sp, hp)
        a2a_fwd = all_to_all_seconds(c, topo.head, qkv) + all_to_all_seconds(c, topo.head, out)
        a2a_bwd = all_to_all_seconds(c, topo.head, out) + all_to_all_seconds(c, topo.head, qkv)
    if cp == 1:
        return AttentionTimes(a2a_fwd, a2a_bwd, bt.fwd_first, bt.bwd_first, bt.fwd_first, bt.bwd_first)

    def hop_in(nbytes: float) -> float:
        return ring_hop_seconds(c, topo.inner, nbytes)

    def hop_out(nbytes: float) -> float:
        return ring_hop_seconds(c, topo.outer, nbytes)

    kv = kv_block_bytes(w, hp, cp)
    dkv = kv_block_bytes(w, hp, cp, w.accum_bytes)
    ov = c.overlap
    both = topo.double_ring_concurrent

    def shared_bwd(inner_bytes: list[float], outer_bytes: float) -> float:
        return shared_outer_step_seconds(c, topo, bt.bwd, inner_bytes, outer_bytes, ov)

    fwd_inner = [kv] * (win - 1) + [0.0]
    shared_step = shared_outer_step_seconds(c, topo, bt.fwd, fwd_inner, kv, ov) if both else 0.0
    ring_fwd = ring_forward_seconds(n, win, bt.fwd, hop_in(kv), hop_out(kv), ov, shared_step)
    ring_bwd = ring_backward_seconds(n, win, bt.bwd, hop_in, hop_out, kv, dkv, ov, shared_bwd if both else None)
    # the first step is the causal diagonal block; its transfer is one KV block
    first_hop = hop_in(kv) if win > 1 else hop_out(kv)
    ring_fwd += overlapped(bt.fwd_first, first_hop, ov) - overlapped(bt.fwd, first_hop, ov)
    ring_bwd += overlapped(bt.bwd_first, first_hop, ov) - overlapped(bt.bwd, first_hop, ov)
    kernels_fwd = (cp - 1) * bt.fwd + bt.fwd_first
    kernels_bwd = (cp - 1) * bt.bwd + bt.bwd_first
    return AttentionTimes(a2a_fwd, a2a_bwd, ring_fwd, ring_bwd, kernels_fwd, kernels_bwd)


def sliding_attention_seconds(
    c: ClusterSpec, w: Workload, candidate: Candidate, topo: Topology, window: int, full: AttentionTimes
) -> AttentionTimes:
    """One sliding layer of ``window`` beside ``full`` (a full layer's :func:`attention_seconds`):
    its kernels priced by the keys a query sees (``S * w``, not ``S^2 / 2``); its transfers, while
    the window is below a rank's block (``S / cp``), the halo (:mod:`loongtrain.attention.halo`):
    ``w - 1`` tokens of keys/values to each ring neighbour, hidden behind its own block, and their
    float32 dK/dV back; otherwise the full ring's exposed transfers."""
    if not w.causal:
        return full
    ratio = causal_keys_per_query(w.seq_len, window) / causal_keys_per_query(w.seq_len)
    kernels_fwd, kernels_bwd = full.kernels_fwd * ratio, full.kernels_bwd * ratio
    p = candidate.parallel
    if p.cp == 1:
        return AttentionTimes(full.a2a_fwd, full.a2a_bwd, kernels_fwd, kernels_bwd, kernels_fwd, kernels_bwd)
    if window >= w.seq_len / p.cp:  # a window as long as a block: priced as the ring (its exposed transfers)
        return AttentionTimes(
            full.a2a_fwd, full.a2a_bwd, full.ring_fwd - full.kernels_fwd + kernels_fwd,
            full.ring_bwd - full.kernels_bwd + kernels_bwd, kernels_fwd, kernels_bwd,
        )  # fmt: skip
    share = 2 * (window - 1) / (w.seq_len / p.cp)  # two neighbours' halos, as a share of a block
    kv = kv_block_bytes(w, p.hp, p.cp) * share
    dkv = kv_block_bytes(w, p.hp, p.cp, w.accum_bytes) * share
    hop = ring_hop_seconds(c, topo.inner if p.ring_window > 1 else topo.outer, kv)
    hop_dkv = ring_hop_seconds(c, topo.inner if p.ring_window > 1 else topo.outer, dkv)
    ring_fwd = overlapped(kernels_fwd, hop, c.overlap)
    ring_bwd = overlapped(kernels_bwd, hop, c.overlap) + hop_dkv  # the partials go back after the compute
    return AttentionTimes(full.a2a_fwd, full.a2a_bwd, ring_fwd, ring_bwd, kernels_fwd, kernels_bwd)


def layer_attention_seconds(c: ClusterSpec, w: Workload, candidate: Candidate, topo: Topology) -> AttentionTimes:
    """:func:`attention_seconds` of the mean layer: each layer priced by its kind (its window)."""
    full = attention_seconds(c, w, candidate, topo)
    windows = w.model.windows
    if not any(windows):
        return full
    times = {
        win: full if not win else sliding_attention_seconds(c, w, candidate, topo, win, full) for win in set(windows)
    }
    n = len(windows)
    return AttentionTimes(*(sum(getattr(times[win], f.name) for win in windows) / n for f in fields(AttentionTimes)))
