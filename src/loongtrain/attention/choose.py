"""A layout per microbatch: which hp x cp split of the sequence-parallel group runs one
packed microbatch fastest. Pure: every rank computes the same answer from the same
boundaries, with no communication.

For each candidate :class:`~loongtrain.parallel.ParallelConfig` (the same ``sp``, so the
same ranks and ZeRO mesh; :func:`candidate_configs`) the microbatch's
:class:`~loongtrain.attention.layout.SequenceLayout` gives its attention work per context
rank (the keys its queries see, under the documents and the sliding window) and its ring
routes (:mod:`routes`: the key/value blocks and dK/dV partials each rank sends); the head
all-to-all moves ``q``, ``k``, ``v`` and the output both ways. One layer's attention
(forward and backward) is priced as

    max(busiest rank's kernels, its ring transfers) + its all-to-alls

at :class:`LinkSpeeds` (the ring overlaps the kernels, the all-to-alls do not; on CPU
processes sharing their cores nothing overlaps: kernels + ring + all-to-alls), and the
cheapest candidate wins (ties: the first). A microbatch of short documents under the
``locality`` balance sends nothing on a ring, so the pure ring is chosen for it and skips
the all-to-all a 2D layout would pay; one long document keeps the 2D split.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from loongtrain.attention.documents import Boundaries
from loongtrain.attention.layout import sequence_layout
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.layout import check_head_groups, check_head_split

#: FLOPs of one (query, key) pair per head dimension: two matmuls forward (2 x 2), the
#: backward 2.5x the forward.
FLOPS_PER_PAIR = 4 * 3.5


@dataclass(frozen=True)
class LinkSpeeds:
    """What the choice prices with: one device's attention FLOP/s, the bytes per second one
    rank sends on a ring hop and in the head all-to-all, and whether ring transfers run beside
    the kernels (a GPU's copy engines and NICs do; CPU processes sharing their cores copy with
    the same cores that compute, so there a transfer's time adds to the kernels')."""

    flops: float
    ring_bytes_per_s: float
    all_to_all_bytes_per_s: float
    overlap: bool = True


#: CPU processes on gloo (docs/PLATFORM: ~1 GB/s per rank in a ring step; fp32 flash
#: attention ~40 GFLOP/s on two cores); transfers take the cores the kernels need.
CPU_GLOO = LinkSpeeds(flops=40e9, ring_bytes_per_s=1e9, all_to_all_bytes_per_s=1e9, overlap=False)
#: One node of H100s: ~400 TFLOP/s of attention kernels, NVLink for rings and all-to-alls.
GPU_NODE = LinkSpeeds(flops=400e12, ring_bytes_per_s=150e9, all_to_all_bytes_per_s=150e9)


@dataclass(frozen=True)
class AttentionShape:
    """The model's attention as the choice needs it."""

    heads: int
    kv_heads: int
    head_dim: int
    elem_bytes: int  # bytes of one element of q/k/v (2 for bf16)


def candidate_configs(
    config: ParallelConfig, heads: int, kv_heads: int, balances: Sequence[str] = (), head_groups: int = 1
) -> list[ParallelConfig]:
    """Every hp x cp split of ``config.sp`` the model's heads allow (and, with ``head_groups`` > 1,
    each group's heads: ``memory.head_groups``), each under ``config``'s balance and then each of
    ``balances``; ``config`` first. Each keeps ``config``'s ring window where it divides the
    candidate's ``cp`` (else the plain ring), its placement, context order and ``dp``."""
    splits = [config]
    for hp in range(1, config.sp + 1):
        if config.sp % hp or hp == config.hp:
            continue
        try:
            check_head_split(heads, kv_heads, hp)
            if head_groups > 1:
                check_head_groups(heads, kv_heads, head_groups, hp)
        except ValueError:
            continue
        cp = config.sp // hp
        window = config.ring_window if cp % config.ring_window == 0 else 1
        splits.append(replace(config, hp=hp, cp=cp, ring_window=window))
    others = [b for b in dict.fromkeys(balances) if b != config.balance]
    return splits + [replace(c, balance=b) for b in others for c in splits]


@dataclass(frozen=True)
class LayoutCost:
    """One layer's attention (forward + backward) of one microbatch on one layout: the
    busiest context rank's kernel seconds, the most bytes a rank sends on the ring (K/V
    blocks both passes, float32 dK/dV partials) and in the head all-to-alls, and the
    seconds :func:`layout_seconds` prices them at."""

    seconds: float
    compute_s: float
    ring_bytes: float
    all_to_all_bytes: float


