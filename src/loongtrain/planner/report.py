"""Plan results as a text table or JSON. Pure."""

from __future__ import annotations

from dataclasses import asdict

from loongtrain.planner.cost import Workload
from loongtrain.planner.estimate import Estimate
from loongtrain.planner.explain import explain
from loongtrain.planner.search import BASELINES, SearchResult

GiB = 2**30

HEADER = (
    f"{'#':>3s} {'dp':>3s} {'hp':>3s} {'cp':>4s} {'w':>3s} {'placement':13s} {'zero':5s} {'ckpt':4s} "
    f"{'step s':>8s} {'tok/s/dev':>9s} {'MFU':>6s} {'mem GiB':>7s} {'compute':>8s} {'a2a':>7s} {'ring':>7s} "
    f"{'zero':>6s}"
)


def format_length(tokens: int) -> str:
    """``131072`` -> ``128K``, ``1048576`` -> ``1M``."""
    for suffix, size in (("M", 2**20), ("K", 2**10)):
        if tokens % size == 0:
            return f"{tokens // size}{suffix}"
    return str(tokens)


def batch_text(w: Workload) -> str:
    """The global batch a report assumed: ``"global batch 4M tokens (32 x 128K sequences)"``."""
    return f"global batch {format_length(w.tokens)} tokens ({w.batch} x {format_length(w.seq_len)} sequences)"


def row_text(index: int | str, e: Estimate) -> str:
    x = e.candidate
    ring_window = "-" if x.cp == 1 else str(x.ring_window)
    return (
        f"{index!s:>3s} {x.dp:3d} {x.hp:3d} {x.cp:4d} {ring_window:>3s} {x.placement:13s} {x.zero:5s} "
        f"{x.checkpoint:4s} "
        f"{e.step_s:8.3g} {e.tokens_per_s_per_device:9.4g} {e.mfu:6.1%} {e.memory.total / GiB:7.1f} "
        f"{e.compute_s:8.3g} {e.a2a_s:7.3g} {e.ring_s:7.3g} {e.zero_s:6.2g}"
    )


def row_dict(e: Estimate) -> dict:
    """One estimate as plain data (seconds per step, GiB)."""
    return {
        **asdict(e.candidate),
        "step_s": e.step_s,
        "tokens_per_s_per_device": e.tokens_per_s_per_device,
        "mfu": e.mfu,
        "memory_gib": e.memory.total / GiB,
        "memory_breakdown_gib": {k: v / GiB for k, v in asdict(e.memory).items()},
        "fits": e.fits,
        "compute_s": e.compute_s,
        "a2a_s": e.a2a_s,
        "ring_s": e.ring_s,
        "zero_s": e.zero_s,
        "microbatches": e.microbatches,
    }


def baseline_gap(result: SearchResult, name: str) -> str:
    """Why a baseline family has no row: nothing valid, or nothing that fits."""
    keep = BASELINES[name]
    too_big = [e for e in result.too_big if keep(e.candidate)]
    if too_big:
        lean = min(too_big, key=lambda e: e.memory.total)
        return f"no layout fits (leanest needs {lean.memory.total / GiB:.1f} GiB)"
    m = result.workload.model
    if name == "DeepSpeed-Ulysses":
        return f"not valid: needs hp = sp dividing H={m.n_heads} (and G={m.n_kv_heads}) with dp = devices / sp"
    return "no valid layout"


def baseline_lines(result: SearchResult) -> list[str]:
    best = result.best
    lines = [f"{'family':18s} {'step s':>8s} {'tok/s/dev':>9s} {'MFU':>6s} {'loongtrain x':>12s}  best layout"]
    lines.append(
        f"{'loongtrain':18s} {best.step_s:8.3g} {best.tokens_per_s_per_device:9.4g} {best.mfu:6.1%} "
        f"{'':>12s}  {best.candidate.label()}"
    )
    for name, e in result.baselines.items():
        if e is None:
            lines.append(f"{name:18s} {'-':>8s} {'-':>9s} {'-':>6s} {'':>12s}  {baseline_gap(result, name)}")
            continue
        speedup = f"{e.step_s / best.step_s:.2f}x"
        lines.append(
            f"{name:18s} {e.step_s:8.3g} {e.tokens_per_s_per_device:9.4g} {e.mfu:6.1%} {speedup:>12s}  "
            f"{e.candidate.label()}"
        )
    return lines


