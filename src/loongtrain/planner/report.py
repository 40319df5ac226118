"""Plan results as a text table or JSON. Pure."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

from loongtrain.model.config import PRESETS
from loongtrain.planner.cost import Candidate, Workload
from loongtrain.planner.estimate import Estimate
from loongtrain.planner.explain import explain
from loongtrain.planner.search import BASELINES, SearchResult, listed_form

GiB = 2**30

HEADER = (
    f"{'#':>3s} {'dp':>3s} {'hp':>3s} {'cp':>4s} {'w':>3s} {'placement':13s} {'zero':5s} {'ckpt':4s} "
    f"{'memory options':30s} {'step s':>8s} {'tok/s/dev':>9s} {'MFU':>6s} {'mem GiB':>7s} {'compute':>8s} "
    f"{'a2a':>7s} {'ring':>7s} {'zero':>6s} {'offload':>7s}"
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
    x, p = e.candidate, e.candidate.parallel
    ring_window = "-" if p.cp == 1 else str(p.ring_window)
    return (
        f"{index!s:>3s} {p.dp:3d} {p.hp:3d} {p.cp:4d} {ring_window:>3s} {p.placement:13s} {x.zero:5s} "
        f"{x.checkpoint:4s} {x.options_label():30s} "
        f"{e.step_s:8.3g} {e.tokens_per_s_per_device:9.4g} {e.mfu:6.1%} {e.memory.total / GiB:7.1f} "
        f"{e.compute_s:8.3g} {e.a2a_s:7.3g} {e.ring_s:7.3g} {e.zero_s:6.2g} {e.offload_s:7.2g}"
    )


def candidate_dict(x: Candidate) -> dict:
    """A candidate as flat plain data: the parallel degrees, the ZeRO scope, the memory options."""
    p = x.parallel
    return {
        "dp": p.dp,
        "hp": p.hp,
        "cp": p.cp,
        "ring_window": p.ring_window,
        "placement": p.placement,
        "zero": x.zero,
        **{f.name: getattr(x.memory, f.name) for f in fields(x.memory)},
    }


def row_dict(e: Estimate) -> dict:
    """One estimate as plain data (seconds per step, GiB)."""
    mem = e.memory
    return {
        **candidate_dict(e.candidate),
        "step_s": e.step_s,
        "tokens_per_s_per_device": e.tokens_per_s_per_device,
        "mfu": e.mfu,
        "memory_gib": mem.total / GiB,
        "memory_breakdown_gib": {
            "states": mem.states / GiB,
            "gathered": mem.gathered / GiB,
            "activations": mem.activations / GiB,
            "working": mem.working / GiB,
        },
        "memory_phase": mem.phase,
        "memory_terms_gib": {name: value / GiB for name, value in mem.terms},
        "host_gib_per_node": e.host_per_node / GiB,
        "fits": e.fits,
        "compute_s": e.compute_s,
        "a2a_s": e.a2a_s,
        "ring_s": e.ring_s,
        "zero_s": e.zero_s,
        "offload_s": e.offload_s,
        "microbatches": e.microbatches,
    }


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


def train_config(e: Estimate, w: Workload, model: str) -> str:
    """The ``loongtrain train`` config of the plan ``e`` (``[model]``, ``[parallel]``, ``[memory]``,
    ``[data]``), as TOML to paste. ``model`` is a preset name or a Hugging Face folder (``init_from``)."""
    x, p, m = e.candidate, e.candidate.parallel, e.candidate.memory
    sections = {
        "model": {"preset": model} if model in PRESETS else {"init_from": str(Path(model).resolve())},
        "parallel": {
            "hp": p.hp,
            "cp": p.cp,
            "ring_window": p.ring_window,
            "placement": p.placement,
            "zero": x.zero,
            "param_dtype": "bfloat16",
        },
        "memory": {
            "activation_checkpoint": m.activation_checkpoint,
            "activation_checkpoint_layers": m.activation_checkpoint_layers,
            "loss_chunk": m.loss_chunk,
            "mlp_tile": m.mlp_tile,
            "head_groups": m.head_groups,
            "activation_checkpoint_span": m.activation_checkpoint_span,
            "offload_activations": m.offload_activations,
            "offload_states": m.offload_states,
        },
        "data": {"seq_len": w.seq_len, "global_batch": w.batch, "micro_batches": w.batch // (p.dp * w.micro_batch)},
    }
    if w.float8:
        sections["float8"] = {
            "enabled": True, "recipe_name": w.float8, "enable_fsdp_float8_all_gather": w.float8_all_gather,
            "precompute_float8_dynamic_scale_for_fsdp": w.float8_all_gather,
        }  # fmt: skip
    lines = [
        f"# loongtrain train config for this plan: {x.devices} processes (dp = {p.dp} derived from the world);",
        '# the planner assumes bf16 compute (param_dtype = "bfloat16"; the trainer\'s default is float32)',
    ]
    for name, keys in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {_toml(value)}" for key, value in keys.items()]
    return "\n".join(lines)


@dataclass(frozen=True)
class LayoutStanding:
    """Where a ``--layout`` stands beside the searched layouts.

    ``rank``: its place among the searched layouts that fit (1 + those faster), None when it
    does not fit; ``text``: that, in words, with the memory it needs; ``searched``: the search's
    estimate of the same layout (degrees, ZeRO shards, checkpoint mode) with the memory options
    the search picked, and ``searched_rank`` its row (None: it does not fit either); ``note``: why
    the layout as asked is not itself a searched row, or how the search writes it (None: nothing to add)."""

    rank: int | None
    text: str
    searched: Estimate | None = None
    searched_rank: int | None = None
    note: str | None = None


def _misfit(e: Estimate) -> str:
    """Why ``e`` does not fit, with the amounts."""
    if e.blocked is not None:
        return f"cannot run on this cluster: {e.blocked}"
    if e.memory.total > e.memory_limit:
        return f"needs {e.memory.total / GiB:.1f} GiB per device, more than the usable {e.memory_limit / GiB:.1f} GiB"
    return (
        f"pins {e.host_per_node / GiB:.1f} GiB of host memory per node, more than the usable "
        f"{e.host_limit / GiB:.1f} GiB"
    )


def _searched_as(asked: Candidate, listed: Candidate) -> list[str]:
    """The settings of ``asked`` that the search writes another way (the same layout)."""
    a, b, p = asked.parallel, listed.parallel, asked.parallel
    out = []
    if asked.zero != listed.zero:
        out.append(f"zero={asked.zero} as zero={listed.zero} (the same shards at dp={p.dp}, sp={p.sp})")
    if a.ring_window != b.ring_window:
        out.append(f"ring_window={a.ring_window} as ring_window=1 (the same ring of cp={p.cp})")
    if a.placement != b.placement:
        out.append(f"placement={a.placement} as {b.placement} (the same groups when hp or cp is 1)")
    return out


def layout_standing(result: SearchResult, chosen: Estimate) -> LayoutStanding:
    """Rank ``chosen`` (a ``--layout``) beside ``result``'s searched layouts and say truly why
    it is or is not one of them: the search lists equivalent settings one way and picks the
    memory options of each layout itself, so a layout asked with other options is priced as
    asked and ranked by its time."""
    n = len(result.ranked)
    asked = chosen.candidate
    listed = listed_form(asked)

    def same_layout(x: Candidate) -> bool:  # the memory options beyond the checkpoint mode aside
        return (x.parallel, x.zero, x.checkpoint) == (listed.parallel, listed.zero, listed.checkpoint)

    searched = next((e for e in [*result.ranked, *result.too_big] if same_layout(e.candidate)), None)
    searched_rank = next((i + 1 for i, e in enumerate(result.ranked) if e is searched), None)
    as_searched = _searched_as(asked, listed)
    if not chosen.fits:
        text = f"does not fit: {_misfit(chosen)}"
        note = None
        if searched_rank is not None:
            note = f"the search fits this layout with the memory options it picks: row {searched_rank}"
        elif searched is not None and searched.candidate != listed:
            note = "nor does it fit with the memory options the search picks (the row marked -)"
        return LayoutStanding(None, text, searched, searched_rank, note)
    if searched is not None and searched.candidate == listed and searched_rank is not None:
        note = f"a searched row: the search lists {', '.join(as_searched)}" if as_searched else None
        return LayoutStanding(searched_rank, f"rank {searched_rank} of {n}", searched, searched_rank, note)
    key = (chosen.step_s, chosen.memory.total)
    rank = 1 + sum(1 for e in result.ranked if (e.step_s, e.memory.total) < key)
    text = (
        f"fits: {chosen.memory.total / GiB:.1f} of {chosen.memory_limit / GiB:.1f} GiB per device; "
        f"rank {rank} beside the {n} searched layouts that fit"
    )
    why = [f"lists {', '.join(as_searched)}"] if as_searched else []
    if searched is None:
        why.append("does not enumerate this layout")
    else:
        where = f"row {searched_rank}" if searched_rank is not None else "the row marked -, which does not fit"
        why.append(
            f"picks each layout's memory options itself ({where}: {searched.candidate.options_label()}, where "
            f"--layout asks {asked.options_label()})"
        )
    note = "not itself a searched row: the search " + " and ".join(why)
    return LayoutStanding(rank, text, searched, searched_rank, note)


def layout_lines(result: SearchResult, chosen: Estimate) -> list[str]:
    """The ``--layout`` block of the text report: its standing, its row (and the search's row of
    the same layout when that is another), and why it is not a searched row."""
    standing = layout_standing(result, chosen)
    ratio = chosen.step_s / result.best.step_s
    lines = [f"--layout ({standing.text}; {ratio:.2f}x the winner's time):", HEADER, row_text("*", chosen)]
    if standing.searched is not None and standing.searched.candidate != listed_form(chosen.candidate):
        lines.append(row_text(standing.searched_rank or "-", standing.searched))
    if standing.note:
        lines.append(standing.note)
    return lines


def layout_dict(result: SearchResult, chosen: Estimate) -> dict:
    """The ``--layout`` estimate as plain data, with its rank (None: it does not fit), the same
    words as the text report, and the search's estimate of the same layout."""
    standing = layout_standing(result, chosen)
    searched = standing.searched
    return {
        **row_dict(chosen),
        "rank": standing.rank,
        "standing": standing.text,
        "note": standing.note,
        "searched": None if searched is None else {**row_dict(searched), "rank": standing.searched_rank},
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
    lines += ["", train_config(result.best, w, model_name)]
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
        "train_config": train_config(result.best, w, model_name),
    }