def layout_cost(
    config: ParallelConfig,
    seq_len: int,
    boundaries: Boundaries | None,
    sliding_window: int | None,
    shape: AttentionShape,
    speeds: LinkSpeeds,
) -> LayoutCost:
    """:class:`LayoutCost` of a causal microbatch of ``seq_len`` tokens with documents
    ``boundaries`` on ``config``; under a ``sliding_window`` whose halo moves fewer key/value
    columns than the ring (:meth:`~loongtrain.attention.mask_plan.MaskPlan.halo`, as the
    attention itself decides), the halo's bytes instead of the ring's."""
    layout = sequence_layout(seq_len, config, boundaries)
    hp, cp = config.hp, config.cp
    work = layout.sharding.work(boundaries, True, sliding_window)
    compute = max(work) * (shape.heads / hp) * shape.head_dim * FLOPS_PER_PAIR / speeds.flops
    masks = layout.mask_plan(True, sliding_window)
    kv_heads = max(shape.kv_heads, hp) // hp
    halo = masks.halo(config) if sliding_window else None
    if halo is not None:  # the sliding window's halo replaces the ring (attention/halo.py)
        column = 2 * kv_heads * shape.head_dim  # one key and one value column, elements
        # a rank sends the columns others' windows read in both passes, and the float32 dK/dV
        # of the columns it read back to their owners
        ring = max(
            2 * sum(p.length for p in halo.outgoing(c)) * column * shape.elem_bytes
            + sum(p.length for p in halo.incoming(c)) * column * 4
            for c in range(cp)
        )  # fmt: skip
    else:
        routes = masks.routes(config)
        block = 2 * (seq_len // cp) * kv_heads * shape.head_dim * shape.elem_bytes
        grad_block = block * 4 // shape.elem_bytes  # dK/dV partials travel in float32
        ring = max(2 * routes.kv_hops(c) * block + routes.dkv_partials(c) * grad_block for c in range(cp))
    a2a = 0.0
    if hp > 1:
        local = seq_len // config.sp
        qkv = local * (shape.heads + 2 * max(shape.kv_heads, hp)) * shape.head_dim * shape.elem_bytes
        out = local * shape.heads * shape.head_dim * shape.elem_bytes
        a2a = 2 * (qkv + out) * (hp - 1) / hp
    ring_s = ring / speeds.ring_bytes_per_s
    seconds = (max(compute, ring_s) if speeds.overlap else compute + ring_s) + a2a / speeds.all_to_all_bytes_per_s
    return LayoutCost(seconds, compute, float(ring), a2a)


def layout_seconds(
    config: ParallelConfig,
    seq_len: int,
    boundaries: Boundaries | None,
    sliding_window: int | None,
    shape: AttentionShape,
    speeds: LinkSpeeds,
) -> float:
    """Predicted seconds of one layer's attention (forward + backward) of a causal
    microbatch of ``seq_len`` tokens with documents ``boundaries`` on ``config``:

        max(busiest rank's kernels, its ring transfers) + its all-to-alls

    (the kernels plus the ring transfers where ``speeds`` do not overlap them)."""
    return layout_cost(config, seq_len, boundaries, sliding_window, shape, speeds).seconds


def model_layout_seconds(
    config: ParallelConfig,
    seq_len: int,
    boundaries: Boundaries | None,
    windows: Sequence[int],
    shape: AttentionShape,
    speeds: LinkSpeeds,
) -> float:
    """Predicted seconds of the attention of every layer of a model whose layers have ``windows``
    (each layer's sliding window, 0: full attention; ``ModelConfig.windows``): each distinct
    window priced once by :func:`layout_seconds`, times its number of layers. Sliding layers
    interleaved with full ones (OLMo 3, Gemma 3) weigh by their count, not by the full layers'
    price alone."""
    counts = Counter(windows)
    return sum(n * layout_seconds(config, seq_len, boundaries, w or None, shape, speeds) for w, n in counts.items())


def choose_layout(
    configs: Sequence[ParallelConfig],
    seq_len: int,
    boundaries: Boundaries | None,
    sliding_window: int | None | Sequence[int],
    shape: AttentionShape,
    speeds: LinkSpeeds,
) -> int:
    """Index in ``configs`` of the layout priced lowest (ties: the first): by :func:`layout_seconds`
    under one ``sliding_window`` for every layer (None: full attention), or by
    :func:`model_layout_seconds` when it is each layer's window (a sequence; 0: full)."""
    if isinstance(sliding_window, Sequence):
        windows = tuple(sliding_window)
        costs = [model_layout_seconds(c, seq_len, boundaries, windows, shape, speeds) for c in configs]
    else:
        costs = [layout_seconds(c, seq_len, boundaries, sliding_window, shape, speeds) for c in configs]
    return min(range(len(configs)), key=lambda i: (costs[i], i))