def text_report(result: SearchResult, model_name: str, top: int = 10) -> str:
    """The table of the ``top`` layouts, the baselines' best rows and the explanation."""
    c, w = result.cluster, result.workload
    lines = [
        f"loongtrain plan: {model_name}, {format_length(w.seq_len)} tokens ({w.seq_len}) per sequence, "
        f"{batch_text(w)} per step, on {result.devices} devices of '{c.name}' ({c.devices_per_node} per node; "
        f"{c.description})",
        f"{result.n_candidates} layouts, {len(result.ranked)} fit in {c.usable_memory_bytes / GiB:.1f} GiB per device; "
        f"planned in {result.elapsed_s * 1e3:.0f} ms",
        "",
        "times in seconds per optimizer step; compute = kernels incl. recompute; a2a, ring, zero = exposed",
        HEADER,
    ]
    lines += [row_text(i + 1, e) for i, e in enumerate(result.ranked[:top])]
    lines += [
        "",
        "best of each family, priced by the same model (baselines use checkpoint none or full;",
        "'loongtrain x': loongtrain's speedup over it):",
    ]
    lines += baseline_lines(result)
    lines += ["", "why:"] + [f"  - {line}" for line in explain(result)]
    return "\n".join(lines)


def json_report(result: SearchResult, model_name: str, top: int = 10) -> dict:
    """Machine-readable plan."""
    c, w = result.cluster, result.workload
    return {
        "model": model_name,
        "seq_len": w.seq_len,
        "global_batch_tokens": w.tokens,
        "batch": w.batch,
        "micro_batch": w.micro_batch,
        "devices": result.devices,
        "cluster": asdict(c),
        "candidates": result.n_candidates,
        "feasible": len(result.ranked),
        "elapsed_s": result.elapsed_s,
        "ranked": [row_dict(e) for e in result.ranked[:top]],
        "baselines": {
            name: (row_dict(e) if e is not None else {"unavailable": baseline_gap(result, name)})
            for name, e in result.baselines.items()
        },
        "explanation": explain(result),
    }


SWEEP_HEADER = (
    f"{'seq':>5s} {'dev':>4s}  {'loongtrain layout':44s} {'step s':>7s} {'tok/s/dev':>9s} {'MFU':>6s} "
    f"{'mem GiB':>7s} {'a2a':>6s} {'ring':>6s} | {'Ulysses':>7s} {'Megatron':>8s} {'USP 2D':>7s}"
)


def _short(e: Estimate) -> str:
    x = e.candidate
    ring = "" if x.cp == 1 else (" ring" if x.ring_window == 1 else f" w{x.ring_window}")
    place = "" if x.hp == 1 or x.cp == 1 else (" hf" if x.placement == "head_first" else " cf")
    dp = f"dp{x.dp} " if x.dp > 1 else ""
    return f"{dp}hp{x.hp} cp{x.cp}{ring}{place} {x.zero} {x.checkpoint}"


def sweep_row(result: SearchResult) -> str:
    """One line per (sequence length, devices): the winner and the baselines' best MFU."""
    best = result.best
    mfus = [f"{e.mfu:.1%}" if e is not None else "-" for e in result.baselines.values()]
    return (
        f"{format_length(result.workload.seq_len):>5s} {result.devices:4d}  {_short(best):44s} {best.step_s:7.3g} "
        f"{best.tokens_per_s_per_device:9.4g} {best.mfu:6.1%} {best.memory.total / GiB:7.1f} {best.a2a_s:6.2g} "
        f"{best.ring_s:6.2g} | {mfus[0]:>7s} {mfus[1]:>8s} {mfus[2]:>7s}"
    )
