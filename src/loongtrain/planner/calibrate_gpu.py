"""``loongtrain plan --calibrate-gpu REPORT.json``: the planner's cluster fitted to a GPU check's
measurements (``scripts/gpu_check.sh``) instead of datasheets. Pure: reads the report's JSON.

From the report's ``calibrate`` row (:mod:`loongtrain.tools.gpucheck.calibration`):

- ``matmul_tflops``: one layer's matrix products of the training model, forward and backward;
- ``attn_fwd_tflops`` / ``attn_bwd_tflops``: the chosen kernel on one causal sequence at each
  length measured, through the planner's own block model (its overheads, causal tiles and
  wave efficiency kept), with their fixed times per call: a line through the lengths measured;
- ``hbm_bw_gbs``: a device-to-device copy; ``host_link_gbs``: the slower direction of a pinned
  copy (one device alone); ``host_mem_bw_gbs``: the CPU AdamW step's bytes per second (one
  process on every core of the host).

Then ``layer_token_ns`` (what matmuls and attention kernels leave: norms, RoPE, SwiGLU, casts,
launches) is fitted by least squares to the measured step times of the training rows without
offload, and every training row (offload included) is predicted again beside what was measured.
The result is a cluster file to rerun the planner with (``--cluster FILE``).
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, replace
from pathlib import Path

from loongtrain.model.config import ModelConfig, config_of_shape
from loongtrain.options import MemoryOptions
from loongtrain.parallel.config import ParallelConfig
from loongtrain.planner.cost import BWD_FLOP_RATIO, Candidate, Workload, block_seconds
from loongtrain.planner.estimate import CPU_ADAMW_BYTES_PER_PARAM, estimate
from loongtrain.planner.specs import ClusterSpec, PlanError, cluster_to_toml

GiB = 2**30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: sections of the report whose rows are training steps of one device
TRAINING_SECTIONS = ("training", "memory", "longest")


@dataclass(frozen=True)
class RowCheck:
    """One measured training row beside the calibrated prediction."""

    case: str
    seq: int
    options: MemoryOptions
    measured_s: float
    predicted_s: float
    measured_gib: float
    predicted_gib: float

    @property
    def time_error(self) -> float:
        return self.predicted_s / self.measured_s - 1

    @property
    def memory_error(self) -> float:
        return self.predicted_gib / self.measured_gib - 1 if self.measured_gib > 0 else float("nan")

    @property
    def offloads(self) -> bool:
        return self.options.offload_activations or self.options.offload_states


def read_report(path: str | Path) -> dict:
    """The GPU check's JSON report (``runs/gpu_check.json``), checked to hold what calibration needs."""
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(f"--calibrate-gpu {str(path)!r}: cannot read a GPU check report ({exc})") from None
    env = report.get("environment", {})
    if "train_model" not in env or not _calibration(report):
        raise PlanError(
            f"--calibrate-gpu {str(path)!r}: no calibration row or training model in this report; run "
            "`bash scripts/gpu_check.sh` of this version on the GPU and pass its runs/gpu_check.json"
        )
    return report


def _calibration(report: dict) -> dict | None:
    rows = [r for r in report.get("rows", []) if r.get("section") == "calibrate" and r.get("status") != "FAIL"]
    return rows[0]["values"] if rows and rows[0].get("values") else None


def _workload(model: ModelConfig, seq: int, dtype_bytes: int) -> Workload:
    return Workload(model, seq, batch=1, micro_batch=1, dtype_bytes=dtype_bytes)


def _one_device(options: MemoryOptions) -> Candidate:
    return Candidate(ParallelConfig(dp=1), "dp_sp", options)


def _line(x: list[float], y: list[float], intercept: float) -> tuple[float, float]:
    """``(intercept, slope)`` of ``y = intercept + slope * x`` by least squares, the intercept
    between 0 and half the smallest ``y``; with one point, ``intercept`` kept (so bounded)."""
    if len(x) > 1:
        mx, my = sum(x) / len(x), sum(y) / len(y)
        sxx = sum((a - mx) ** 2 for a in x)
        slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx if sxx > 0 else my / mx
        intercept = my - slope * mx
    intercept = min(max(intercept, 1e-6), 0.5 * min(y))  # at least 1 us: a call is never free
    slope = sum(a * (b - intercept) for a, b in zip(x, y)) / sum(a * a for a in x)
    return intercept, slope


