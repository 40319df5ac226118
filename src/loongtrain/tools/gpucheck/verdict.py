"""The end of a GPU run (``scripts/gpu_run.sh``): what comes back from the lent machine, and the
verdict, one line per goal: what was measured, the target, met or not.

    python -m loongtrain.tools.gpucheck.verdict OUT

reads ``OUT/gpu_check.jsonl`` and ``OUT/peer.jsonl``, the rows the GPU check and the peer benchmark
wrote as they finished (a run killed by its timeout is read as far as it got, a line cut by the
kill dropped); writes ``OUT/gpu_check.json`` from the JSON lines where the check did not finish
(what ``loongtrain plan --calibrate-gpu`` reads); checks that OUT fits what comes back
(:data:`LIMITS`); prints the rows that failed, then the verdict table, the last lines of the run.
Exit status 1 where a row failed or OUT does not fit. Pure Python (no torch): it runs whatever
became of the runs before it.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from loongtrain.planner.report import format_length
from loongtrain.tools.gpucheck.goals import (
    DENSE_GOAL,
    DOCUMENTS_GOAL,
    PEAK_GIB_GOAL,
    PEER_GOAL,
    PLANNER_GOAL,
    POLICY_MEMORY_GOAL,
    REPLAY_GOAL,
    SAME_LOSS_RTOL,
    TOKENS_GOAL,
)

MiB = 2**20
CHECK_LINES, CHECK_REPORT, PEER_LINES = "gpu_check.jsonl", "gpu_check.json", "peer.jsonl"
SHORT, LONG = 32768, 131072  # the goals' lengths
#: Where the goals are judged: the GPU run; elsewhere (the CPU dry run) the numbers are shown only.
JUDGED_ON = "cuda"
MET, MISSED, FAILED, NOT_RUN, SHOWN = "met", "MISSED", "FAIL", "not run", "measured"
MAX_FAIL_LINES = 8


@dataclass(frozen=True)
class Limits:
    """What comes back from the GPU machine's ``$OUT`` (and of its output), at most."""

    files: int = 8
    file_bytes: int = 16 * MiB
    total_bytes: int = 64 * MiB
    depth: int = 2  # folders between OUT and a file: OUT/a/b/file comes back, OUT/a/b/c/file does not
    output_chars: int = 12_000  # the last characters of the command's output


LIMITS = Limits()
NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def return_problems(folder: Path, limits: Limits = LIMITS) -> list[str]:
    """What in ``folder`` would not come back from the GPU machine, one sentence each (empty: all)."""
    entries = sorted(p for p in folder.rglob("*") if p.is_symlink() or not p.is_dir())
    problems, total = [], 0
    for path in entries:
        rel = path.relative_to(folder)
        if len(rel.parts) - 1 > limits.depth:
            problems.append(f"{rel}: deeper than {limits.depth} folders")
        if not all(NAME.match(part) for part in rel.parts):
            problems.append(f"{rel}: a name with characters other than letters, digits, '.', '_', '-'")
        if path.is_symlink() or not path.is_file():
            problems.append(f"{rel}: not a plain file")
            continue
        size = path.stat().st_size
        total += size
        if size > limits.file_bytes:
            problems.append(f"{rel}: {size / MiB:.1f} MiB, over {limits.file_bytes / MiB:.0f} MiB")
    if len(entries) > limits.files:
        problems.append(f"{len(entries)} files, over {limits.files}")
    if total > limits.total_bytes:
        problems.append(f"{total / MiB:.1f} MiB in all, over {limits.total_bytes / MiB:.0f} MiB")
    return problems


def read_lines(path: Path) -> dict | None:
    """A run's JSON lines: ``{"header": first line, "rows": [...], "end": the end line's value or None
    (killed), "t_s": the last row's time}``; None where there is no file. A line cut short by a kill
    is dropped."""
    if not path.is_file():
        return None
    header, rows, end, t_s = {}, [], None, None
    for i, line in enumerate(path.read_text().splitlines()):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if i == 0 and "row" not in obj:
            header = obj
        elif "row" in obj:
            rows.append(obj["row"])
            t_s = obj.get("t_s", t_s)
        elif "end" in obj:
            end = obj["end"]
    return {"header": header, "rows": rows, "end": end, "t_s": t_s}