SWEEP_HEADER = (
    f"{'seq':>5s} {'dev':>4s}  {'loongtrain layout':44s} {'step s':>7s} {'tok/s/dev':>9s} {'MFU':>6s} "
    f"{'mem GiB':>7s} {'a2a':>6s} {'ring':>6s} | {'Ulysses':>7s} {'Megatron':>8s} {'USP 2D':>7s}"
)


def short_label(x: Candidate) -> str:
    """``dp2 hp8 cp4 ring hf dp_sp sc++`` (+ tiling and offload when used)."""
    p, m = x.parallel, x.memory
    ring = "" if p.cp == 1 else (" ring" if p.ring_window == 1 else f" w{p.ring_window}")
    place = "" if p.hp == 1 or p.cp == 1 else (" hf" if p.placement == "head_first" else " cf")
    dp = f"dp{p.dp} " if p.dp > 1 else ""
    extra = (" tile" if m.mlp_tile else "") + (" offA" if m.offload_activations else "")
    extra += " offS" if m.offload_states else ""
    extra += f" heads/{m.head_groups}" if m.head_groups > 1 else ""
    extra += f" span{m.activation_checkpoint_span}" if m.activation_checkpoint_span > 1 else ""
    extra += f" first{m.activation_checkpoint_layers}" if m.activation_checkpoint_layers else ""
    return f"{dp}hp{p.hp} cp{p.cp}{ring}{place} {x.zero} {x.checkpoint}{extra}"