def _attention_fit(c: ClusterSpec, model: ModelConfig, dtype_bytes: int, measured: list[dict]) -> dict[str, float]:
    """The planner's one-device block model (its causal tiles and wave efficiency kept) fitted to
    the measured kernel times: per pass, ``time = overhead + work / rate`` over the lengths."""
    work_fwd, work_bwd, t_fwd, t_bwd = [], [], [], []
    for m in measured:
        shape = replace(model, n_heads=m["heads"], n_kv_heads=m["kv_heads"], head_dim_override=m["head_dim"])
        t = block_seconds(c, _workload(shape, m["seq"], dtype_bytes), 1, 1)
        # the block's work in TFLOP at its efficiency: the model's time without overhead, times its rate
        work_fwd.append((t.kernel_fwd_first - c.kernel_overhead_us * 1e-6) * c.attn_fwd_tflops)
        work_bwd.append((t.kernel_bwd_first - c.bwd_overhead_us * 1e-6) * c.attn_bwd_tflops)
        t_fwd.append(m["fwd_s"])
        t_bwd.append(m["bwd_s"] if "bwd_s" in m else m["fwd_bwd_s"] - m["fwd_s"])  # older reports: no bwd_s
    o_fwd, a_fwd = _line(work_fwd, t_fwd, c.kernel_overhead_us * 1e-6)
    o_bwd, a_bwd = _line(work_bwd, t_bwd, c.bwd_overhead_us * 1e-6)
    return {"attn_fwd_tflops": 1 / a_fwd, "attn_bwd_tflops": 1 / a_bwd, "kernel_overhead_us": o_fwd * 1e6,
            "kernel_bwd_overhead_us": o_bwd * 1e6}  # fmt: skip


def training_rows(report: dict) -> list[dict]:
    """The report's one-device training rows that ran: ``case``, ``seq``, options, step seconds and
    peak GiB (packed documents and compiled rows left out: their work is not the planner's dense step)."""
    out = []
    for row in report.get("rows", []):
        v = row.get("values") or {}
        if row.get("section") not in TRAINING_SECTIONS or "step_s" not in v or row.get("status") == "FAIL":
            continue
        if v.get("compiled") or "documents" in v:
            continue
        memory = v.get("memory")
        options = MemoryOptions(**memory) if memory else MemoryOptions(activation_checkpoint=v["checkpoint"])
        out.append({"case": row["case"], "seq": v["seq"], "options": options, "step_s": v["step_s"],
                    "peak_gib": v.get("peak_memory_gib", 0.0)})  # fmt: skip
    return out


def _predict(c: ClusterSpec, model: ModelConfig, dtype_bytes: int, row: dict) -> tuple[float, float]:
    est = estimate(c, _workload(model, row["seq"], dtype_bytes), _one_device(row["options"]))
    return est.step_s, est.memory.total / GiB


