"""Enumerate the layouts of a request, rank them, pick the baselines' best. Pure.

A layout is (dp, hp, cp, ring_window, placement, ZeRO scope, checkpoint mode) with
``dp * hp * cp = devices``. Equivalent layouts are listed once: a plain ring is
``ring_window=1`` (``ring_window=cp`` is the same ring), placement only matters when
``hp > 1`` and ``cp > 1``, and ZeRO scopes that shard over the same group are merged.

The other memory options are chosen per layout, not multiplied into the candidates
(:func:`choose_memory_options`): the chunked loss or the whole-shard one, whichever needs
less memory (they cost the same FLOPs); tiling, activation offload, the attention over
head groups (the most groups the heads allow) and, under ``full``, checkpoint spans of two
layers only when the layout does not fit without them, then the fastest combination that
fits; model-state offload only when nothing else fits. A checkpointing layout that fits then
checkpoints only the fewest first layers that still fit (``activation_checkpoint_layers``):
the others recompute nothing.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loongtrain.model.config import ModelConfig
from loongtrain.options import (
    ACTIVATION_CHECKPOINT_MODES,
    PLACEMENTS,
    ZERO_SCOPES,
    MemoryOptions,
    check_zero_scope,
    checkpointed_count,
)
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.layout import check_head_groups, check_head_split, check_sequence_length
from loongtrain.planner.cost import Candidate, Workload
from loongtrain.planner.estimate import Estimate, estimate
from loongtrain.planner.memory import memory_bytes
from loongtrain.planner.specs import ClusterSpec, PlanError

GiB = 2**30


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _passes(check, *args) -> bool:
    try:
        check(*args)
    except ValueError:
        return False
    return True


def head_degree_ok(m: ModelConfig, hp: int) -> bool:
    """``hp`` divides the query heads and fits the KV heads (the library's ``check_head_split``)."""
    return _passes(check_head_split, m.n_heads, m.n_kv_heads, hp)


def head_group_options(m: ModelConfig, hp: int) -> list[int]:
    """The head-group counts above one that split the model's heads, each group over ``hp``
    (``memory.head_groups``), fewest first."""
    if not m.pre_norm_blocks:  # head groups run Llama's blocks only
        return []
    return [g for g in divisors(m.n_heads)[1:] if _passes(check_head_groups, m.n_heads, m.n_kv_heads, g, hp)]


def sequence_ok(seq_len: int, sp: int) -> bool:
    """``seq_len`` zigzag-shards over ``sp`` ranks (the library's ``check_sequence_length``)."""
    return _passes(check_sequence_length, seq_len, 1, sp)


def zero_scopes(dp: int, sp: int) -> tuple[str, ...]:
    """Scopes with distinct shard groups (``dp`` is ``none`` when dp=1, ``sp`` is ``dp_sp``; ...)."""
    if dp == 1 and sp == 1:
        return ("none",)
    if dp == 1:
        return ("none", "dp_sp")
    if sp == 1:
        return ("none", "dp")
    return ZERO_SCOPES


def check_devices(c: ClusterSpec, devices: int) -> None:
    """Raise :class:`PlanError` unless ``devices`` is whole nodes (or part of one) of ``c``."""
    dpn = c.devices_per_node
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise PlanError(f"devices={devices!r} must be a positive integer")
    if devices % dpn != 0 and not (devices < dpn and dpn % devices == 0):
        lower, upper = devices // dpn * dpn, -(-devices // dpn) * dpn
        raise PlanError(
            f"devices={devices} is not a multiple of devices_per_node={dpn} of cluster {c.name!r}; "
            f"use whole nodes (e.g. {lower or dpn} or {upper}), or a divisor of {dpn} for part of one node"
        )
    if devices > c.max_devices:
        raise PlanError(
            f"devices={devices} exceeds cluster {c.name!r}: {c.nodes} nodes x {dpn} = {c.max_devices} devices; "
            "raise `nodes` in a cluster file to plan a bigger machine"
        )


def check_workload(w: Workload) -> None:
    """Raise :class:`PlanError` unless the workload's sizes are positive integers that fit together."""
    for name in ("seq_len", "batch", "micro_batch"):
        value = getattr(w, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name}={value!r} must be a positive integer")
    if w.batch % w.micro_batch != 0:
        raise PlanError(f"batch={w.batch} is not a multiple of micro_batch={w.micro_batch}")


#: the chunked loss's chunk the search uses (the library's default)
DEFAULT_LOSS_CHUNK = MemoryOptions().loss_chunk
#: the MLP tile the search uses when a layout needs tiling: one tile's SwiGLU working set is
#: 6 x tile x ffn x e bytes (1.4 GiB for Llama-3-8B in bf16), and GEMMs of 8192 rows run at full rate
DEFAULT_MLP_TILE = 8192


def enumerate_layouts(m: ModelConfig, w: Workload, devices: int) -> list[Candidate]:
    """Every distinct valid layout of ``devices`` for ``w`` with each checkpoint mode and the
    default memory options (memory not yet checked; :func:`choose_memory_options` varies the rest)."""
    out: list[Candidate] = []
    for sp in divisors(devices):
        dp = devices // sp
        if w.batch % (dp * w.micro_batch) != 0:
            continue
        if not sequence_ok(w.seq_len, sp):
            continue
        for hp in divisors(sp):
            if not head_degree_ok(m, hp):
                continue
            cp = sp // hp
            ring_windows = [x for x in divisors(cp) if x < cp] or [1]
            placements = PLACEMENTS if hp > 1 and cp > 1 else ("head_first",)
            for ring_window in ring_windows:
                for placement in placements:
                    for zero in zero_scopes(dp, sp):
                        for ckpt in ACTIVATION_CHECKPOINT_MODES:
                            parallel = ParallelConfig(hp, cp, ring_window, placement, dp)
                            memory = MemoryOptions(activation_checkpoint=ckpt, loss_chunk=DEFAULT_LOSS_CHUNK)
                            out.append(Candidate(parallel, zero, memory))
    return out


def listed_form(x: Candidate) -> Candidate:
    """``x`` written as :func:`enumerate_layouts` lists it: a ring window of ``cp`` as 1, the
    placement as ``head_first`` when ``hp`` or ``cp`` is 1, and a ZeRO scope as the scope of
    :func:`zero_scopes` that shards over the same ranks (the same layout, the same estimate)."""
    p = x.parallel
    scopes = zero_scopes(p.dp, p.sp)
    zero = x.zero
    if zero not in scopes:  # dp or sp is 1: scopes of the same size shard over the same ranks
        size = {"none": 1, "dp": p.dp, "sp": p.sp, "dp_sp": p.dp * p.sp}
        zero = next(s for s in scopes if size[s] == size[x.zero])
    return x.with_(
        ring_window=1 if p.ring_window == p.cp else p.ring_window,
        placement=p.placement if p.hp > 1 and p.cp > 1 else "head_first",
        zero=zero,
    )


def shard_tokens(w: Workload, layout: Candidate) -> float:
    """Tokens of one rank's shard: ``micro_batch * seq_len / sp``."""
    return w.micro_batch * w.seq_len / layout.parallel.sp


def _option_sets(c: ClusterSpec, w: Workload, base: Candidate) -> tuple[list[dict], list[dict]]:
    """The (tile, activation offload, head groups, checkpoint span) combinations beyond the
    plain layout, and those with model-state offload, that this cluster and layout allow."""
    # the tiled MLP and head groups run Llama's pre-norm block from the weights: not with other
    # blocks, nor with float8 (they would bypass its linears; estimate() blocks them, the trainer refuses)
    blocks = w.model.pre_norm_blocks and not w.float8
    tiles = [0] + ([DEFAULT_MLP_TILE] if shard_tokens(w, base) > DEFAULT_MLP_TILE and blocks else [])
    acts = [False]
    if base.checkpoint != "none" and c.offload_gap("activations") is None:
        acts.append(True)
    groups = [1] + (head_group_options(w.model, base.parallel.hp)[-1:] if not w.float8 else [])
    spans = [1, 2] if base.checkpoint == "full" and base.memory.activation_checkpoint_every == 1 else [1]
    keys = ("activation_checkpoint_span", "head_groups", "mlp_tile", "offload_activations")
    combos = [dict(zip(keys, values)) for values in itertools.product(spans, groups, tiles, acts)]
    more = combos[1:]
    states = [dict(combo, offload_states=True) for combo in combos] if c.offload_gap("states") is None else []
    return more, states


def leanest(c: ClusterSpec, w: Workload, base: Candidate) -> Candidate:
    """``base`` with every memory-saving option the cluster allows (for the memory floor)."""
    more, states = _option_sets(c, w, base)
    options = (states or more or [{}])[-1]
    lean = base.with_(**options)
    unchunked = lean.with_(loss_chunk=0)
    return min((lean, unchunked), key=lambda x: memory_bytes(w, x).total)


def _plain(w: Workload, base: Candidate) -> Candidate:
    """``base`` with the chunked or the whole-shard loss, whichever needs less memory."""
    return min((base, base.with_(loss_chunk=0)), key=lambda x: memory_bytes(w, x).total)


def memory_fits(c: ClusterSpec, w: Workload, layout: Candidate) -> bool:
    """``layout`` fits device and host memory on ``c`` (what ``Estimate.fits`` says, without the times)."""
    mem = layout.memory
    if mem.offload_activations and mem.activation_checkpoint != "none" and c.offload_gap("activations"):
        return False
    if mem.offload_states and c.offload_gap("states"):
        return False
    need = memory_bytes(w, layout)
    host = need.host * min(layout.devices, c.devices_per_node)
    return need.total <= c.usable_memory_bytes and host <= c.host_memory_bytes


def fits_somewhere(c: ClusterSpec, w: Workload, devices: int) -> bool:
    """Some layout of ``devices`` fits with the memory options :func:`choose_memory_options`
    would try (memory only: the ring window and placement do not change memory)."""
    seen = set()
    for base in enumerate_layouts(w.model, w, devices):
        p = base.parallel
        key = (p.dp, p.hp, p.cp > 1, base.zero, base.checkpoint)
        if key in seen:
            continue
        seen.add(key)
        plain = _plain(w, base)
        if memory_fits(c, w, plain):
            return True
        for group in _option_sets(c, w, plain):
            if any(memory_fits(c, w, plain.with_(**options)) for options in group):
                return True
    return False


def choose_memory_options(c: ClusterSpec, w: Workload, base: Candidate) -> Estimate:
    """The estimate of ``base`` with the memory options that make it fastest while fitting.

    Chunked or whole-shard loss: the one needing less memory (same FLOPs). Then, only if
    that does not fit: the fastest fitting combination of MLP tiling and activation offload;
    only if none fits: the same with model-state offload. Nothing fits: the leanest.
    """
    plain = _plain(w, base)
    first = estimate(c, w, plain)
    if first.fits:
        return _fewest_checkpointed(c, w, first)
    tried = [first]
    for group in _option_sets(c, w, plain):
        estimates = [estimate(c, w, plain.with_(**options)) for options in group]
        tried += estimates
        fitting = [e for e in estimates if e.fits]
        if fitting:
            return _fewest_checkpointed(c, w, min(fitting, key=lambda e: (e.step_s, e.memory.total)))
    return min(tried, key=overshoot)


def _fewest_checkpointed(c: ClusterSpec, w: Workload, fitting: Estimate) -> Estimate:
    """``fitting`` (checkpointing every layer) with its mode on the fewest first layers that
    still fit: the rest keep their activations and recompute nothing. Unchanged where nothing
    is checkpointed, or spans or every k-th layer are."""
    layout, n_layers = fitting.candidate, w.model.n_layers
    mem = layout.memory
    if layout.checkpoint == "none" or mem.activation_checkpoint_span > 1 or mem.activation_checkpoint_every > 1:
        return fitting
    for layers in range(1, n_layers):  # memory falls with every layer checkpointed
        fewer = layout.with_(activation_checkpoint_layers=layers)
        if memory_fits(c, w, fewer):
            return estimate(c, w, fewer)
    return fitting


def overshoot(e: Estimate) -> tuple[float, float]:
    """How far an estimate is from fitting: its device or host memory over the limit, whichever
    is further (then device memory): the leanest of layouts that do not fit is the nearest."""
    host = e.host_per_node / e.host_limit if e.host_limit > 0 else 0.0
    return max(e.memory.total / e.memory_limit, host), e.memory.total


def _why_none_valid(m: ModelConfig, w: Workload, devices: int) -> str:
    sps = divisors(devices)
    batch_ok = [sp for sp in sps if w.batch % (devices // sp * w.micro_batch) == 0]
    if not batch_ok:
        return f"batch={w.batch} sequences cannot be split over any data-parallel degree of {devices} devices"
    seq_ok = [sp for sp in batch_ok if sequence_ok(w.seq_len, sp)]
    if not seq_ok:
        return (
            f"seq_len={w.seq_len} is not a multiple of 2*sp for any sequence-parallel degree sp in {batch_ok} "
            f"(zigzag sharding cuts the sequence into 2*cp chunks); pad it to a multiple of {2 * max(batch_ok)}"
        )
    return (
        f"no hp divides the model's heads (H={m.n_heads}, G={m.n_kv_heads}) within sp in {seq_ok}; "
        "hp must divide H and either divide G or be a multiple of it"
    )


#: Baselines priced by the same model: layout families people would otherwise run.
BASELINES: dict[str, Callable[[Candidate], bool]] = {
    # DeepSpeed-Ulysses: head all-to-all only (sp = hp <= H); ZeRO, ordinary checkpointing
    "DeepSpeed-Ulysses": lambda x: x.parallel.cp == 1 and x.checkpoint != "sc++",
    # Megatron-LM context parallelism: one zigzag ring over the sp ranks (hp = 1)
    "Megatron-CP": lambda x: x.parallel.hp == 1 and x.parallel.ring_window == 1 and x.checkpoint != "sc++",
    # USP (yunchang): 2D with the head group on consecutive ranks, plain ring, no SC++
    "USP 2D": lambda x: x.parallel.placement == "head_first" and x.parallel.ring_window == 1 and x.checkpoint != "sc++",
}


@dataclass
class SearchResult:
    """Ranked estimates of a request; ``ranked`` holds the layouts that fit, fastest first."""

    cluster: ClusterSpec
    workload: Workload
    devices: int
    ranked: list[Estimate]
    too_big: list[Estimate]
    baselines: dict[str, Estimate | None]
    n_candidates: int  # layouts evaluated
    elapsed_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Estimate:
        return self.ranked[0]


def _devices_that_fit(c: ClusterSpec, w: Workload, devices: int) -> int | None:
    d = devices * 2
    while d <= c.max_devices:
        for base in enumerate_layouts(w.model, w, d):
            lean = leanest(c, w, base)
            if estimate(c, w, lean).fits:
                return d
        d *= 2
    return None


def too_big_message(c: ClusterSpec, w: Workload, devices: int, too_big: list[Estimate], hint: bool = True) -> str:
    """Why no layout fits: the leanest layout's device (or host) memory against the limit;
    ``hint``: also how many devices would fit."""
    lean = min(too_big, key=overshoot)
    suffix = ""
    if hint:
        more = _devices_that_fit(c, w, devices)
        suffix = f"; {more} devices would fit" if more else "; it does not fit on any size of this cluster either"
    suffix += ", or use a shorter sequence" if hint else ""
    if lean.memory.total <= lean.memory_limit and lean.blocked is None:
        return (
            f"seq_len={w.seq_len} does not fit on {devices} devices of {c.name!r}: the leanest layout "
            f"({lean.candidate.label()}) pins {lean.host_per_node / GiB:.2f} GiB of host memory per node, more "
            f"than the usable {c.host_memory_gib:.2f} GiB{suffix}"
        )
    phase = lean.memory.phase
    biggest = max(lean.memory.terms, key=lambda t: t[1])
    return (
        f"seq_len={w.seq_len} does not fit on {devices} devices of {c.name!r}: the leanest layout "
        f"({lean.candidate.label()}) needs {lean.memory.total / GiB:.1f} GiB per device ({phase}; largest term: "
        f"{biggest[0]} {biggest[1] / GiB:.1f} GiB), more than the usable {c.usable_memory_bytes / GiB:.1f} GiB "
        f"({c.usable_memory_fraction:.0%} of {c.device_memory_gib:g} GiB){suffix}"
    )


def evaluate_layouts(c: ClusterSpec, w: Workload, devices: int) -> tuple[int, list[Estimate], list[Estimate]]:
    """``(layouts evaluated, those that fit fastest first, the others)``; raise :class:`PlanError`
    only when no layout is valid (memory is the caller's concern)."""
    check_devices(c, devices)
    check_workload(w)
    layouts = enumerate_layouts(w.model, w, devices)
    if not layouts:
        raise PlanError(f"no valid layout for {devices} devices: {_why_none_valid(w.model, w, devices)}")
    estimates = [choose_memory_options(c, w, x) for x in layouts]
    ranked = sorted((e for e in estimates if e.fits), key=lambda e: (e.step_s, e.memory.total))
    too_big = sorted((e for e in estimates if not e.fits), key=lambda e: e.step_s)
    return len(layouts), ranked, too_big


def search_layouts(c: ClusterSpec, w: Workload, devices: int) -> SearchResult:
    """Estimate every valid layout of ``devices``; raise :class:`PlanError` if none is valid or fits."""
    t0 = time.perf_counter()
    n, ranked, too_big = evaluate_layouts(c, w, devices)
    if not ranked:
        raise PlanError(too_big_message(c, w, devices, too_big))
    baselines = {name: next((e for e in ranked if keep(e.candidate)), None) for name, keep in BASELINES.items()}
    return SearchResult(
        cluster=c,
        workload=w,
        devices=devices,
        ranked=ranked,
        too_big=too_big,
        baselines=baselines,
        n_candidates=n,
        elapsed_s=time.perf_counter() - t0,
    )


def check_candidate(w: Workload, candidate: Candidate, devices: int, c: ClusterSpec | None = None) -> None:
    """Raise :class:`PlanError` naming what makes ``candidate`` invalid for ``w`` on ``devices``
    (and, given the cluster ``c``, an option that cannot apply there).

    The rules are the library's own: ``ParallelConfig`` (degrees, ring window, placement, the
    world size), ``check_head_split``, ``check_head_groups``, ``check_sequence_length``, ``MemoryOptions`` and the
    option checks; plus what only a plan knows: an MLP tile larger than the rank's shard,
    and offload on a cluster without host memory to spare.
    """
    m, p, mem = w.model, candidate.parallel, candidate.memory
    try:
        p.resolve_dp(devices)
    except ValueError as exc:
        raise PlanError(f"layout: {exc}") from None
    for what, check, args in (
        (f"layout zero={candidate.zero!r}", check_zero_scope, (candidate.zero,)),
        (f"layout hp={p.hp} does not fit the model's heads", check_head_split, (m.n_heads, m.n_kv_heads, p.hp)),
        (f"seq_len={w.seq_len}", check_sequence_length, (w.seq_len, p.hp, p.cp)),
        ("layout", check_head_groups, (m.n_heads, m.n_kv_heads, mem.head_groups, p.hp)),
        ("layout", checkpointed_count, (mem, m.n_layers)),
    ):
        try:
            check(*args)
        except ValueError as exc:
            raise PlanError(f"{what}: {exc}") from None
    if w.batch % (p.dp * w.micro_batch) != 0:
        raise PlanError(f"batch={w.batch} is not a multiple of dp*micro_batch = {p.dp}*{w.micro_batch}")
    if not m.pre_norm_blocks and (mem.mlp_tile or mem.head_groups > 1):
        raise PlanError(
            f"layout mlp_tile={mem.mlp_tile}, head_groups={mem.head_groups}: the tiled MLP and head groups run "
            f"Llama's pre-norm blocks; this model has norm_placement={m.norm_placement!r}: use 0 and 1"
        )
    tokens = shard_tokens(w, candidate)
    if mem.mlp_tile > tokens:
        raise PlanError(
            f"layout mlp_tile={mem.mlp_tile} is larger than a rank's shard of {tokens:.0f} tokens "
            f"(micro_batch*seq_len/sp = {w.micro_batch}*{w.seq_len}/{p.sp}); use mlp_tile <= {tokens:.0f} or 0"
        )
    if c is not None:
        for what, on in (("activations", mem.offload_activations), ("states", mem.offload_states)):
            gap = c.offload_gap(what) if on else None
            if gap:
                raise PlanError(f"layout offload={what}: {gap}")