def sweep_row(result: SearchResult) -> str:
    """One line per (sequence length, devices): the winner and the baselines' best MFU."""
    best = result.best
    mfus = [f"{e.mfu:.1%}" if e is not None else "-" for e in result.baselines.values()]
    label = short_label(best.candidate)
    return (
        f"{format_length(result.workload.seq_len):>5s} {result.devices:4d}  {label:44s} {best.step_s:7.3g} "
        f"{best.tokens_per_s_per_device:9.4g} {best.mfu:6.1%} {best.memory.total / GiB:7.1f} {best.a2a_s:6.2g} "
        f"{best.ring_s:6.2g} | {mfus[0]:>7s} {mfus[1]:>8s} {mfus[2]:>7s}"
    )


def _limiting_line(e: Estimate | None) -> str:
    """The leanest layout one unit longer: its largest memory terms."""
    if e is None:
        return ""
    terms = sorted(((v, k) for k, v in e.memory.terms if v > 0), reverse=True)[:4]
    parts = ", ".join(f"{k} {v / GiB:.1f}" for v, k in terms)
    return f"{e.candidate.label()}: {e.memory.total / GiB:.1f} GiB in the {e.memory.phase} phase ({parts} GiB)"


def max_seq_len_text(answer, model_name: str) -> str:
    """``--max-seq-len``: the length, the layout and options, throughput, and what stops a longer one."""
    result = answer.result
    best, c, w = result.best, result.cluster, result.workload
    lines = [
        f"loongtrain plan --max-seq-len: {model_name} on {result.devices} devices of '{c.name}' ({c.description})",
        f"longest sequence that trains: {format_length(w.seq_len)} tokens ({w.seq_len}; multiples of {answer.unit} "
        f"searched, one sequence per step; {answer.lengths_tried} lengths in {answer.elapsed_s:.1f} s)",
        f"layout: {best.candidate.label()}",
        f"predicted: {best.step_s:.3g} s per step, {best.tokens_per_s_per_device:.4g} tokens/s per device, "
        f"MFU {best.mfu:.1%}; {best.memory.total / GiB:.1f} of {best.memory_limit / GiB:.1f} GiB per device "
        f"(peak in the {best.memory.phase} phase), {best.host_per_node / GiB:.0f} of {best.host_limit / GiB:.0f} GiB "
        "host memory per node",
        f"{format_length(w.seq_len + answer.unit)} does not fit: {answer.limit}",
    ]
    if answer.limiting is not None:
        lines.append(f"  leanest layout there: {_limiting_line(answer.limiting)}")
    lines += ["", "why this layout:"] + [f"  - {line}" for line in explain(result)]
    lines += ["", train_config(best, w, model_name)]
    return "\n".join(lines)