def calibrate(base: ClusterSpec, report: dict) -> tuple[ClusterSpec, list[RowCheck], dict[str, str]]:
    """``base`` with the report's measured rates and the fitted ``layer_token_ns``; every training
    row predicted again; a comment per fitted key."""
    env = report["environment"]
    model = config_of_shape(dict(env["train_model"]))
    dtype_bytes = DTYPE_BYTES[env.get("peak_dtype", "bfloat16")]
    cal = _calibration(report)
    mm = cal["matmul"]
    c = replace(base, matmul_tflops=mm["tflops"], hbm_bw_gbs=cal["hbm"]["gbs"], layer_token_ns=0.0)
    c = replace(c, **_attention_fit(c, model, dtype_bytes, cal["attention"]))
    kernels = ", ".join(f"{a['kernel']} S={a['seq']} {a['fwd_s'] * 1e3:.2f} / {a['fwd_bwd_s'] * 1e3:.2f} ms"
                        for a in cal["attention"])  # fmt: skip
    comments = {
        "matmul_tflops": f"one layer's products at {mm['tokens']} tokens, forward + backward (measured)",
        "attn_fwd_tflops": f"the planner's block model fitted to {kernels} (forward / forward + backward)",
        "attn_bwd_tflops": f"the same, backward ({BWD_FLOP_RATIO}x the forward's FLOPs)",
        "kernel_overhead_us": "the forward fit's intercept",
        "kernel_bwd_overhead_us": "the backward fit's intercept",
        "hbm_bw_gbs": f"copy of {cal['hbm']['bytes'] / GiB:.3g} GiB, bytes read + written (measured)",
    }
    if "host_link" in cal:
        link = cal["host_link"]
        c = replace(c, host_link_gbs=min(link["h2d_gbs"], link["d2h_gbs"]))
        comments["host_link_gbs"] = (
            f"pinned copies, the slower of {link['h2d_gbs']:.3g} in / {link['d2h_gbs']:.3g} GB/s out, one device alone"
        )
    adamw = cal.get("cpu_adamw")
    if adamw:
        c = replace(c, host_mem_bw_gbs=adamw["params"] * CPU_ADAMW_BYTES_PER_PARAM / adamw["seconds"] / 1e9)
        comments["host_mem_bw_gbs"] = (
            f"CPU AdamW over {adamw['params'] / 1e6:.0f}M parameters in {adamw['seconds']:.3f} s on "
            f"{adamw['threads']} threads, x {CPU_ADAMW_BYTES_PER_PARAM:.0f} bytes a parameter (one process)"
        )
    rows = training_rows(report)
    fit = [r for r in rows if not (r["options"].offload_activations or r["options"].offload_states)]
    if fit:  # least squares through the model's times: measured = p0 + k * slope
        probe = 1000.0
        p0 = [_predict(c, model, dtype_bytes, r)[0] for r in fit]
        p1 = [_predict(replace(c, layer_token_ns=probe), model, dtype_bytes, r)[0] for r in fit]
        slopes = [(b - a) / probe for a, b in zip(p0, p1)]
        k = sum(s * (r["step_s"] - a) for s, r, a in zip(slopes, fit, p0)) / max(sum(s * s for s in slopes), 1e-30)
        c = replace(c, layer_token_ns=max(0.0, k))
        comments["layer_token_ns"] = f"fitted to the step times of {len(fit)} training rows without offload"
    checks = []
    for r in rows:
        step, gib = _predict(c, model, dtype_bytes, r)
        checks.append(RowCheck(r["case"], r["seq"], r["options"], r["step_s"], step, r["peak_gib"], gib))
    return c, checks, comments


def check_table(checks: list[RowCheck]) -> str:
    """Measured beside predicted, a row each."""
    lines = [f"{'row':70s} {'measured s':>10s} {'predicted s':>11s} {'error':>7s} {'GiB meas':>9s} {'pred':>7s}"]
    for r in checks:
        lines.append(f"{r.case[:70]:70s} {r.measured_s:10.3f} {r.predicted_s:11.3f} {r.time_error:+7.1%} "
                     f"{r.measured_gib:9.2f} {r.predicted_gib:7.2f}")  # fmt: skip
    return "\n".join(lines)


def run(report_path: str, base: ClusterSpec, out: str | None) -> str:
    """Calibrate ``base`` from the report and write the cluster file (default
    ``clusters/<base name>.toml``); returns what to print."""
    report = read_report(report_path)
    cluster, checks, comments = calibrate(base, report)
    env = report["environment"]
    name = base.name if base.name.endswith("-calibrated") else f"{base.name}-calibrated"
    cluster = replace(cluster, name=name, description=f"{base.description}; calibrated on {env.get('gpu', '?')}")
    header = "\n".join([
        f"The '{name}' cluster: {base.name} with the rates measured by `bash scripts/gpu_check.sh` and fitted by",
        f"`loongtrain plan --calibrate-gpu {report_path}` on {datetime.date.today()}.",
        f"Measured on {env.get('gpu', '?')}, torch {env.get('torch', '?')}, cuDNN {env.get('cudnn', '?')}.",
        "Keys without a comment are the preset's (communication between devices is not measured on one GPU).",
        "Training rows, measured beside predicted with these values:",
        *check_table(checks).splitlines(),
    ])  # fmt: skip
    path = Path(out) if out else Path("clusters") / f"{base.name}.toml"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(cluster_to_toml(cluster, comments, header))
    except OSError as exc:
        raise PlanError(f"--out {str(path)!r}: cannot write the cluster file ({exc}); choose another path") from None
    worst = max((abs(r.time_error) for r in checks), default=float("nan"))
    return f"{check_table(checks)}\nworst step-time error {worst:.1%}; written to {path} (use --cluster {path})"
