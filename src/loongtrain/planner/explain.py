"""Why the winner wins: compare it with the baselines and with its nearest alternatives. Pure."""

from __future__ import annotations

from loongtrain.planner.cost import Candidate
from loongtrain.planner.estimate import Estimate
from loongtrain.planner.search import SearchResult
from loongtrain.planner.topology import Topology

GiB = 2**30
COMPONENTS = (
    ("compute_s", "compute"),
    ("a2a_s", "all-to-all"),
    ("ring_s", "exposed ring"),
    ("zero_s", "ZeRO"),
    ("offload_s", "offload"),
)


def _ms(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.0f} ms"


def _main_difference(better: Estimate, worse: Estimate) -> str:
    """The component that accounts for most of ``worse``'s extra time."""
    deltas = [(getattr(worse, attr) - getattr(better, attr), name) for attr, name in COMPONENTS]
    delta, name = max(deltas)
    return f"{name} +{_ms(delta)}"


def describe_topology(t: Topology, hp: int, cp: int, ring_window: int) -> str:
    """One line on where the layout's transfers go."""
    parts = []
    if hp > 1:
        parts.append(
            "the head all-to-all stays inside a node"
            if t.head.off_peers == 0
            else f"the head all-to-all sends to {t.head.off_peers} of {hp - 1} peers on other nodes"
        )
    if 1 < ring_window < cp:
        n = cp // ring_window
        rings = [(t.inner, f"inner ring ({ring_window} ranks)"), (t.outer, f"outer ring ({n} ring windows)")]
    elif cp > 1:
        rings = [(t.outer if ring_window == 1 else t.inner, f"the ring ({cp} ranks)")]
    else:
        rings = []
    for ring, label in rings:
        where = (
            f"crosses nodes ({ring.off_node} hops leave a node, {ring.per_nic} per NIC)"
            if ring.crosses
            else "stays in a node"
        )
        parts.append(f"{label} {where}")
    return "; ".join(parts) if parts else "no attention communication"


_KNOB_FIELDS = {
    "hp": ("hp", "cp", "ring_window"),
    "ring_window": ("ring_window",),
    "placement": ("placement",),
    "checkpoint": ("checkpoint",),
    "zero": ("zero",),
}


def _knobs(x: Candidate) -> dict:
    p = x.parallel
    return {
        "hp": p.hp,
        "cp": p.cp,
        "ring_window": p.ring_window,
        "placement": p.placement,
        "dp": p.dp,
        "zero": x.zero,
        "checkpoint": x.checkpoint,
    }


def _variant_line(result: SearchResult, best: Estimate, knob: str, label: str) -> str | None:
    """Best layout differing from the winner only in ``knob`` (hp moves cp with it); the
    other memory options are chosen per layout, so they may differ too."""
    pool = result.ranked + result.too_big
    lay = best.candidate
    if knob == "ring_window" and lay.parallel.cp == 1:
        return None
    mine = _knobs(lay)
    rest = {k: v for k, v in mine.items() if k not in _KNOB_FIELDS[knob]}

    def same_but(e: Estimate) -> bool:
        theirs = _knobs(e.candidate)
        return theirs[knob] != mine[knob] and {k: v for k, v in theirs.items() if k in rest} == rest

    options = sorted((e for e in pool if same_but(e)), key=lambda e: e.step_s)
    if not options:
        return None
    alt = options[0]
    x = alt.candidate
    value = {
        "ring_window": f"ring_window={x.parallel.ring_window}" if x.parallel.ring_window > 1 else "a plain ring",
        "placement": x.parallel.placement,
        "checkpoint": f"checkpoint {x.checkpoint}",
        "zero": f"ZeRO scope {x.zero}",
        "hp": f"hp={x.parallel.hp}, cp={x.parallel.cp}",
    }[knob]
    if not alt.fits:
        if alt.step_s < best.step_s:
            return (
                f"{label}: {value} would take {_ms(alt.step_s)} but needs {alt.memory.total / GiB:.1f} GiB "
                f"> {alt.memory_limit / GiB:.1f} GiB"
            )
        return f"{label}: {value} does not fit ({alt.memory.total / GiB:.1f} GiB)"
    slower = alt.step_s / best.step_s - 1
    return f"{label}: {value} is {slower:.1%} slower ({_main_difference(best, alt)})"


def memory_options_line(best: Estimate) -> str:
    """What the winner's memory options cost and why it needs them."""
    mem = best.candidate.memory
    used = []
    if mem.mlp_tile:
        used.append(f"MLP tiles of {mem.mlp_tile} tokens")
    if mem.offload_activations:
        used.append("activation offload")
    if mem.offload_states:
        used.append("model states on the host (CPU AdamW)")
    loss = f"loss in chunks of {mem.loss_chunk} tokens" if mem.loss_chunk else "the whole shard's logits at once"
    if mem.activation_checkpoint_layers:
        loss += (
            f"; {mem.activation_checkpoint} on the first {mem.activation_checkpoint_layers} layers only, the fewest "
            f"that fit (the others keep their activations and recompute nothing)"
        )
    if not used:
        return f"memory: {loss}; no tiling or offload needed (peak in the {best.memory.phase} phase)"
    host = (
        f", {best.host_per_node / GiB:.0f} of {best.host_limit / GiB:.0f} GiB host memory per node"
        if best.host_per_node
        else ""
    )
    return (
        f"memory: {loss}; needs {', '.join(used)} to fit (peak in the {best.memory.phase} phase{host}); "
        f"offload exposes {_ms(best.offload_s)} per step"
    )


def explain(result: SearchResult) -> list[str]:
    """Short lines on why ``result.best`` wins."""
    best = result.best
    lay = best.candidate
    lines = [
        f"{lay.label()}: {_ms(best.step_s)} per step = compute {_ms(best.compute_s)} + all-to-all "
        f"{_ms(best.a2a_s)} + exposed ring {_ms(best.ring_s)} + ZeRO {_ms(best.zero_s)}"
        + (f" + offload {_ms(best.offload_s)}" if best.offload_s else "")
        + f"; {best.memory.total / GiB:.1f} of {best.memory_limit / GiB:.1f} GiB",
        f"placement: {describe_topology(best.topology, lay.parallel.hp, lay.parallel.cp, lay.parallel.ring_window)}",
        memory_options_line(best),
    ]
    close = [e for e in result.ranked[1:] if e.step_s <= best.step_s * 1.01]
    if close:
        lines.append(
            f"{len(close)} other layout(s) are within 1% (below the model's accuracy), e.g. "
            + "; ".join(e.candidate.label() for e in close[:2])
        )
    for name, base in result.baselines.items():
        if base is None:
            lines.append(f"vs {name}: no layout of that family is valid and fits")
        elif base.candidate == lay:
            lines.append(f"vs {name}: the winner is in that family")
        else:
            lines.append(
                f"vs {name} (best {base.candidate.label()}): {base.step_s / best.step_s:.2f}x the time "
                f"({_main_difference(best, base)})"
            )
    for knob, label in (
        ("hp", "head/context split"),
        ("ring_window", "double ring"),
        ("placement", "placement"),
        ("checkpoint", "checkpointing"),
        ("zero", "ZeRO"),
    ):
        line = _variant_line(result, best, knob, label)
        if line:
            lines.append(line)
    return lines