def report_from_lines(lines: dict) -> dict:
    """The GPU check's JSON report (what ``--json`` writes) from its JSON lines; ``complete`` False
    where the check was killed before its end."""
    rows = lines["rows"]
    return {
        "profile": lines["header"].get("profile"),
        "environment": lines["header"].get("environment", {}),
        "failures": sum(r["status"] == FAILED for r in rows),
        "complete": lines["end"] is not None,
        "rows": rows,
    }


@dataclass(frozen=True)
class Goal:
    """One line of the verdict."""

    goal: str
    measured: str
    target: str
    verdict: str


def _rows(lines: dict | None, section: str | None = None) -> list[dict]:
    rows = lines["rows"] if lines else []
    return [r for r in rows if section is None or r.get("section") == section]


def _device(lines: dict | None) -> str:
    env = (lines or {}).get("header", {}).get("environment", {})
    return str(env.get("device", ""))


def _judge(ok: bool, judged: bool) -> str:
    return (MET if ok else MISSED) if judged else SHOWN


def _status(row: dict | None) -> str:
    """A correctness row's verdict."""
    if row is None or row["status"] == "skipped":
        return NOT_RUN
    return MET if row["status"] == "pass" else FAILED


def _why_not(row: dict | None) -> str:
    return row["result"][:70] if row is not None else "no row (not reached, or killed)"


class _Lengths:
    """The goals' lengths as the run measured them: themselves on the GPU; on the CPU dry run the
    shortest and the longest length each kind of row has (the goals are not judged there)."""

    def __init__(self, judged: bool) -> None:
        self.judged = judged

    def pick(self, goal_length: int, present: list[int]) -> int | None:
        if self.judged:
            return goal_length if goal_length in present else None
        if not present:
            return None
        return min(present) if goal_length == SHORT else max(present)


def _training(check: dict | None, peer: dict | None, seq: int | None, mode: str) -> tuple[dict | None, str]:
    """The measured training row of ``seq`` tokens and checkpoint ``mode`` (eager): the GPU check's,
    else the peer benchmark's; and which."""
    if seq is None:
        return None, ""
    for r in _rows(check, "training"):
        v = r["values"]
        if v.get("seq") == seq and v.get("checkpoint") == mode and not v.get("compiled") and "tokens_per_s" in v:
            return v, "check"
    for r in _rows(peer):
        if r.get("length") == seq and r["who"].split(" (")[0] == f"loongtrain {mode}" and r.get("tokens_per_s"):
            return r, "peer"
    return None, ""


def _train_lengths(check: dict | None, peer: dict | None) -> list[int]:
    seqs = {r["values"].get("seq") for r in _rows(check, "training")} | {r.get("length") for r in _rows(peer)}
    return sorted(s for s in seqs if s)


def _correctness(check: dict | None) -> list[Goal]:
    if check is None:
        return [Goal("GPU check ran", "no gpu_check.jsonl", "every row", NOT_RUN)]
    rows = _rows(check)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", FAILED, "skipped")}
    if check["end"] is not None:
        ended = Goal("GPU check ran to its end", f"in {check['end'].get('elapsed_s', 0):.0f} s", "inside its timeout",
                     MET)  # fmt: skip
    else:
        last = rows[-1]["case"][:36] if rows else "nothing"
        ended = Goal("GPU check ran to its end", f"killed after {last!r} at {check['t_s'] or 0:.0f} s",
                     "inside its timeout", MISSED)  # fmt: skip
    measured = f"{counts['pass']} pass, {counts[FAILED]} FAIL, {counts['skipped']} skipped"
    verdict = FAILED if counts[FAILED] else MET
    kernels = _rows(check, "kernels")
    ok = sum(r["status"] == "pass" for r in kernels)
    kernel_verdict = NOT_RUN if not kernels else (MET if ok == len(kernels) else FAILED)
    goals = [
        ended,
        Goal("correctness rows of the GPU check", measured, "0 FAIL", verdict),
        Goal("kernels vs float64", f"{ok} of {len(kernels)} rows within bounds", "every row", kernel_verdict),
    ]
    offload = next((r for r in _rows(check, "memory") if "offload activations" in r["case"]), None)
    if offload is not None and "max_rel_diff" in offload["values"]:
        v = offload["values"]
        measured = f"max rel diff {v['max_rel_diff']:.1e} over {len(v['losses'])} steps, finite {v['finite']}"
    else:
        measured = _why_not(offload)
    target = f"finite, <= {SAME_LOSS_RTOL:g} of no offload"
    goals.append(Goal("offload: every step's loss (step-3 NaN)", measured, target, _status(offload)))
    packed = next((r for r in _rows(check, "memory") if "packed documents" in r["case"]), None)
    if packed is not None and "rel_diff" in packed["values"]:
        measured = f"rel diff {packed['values']['rel_diff']:.1e}, {packed['values']['documents']} documents"
    else:
        measured = _why_not(packed)
    goals.append(Goal("packed documents: loss = separate", measured, f"<= {SAME_LOSS_RTOL:g}", _status(packed)))
    return goals