def max_seq_len_json(answer, model_name: str) -> dict:
    """``--max-seq-len`` as plain data."""
    result = answer.result
    return {
        "model": model_name,
        "devices": result.devices,
        "cluster": result.cluster.name,
        "max_seq_len": result.workload.seq_len,
        "unit": answer.unit,
        "best": row_dict(result.best),
        "limit": answer.limit,
        "limiting": row_dict(answer.limiting) if answer.limiting is not None else None,
        "lengths_tried": answer.lengths_tried,
        "elapsed_s": answer.elapsed_s,
        "train_config": train_config(result.best, result.workload, model_name),
    }


def precision_rows(bf16: Estimate, fp8: Estimate, recipe: str) -> list[dict]:
    """One layout in bf16 and with float8 linears (``plan --float8``): step time, tokens/s per
    device, MFU (of the bf16 peak), compute and exposed ZeRO seconds, peak memory."""
    rows = []
    for name, e in (("bf16", bf16), (f"float8 {recipe}", fp8)):
        rows.append({
            "precision": name, "step_s": e.step_s, "tokens_per_s_per_device": e.tokens_per_s_per_device,
            "mfu": e.mfu, "compute_s": e.compute_s, "zero_s": e.zero_s, "memory_gib": e.memory.total / GiB,
            "fits": e.fits, "blocked": e.blocked,
        })  # fmt: skip
    return rows


def precision_text(rows: list[dict]) -> str:
    """:func:`precision_rows` as a small table (float8's speed-up over bf16 last)."""
    lines = ["bf16 vs float8 linears, the same layout (MFU of the bf16 peak):"]
    lines.append(
        f"  {'precision':<28s} {'step s':>9s} {'tok/s/dev':>10s} {'MFU':>6s} {'compute':>9s} {'zero':>7s} {'GiB':>6s}"
    )
    for r in rows:
        lines.append(
            f"  {r['precision']:<28s} {r['step_s']:9.3f} {r['tokens_per_s_per_device']:10.0f} {r['mfu']:6.1%} "
            f"{r['compute_s']:9.3f} {r['zero_s']:7.3f} {r['memory_gib']:6.1f}"
            + (f"  ({r['blocked']})" if r["blocked"] else "")
        )
    lines.append(
        f"  float8 / bf16 tokens/s: {rows[1]['tokens_per_s_per_device'] / rows[0]['tokens_per_s_per_device']:.2f}x"
    )
    return "\n".join(lines)
