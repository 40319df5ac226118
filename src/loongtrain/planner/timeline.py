"""Draw simulated timelines (forward and backward of one layer) as a PNG with matplotlib."""

from __future__ import annotations

from pathlib import Path

from loongtrain.planner.simulate import Timeline

COLORS = {
    "fwd diagonal": "#1f4e9c",
    "fwd": "#5b8fd9",
    "bwd diagonal": "#1d6b35",
    "bwd": "#5cb270",
    "kv": "#f0a030",
    "dkv": "#d0453a",
    "all-to-all": "#8a5cc2",
    "exposed": "#bbbbbb",
}
LANES = ("all-to-all", "compute", "inner link", "outer link")


def _color(lane: str, label: str) -> str:
    if lane == "compute":
        phase = label.split()[0]
        return COLORS[f"{phase} diagonal"] if "diagonal" in label else COLORS[phase]
    if lane == "all-to-all":
        return COLORS["all-to-all"]
    return COLORS[label.split()[0]]


def _idle(timeline: Timeline, rank: int) -> list[tuple[float, float]]:
    """Gaps in ``rank``'s compute and all-to-all lanes before the pass ends (exposed waits)."""
    busy = sorted(
        (i.start, i.end) for i in timeline.intervals if i.rank == rank and i.lane in ("compute", "all-to-all")
    )
    gaps, t = [], 0.0
    for start, end in busy:
        if start > t + 1e-12:
            gaps.append((t, start - t))
        t = max(t, end)
    if timeline.makespan > t + 1e-12:
        gaps.append((t, timeline.makespan - t))
    return gaps


def draw_timelines(fwd: Timeline, bwd: Timeline, path: str | Path, title: str, ranks: tuple[int, ...] = (0,)) -> Path:
    """Write a two-panel PNG (forward, backward) of the lanes of ``ranks``; return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    used = [lane for lane in LANES if any(i.lane == lane for t in (fwd, bwd) for i in t.intervals)]
    rows = [(r, lane) for r in ranks for lane in used]
    fig, axes = plt.subplots(2, 1, figsize=(13, 1.2 + 0.55 * len(rows) * 2 + 1.5), squeeze=False)
    for ax, timeline, name in ((axes[0][0], fwd, "forward"), (axes[1][0], bwd, "backward")):
        scale, unit = (1e3, "ms") if timeline.makespan < 1 else (1.0, "s")
        for y, (rank, lane) in enumerate(rows):
            for i in timeline.intervals:
                if i.rank == rank and i.lane == lane:
                    ax.broken_barh(
                        [(i.start * scale, (i.end - i.start) * scale)],
                        (y - 0.38, 0.76),
                        facecolors=_color(lane, i.label),
                        edgecolor="white",
                        linewidth=0.4,
                    )
            if lane == "compute":
                gaps = [(s * scale, d * scale) for s, d in _idle(timeline, rank)]
                ax.broken_barh(gaps, (y - 0.38, 0.76), facecolors="none", edgecolor=COLORS["exposed"], hatch="///")
        exposed = timeline.exposed(ranks[0])
        ax.set_yticks(range(len(rows)), [f"rank c={r}: {lane}" for r, lane in rows])
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xlabel(unit)
        ax.set_title(
            f"{name}: {timeline.makespan * scale:.1f} {unit}, compute {timeline.busy(ranks[0]) * scale:.1f} {unit}, "
            f"exposed {exposed * scale:.1f} {unit} ({exposed / timeline.makespan:.0%})",
            fontsize=10,
        )
        ax.grid(axis="x", alpha=0.3)
    legend = [
        Patch(facecolor=COLORS["fwd diagonal"], label="fwd causal diagonal block"),
        Patch(facecolor=COLORS["fwd"], label="fwd half block"),
        Patch(facecolor=COLORS["bwd diagonal"], label="bwd causal diagonal block"),
        Patch(facecolor=COLORS["bwd"], label="bwd half block"),
        Patch(facecolor=COLORS["kv"], label="KV transfer (sent)"),
        Patch(facecolor=COLORS["dkv"], label="dK/dV transfer (sent)"),
        Patch(facecolor=COLORS["all-to-all"], label="head all-to-all"),
        Patch(facecolor="none", edgecolor=COLORS["exposed"], hatch="///", label="waiting (exposed)"),
    ]
    fig.legend(handles=legend, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