def _speed(check: dict | None, lengths: _Lengths) -> list[Goal]:
    goals = []
    dense = {r["values"]["seq"]: r for r in _rows(check, "speed") if "ratio_to_fastest" in r["values"]}
    seq = lengths.pick(SHORT, list(dense))
    row = dense.get(seq) if seq else None
    ratio = row["values"]["ratio_to_fastest"] if row else None
    name = f"chosen kernel / fastest SDPA, {format_length(seq or SHORT)}"
    if ratio is None:
        goals.append(Goal(name, _why_not(row) if row else "no row", f"<= {DENSE_GOAL:.2f}x", NOT_RUN))
    else:
        fastest = row["values"]["fastest_sdpa"]
        goals.append(Goal(name, f"{ratio:.2f}x ({fastest})", f"<= {DENSE_GOAL:.2f}x",
                          _judge(ratio <= DENSE_GOAL, lengths.judged)))  # fmt: skip
    documents = {r["values"]["seq"]: r["values"] for r in _rows(check, "speed") if "speedup" in r["values"]}
    for goal_len, goal in DOCUMENTS_GOAL.items():
        seq = lengths.pick(goal_len, list(documents))
        v = documents.get(seq) if seq else None
        name = f"packed documents speed-up, {format_length(seq or goal_len)}"
        target = f">= {goal:g}x, peak <= one sequence's"
        if v is None:
            goals.append(Goal(name, "no row", target, NOT_RUN))
            continue
        ok = v["speedup"] >= goal and v["packed_peak_bytes"] <= v["one_sequence_peak_bytes"]
        measured = f"{v['speedup']:.2f}x, peak {v['packed_peak_bytes'] / 2**30:.3g} GiB"
        goals.append(Goal(name, measured, target, _judge(ok, lengths.judged)))
    replay = [r["values"] for r in _rows(check, "replay") if "ratio" in r["values"]]
    seq = lengths.pick(SHORT, sorted({v["seq"] for v in replay}))
    at = [v for v in replay if v["seq"] == seq]
    name = f"replay overhead, {format_length(seq or SHORT)} (worst)"
    if not at:
        goals.append(Goal(name, "no row", f"<= {REPLAY_GOAL:.2f}x", NOT_RUN))
    else:
        worst = max(at, key=lambda v: v["ratio"])
        measured = f"{worst['ratio']:.3f}x at cp {worst.get('cp', '?')} window {worst.get('ring_window', '?')}"
        goals.append(Goal(name, measured, f"<= {REPLAY_GOAL:.2f}x", _judge(worst["ratio"] <= REPLAY_GOAL,
                                                                          lengths.judged)))  # fmt: skip
    return goals


def _row_goal(name: str, target: str, found: tuple[dict | None, str], judged: bool, measure) -> Goal:
    """A goal read off one training row: ``found`` is ``(row values or None, where)``;
    ``measure(values, where)`` gives ``(measured text, met)``, or a reason it cannot be judged."""
    v, where = found
    result = "no row" if v is None else measure(v, where)
    if isinstance(result, str):
        return Goal(name, result, target, NOT_RUN)
    text, met = result
    return Goal(name, text, target, _judge(met, judged))


def _training_goals(check: dict | None, peer: dict | None, lengths: _Lengths) -> list[Goal]:
    goals = []
    present = _train_lengths(check, peer)
    for (goal_len, mode), goal in TOKENS_GOAL.items():
        seq = lengths.pick(goal_len, present)

        def tokens(v, where, goal=goal):
            ceiling = f", {v['of_ceiling']:.0%} of ceiling" if v.get("of_ceiling") else ""
            return f"{v['tokens_per_s']:,.0f} ({where}{ceiling})", v["tokens_per_s"] >= goal

        name = f"tok/s {mode}, {format_length(seq or goal_len)}"
        goals.append(_row_goal(name, f">= {goal:,}", _training(check, peer, seq, mode), lengths.judged, tokens))
    for (goal_len, mode), goal in PEAK_GIB_GOAL.items():
        seq = lengths.pick(goal_len, present)

        def peak(v, where, goal=goal):
            return f"{v['peak_memory_gib']:.3g} GiB ({where})", v["peak_memory_gib"] <= goal

        name = f"peak memory {mode}, {format_length(seq or goal_len)}"
        goals.append(_row_goal(name, f"<= {goal:g} GiB", _training(check, peer, seq, mode), lengths.judged, peak))
    for goal_len in (SHORT, LONG):
        seq = lengths.pick(goal_len, present)

        def planned(v, where):
            if not v.get("planner"):
                return "no planner prediction"
            ratio = v["peak_memory_gib"] / v["planner"]["memory_gib"]
            return f"{ratio:.3f} ({where})", abs(ratio - 1) <= POLICY_MEMORY_GOAL

        name = f"auto peak / planner's, {format_length(seq or goal_len)}"
        target = f"within {POLICY_MEMORY_GOAL:.0%}"
        goals.append(_row_goal(name, target, _training(check, peer, seq, "auto"), lengths.judged, planned))
    timed = [(r["case"], r["values"]) for r in _rows(check, "training")]
    timed += [(f"peer {r['who']} {format_length(r['length'])}", r) for r in _rows(peer)]
    ratios = [(v["planner"]["step_s"] / v["step_s"], case) for case, v in timed
              if v.get("planner") and v.get("step_s")]  # fmt: skip
    name, target = "planner's step / measured (worst)", f"within {PLANNER_GOAL:.0%}"
    if not ratios:
        goals.append(Goal(name, "no row with a prediction", target, NOT_RUN))
    else:
        ratio, case = max(ratios, key=lambda rc: abs(rc[0] - 1))
        goals.append(Goal(name, f"{ratio:.2f} ({case.split(':')[0]})", target,  # the row's name, whole
                          _judge(abs(ratio - 1) <= PLANNER_GOAL, lengths.judged)))  # fmt: skip
    compiled = next((r["values"] for r in _rows(check, "training") if r["values"].get("compiled")), None)
    name, target = "compiled / eager auto", "no recompile"
    if compiled is None or "tokens_per_s" not in compiled:
        goals.append(Goal(name, "no row", target, NOT_RUN))
    else:
        c = compiled.get("compile") or {}
        gain = compiled.get("gain_over_eager")
        measured = (f"{gain:.2f}x" if gain else "no eager row") + f", {c.get('graphs_in_timed_steps', '?')} recompiles"
        goals.append(Goal(name, measured, target, _judge(c.get("graphs_in_timed_steps") == 0, lengths.judged)))
    return goals


def _peer_goals(peer: dict | None, lengths: _Lengths) -> list[Goal]:
    goals = []
    rows = _rows(peer)
    present = sorted({r["length"] for r in rows})
    for goal_len, goal in PEER_GOAL.items():
        seq = lengths.pick(goal_len, present)
        name = f"loongtrain auto / transformers ckpt, {format_length(seq or goal_len)}"
        ours = next((r for r in rows if r["length"] == seq and r["who"].startswith("loongtrain auto")), None)
        theirs = next((r for r in rows if r["length"] == seq and r["who"] == "transformers ckpt"), None)
        if not (ours and theirs and ours.get("tokens_per_s") and theirs.get("tokens_per_s")):
            missing = [r["who"] + ": " + (r.get("skipped") or r.get("error") or "")[:40] for r in (ours, theirs)
                       if r is not None and not r.get("tokens_per_s")]  # fmt: skip
            goals.append(Goal(name, "; ".join(missing) or "no row", f">= {goal:g}x", NOT_RUN))
            continue
        ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
        measured = f"{ratio:.2f}x ({ours['tokens_per_s']:,.0f} vs {theirs['tokens_per_s']:,.0f} tok/s)"
        goals.append(Goal(name, measured, f">= {goal:g}x", _judge(ratio >= goal, lengths.judged)))
    return goals


def verdict(check: dict | None, peer: dict | None) -> list[Goal]:
    """Every goal of the run, from the GPU check's and the peer benchmark's JSON lines (either may be
    None or cut short by a kill): judged on a GPU, shown as measured elsewhere."""
    judged = JUDGED_ON in (_device(check), _device(peer).split(":")[0])
    lengths = _Lengths(judged)
    goals: list[Goal] = []
    parts = (("correctness", lambda: _correctness(check)), ("training", lambda: _training_goals(check, peer, lengths)),
             ("peer", lambda: _peer_goals(peer, lengths)), ("speed", lambda: _speed(check, lengths)))  # fmt: skip
    for name, part in parts:
        try:
            goals += part()
        except Exception as exc:  # noqa: BLE001 - a row shaped unlike the code expects: said, the rest still judged
            goals.append(Goal(f"{name} goals", f"verdict error: {type(exc).__name__}: {exc}"[:60], "-", FAILED))
    return goals


def format_verdict(goals: list[Goal], width: int = 60) -> str:
    """The goals as a fixed-width table; each cell at most ``width`` characters."""
    cells = [("goal", "measured", "target", "verdict")]
    cells += [(g.goal[:width], g.measured[:width], g.target[:width], g.verdict) for g in goals]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cell, widths)).rstrip() for cell in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    met = sum(g.verdict == MET for g in goals)
    counts = ", ".join(f"{sum(g.verdict == v for g in goals)} {v}" for v in (MISSED, FAILED, NOT_RUN, SHOWN))
    return "\n".join([f"verdict: {met} of {len(goals)} goals met; {counts}", *lines])


def failed_rows(check: dict | None, limit: int = MAX_FAIL_LINES) -> list[str]:
    """One line per failed row of the check (at most ``limit``, then how many more)."""
    failed = [r for r in _rows(check) if r["status"] == FAILED]
    lines = [f"FAIL {r['section']} {r['case'][:60]}: {r['result'][:120]}" for r in failed[:limit]]
    if len(failed) > limit:
        lines.append(f"... and {len(failed) - limit} more failed rows (gpu_check.jsonl)")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Read OUT, write what is missing, print the failed rows and the verdict; 1 where a row failed
    or OUT does not fit what comes back."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print(f"verdict: error: give the run's OUT folder, got {args}", file=sys.stderr)
        return 2
    out = Path(args[0])
    check, peer = read_lines(out / CHECK_LINES), read_lines(out / PEER_LINES)
    if check is not None and not (out / CHECK_REPORT).is_file():
        (out / CHECK_REPORT).write_text(json.dumps(report_from_lines(check), indent=1) + "\n")
        print(f"{CHECK_REPORT} written from {CHECK_LINES} (the check did not end)")
    problems = return_problems(out)
    files = [p for p in out.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files) / MiB
    print(f"what comes back: {len(files)} files, {size:.2f} MiB: " + ("fits" if not problems else "DOES NOT FIT"))
    for line in problems[:MAX_FAIL_LINES]:
        print(f"  {line}")
    fails = failed_rows(check)
    for line in fails:
        print(line)
    goals = verdict(check, peer)
    print(format_verdict(goals), flush=True)
    return 1 if problems or fails or any(g.verdict == FAILED for g in goals) else 0


if __name__ == "__main__":
    raise SystemExit(main())
