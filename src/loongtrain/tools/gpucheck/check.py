"""``loongtrain gpu-check`` (``scripts/gpu_check.sh``): one command that runs every
device path of loongtrain and prints one table (also written as JSON).

In this order, correctness first, so that a time budget cuts measurements, not proofs:

1. kernels: every installed block-attention backend (CUDA: PyTorch's SDPA flash and
   memory-efficient kernels, FlashAttention-2, cuDNN, ``flash_attn``; CPU: the aten flash op) in
   bf16, fp16 and fp32, causal and not, MHA and GQA, with and without a sliding-window mask: out,
   lse, dq, dk, dv against float64, and the lse convention through the merge;
2. memory: every memory option on (activations and states offloaded) beside the same run without
   offload, step by step; packed documents under a sliding window, their loss beside that of the
   same documents run as separate sequences;
3. calibration and training: the rates the planner is calibrated with; per length first the
   ceiling (the step from the measured matmul and attention rates alone: no elementwise work, no
   launches), then timed steps of a Llama with the planner's checkpointing for this device
   (``auto``) and with Selective Checkpoint++ on every layer: tokens/s, model TFLOP/s, MFU against
   a stated peak, the fraction of the ceiling of the row's policy, peak memory, and the planner's
   prediction for the same step;
4. speed and replay: the chosen kernel against SDPA's backends, packed documents against one
   sequence; the double ring's blocks and merges replayed in one process against one fused call
   (the decomposition overhead), for cp 4 and 8, ring windows 1 and 2;
5. the compiled training row, the longest sequence the planner says fits;
6. distributed (2+ GPUs, or gloo processes on CPU): the 2D attention under the standard
   layouts against float64, and parallel training against the unsharded model.

Each row goes to ``--jsonl`` as one JSON line the moment it is measured (a check killed by a
timeout keeps every finished row), and an item starts only where its estimate (the planner's step
times a measured factor, plus the build: :func:`~loongtrain.tools.gpucheck.train.row_seconds`)
ends inside ``--budget-s``.

``--device cuda`` uses the sizes of one H200 (a ~1.1B model at 32K and 128K tokens) and
a time budget; ``--device cpu`` runs every path at tiny sizes in well under a minute (the
test suite runs it). What cannot run is a row marked ``skipped`` with the reason. Exit
status 1 if any correctness check fails; performance goals are reported, not enforced.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from loongtrain.apply import MemoryOptions
from loongtrain.launch import launch, under_torchrun
from loongtrain.model import ModelConfig, model_config
from loongtrain.options import checkpointed_count
from loongtrain.planner.ceiling import Ceiling, KernelRates, ceiling_step, fraction_of_ceiling
from loongtrain.planner.report import format_length
from loongtrain.planner.specs import PlanError
from loongtrain.tools.bench.attention import decomposition_overhead
from loongtrain.tools.gpucheck.calibration import calibration
from loongtrain.tools.gpucheck.ceiling import measure_ceiling
from loongtrain.tools.gpucheck.dist import DistSizes, run_dist_checks
from loongtrain.tools.gpucheck.goals import (
    DENSE_GOAL,
    DOCUMENTS_GOAL,
    PEAK_GIB_GOAL,
    PLANNER_GOAL,
    POLICY_MEMORY_GOAL,
    REPLAY_GOAL,
    SAME_LOSS_RTOL,
    TOKENS_GOAL,
)
from loongtrain.tools.gpucheck.kernels import (
    check_case,
    check_documents_case,
    documents_grid,
    installed_backends,
    kernel_grid,
    kernel_name,
    tolerance,
)
from loongtrain.tools.gpucheck.speed import dense_speed, documents_speed
from loongtrain.tools.gpucheck.train import (
    PLANNER_OPTIMISM,
    STEP_FACTOR,
    Peak,
    TrainCase,
    auto_budget_bytes,
    longest_case,
    measure_training_step,
    offload_pair,
    one_rank_state,
    packed_window_row,
    planner_cluster,
    predict_step,
    resolve_auto_case,
    row_seconds,
    stated_peak,
)
from loongtrain.tools.harness import release_memory

GiB = 2**30
PASS, FAIL, SKIP, MEASURED, MET, MISSED = "pass", "FAIL", "skipped", "measured", "goal met", "below goal"
LONGEST_SHARE_S = 100.0  # the longest row's part of a time budget, at most
CEILING_S = 10.0  # a length's ceiling (matmul and attention rates), measured before its first training row


@dataclass(frozen=True)
class Profile:
    """Sizes of one run of the check."""

    name: str
    kernel_batch: int
    kernel_seq: int
    kernel_heads: int
    kernel_kv_heads: tuple[int, ...]
    kernel_head_dim: int
    kernel_dtypes: tuple[str, ...]
    replay_seqs: tuple[int, ...]
    replay_cps: tuple[int, ...]
    replay_ring_windows: tuple[int, ...]
    replay_heads: tuple[int, int, int]  # query heads, key/value heads, head dim
    replay_dtype: str
    replay_reps: int
    speed_seqs: tuple[int, ...]  # dense causal sequences: the chosen kernel vs each SDPA backend
    speed_documents: tuple[tuple[int, int], ...]  # (sequence, median document length): packed vs one sequence
    speed_reps: int
    calibration_seqs: tuple[int, ...]  # the chosen kernel's causal lengths for the planner's rates
    calibration_sizes: dict  # hbm_bytes, host_bytes, adamw_params, reps
    train_model: ModelConfig
    train_model_name: str
    train_cases: tuple[TrainCase, ...]
    compiled_cases: tuple[TrainCase, ...]  # after the training rows, budget permitting (--compile extra)
    float8_cases: tuple[TrainCase, ...]  # the float8 rows: the compiled row's model and length, each recipe
    auto_budget_gib: float  # what the auto rows' policy may fill (0: 90% of the GPU, as the trainer)
    ceiling_reps: int  # timed runs of each matmul shape and of the attention for the ceiling
    train_dtype: str
    train_steps: int
    train_warmup: int
    offload_case: TrainCase  # every memory option on; run again without offload
    offload_steps: int
    packed_case: TrainCase  # packed documents under a sliding window
    packed_window: int
    packed_median: int  # median document length (lognormal)
    matmul_n: int  # size of the measured matmul when the device's peak is not known
    dist: DistSizes
    goals: bool  # judge the performance goals (meaningful on a GPU only)
    budget_s: float  # default time budget; 0: none
    compile_reserve_s: float  # budget a compiled row needs left to start (compilation included)
    longest_cap: int  # the longest-sequence row trains at most this many tokens (0: the planner's length)


# ~1.1B parameters: LLaMA-2-7B's GQA shape scaled to fit one GPU at 128K tokens
GPU_MODEL = model_config("7b-gqa", dim=2048, n_layers=16, n_heads=16, n_kv_heads=4, ffn_dim=8192)
TINY_MODEL = model_config("debug")

PROFILES: dict[str, Profile] = {
    "cuda": Profile(
        name="cuda",
        kernel_batch=2,
        kernel_seq=1000,  # not a multiple of the kernels' tiles: ragged edges are exercised
        kernel_heads=16,
        kernel_kv_heads=(16, 4),
        kernel_head_dim=128,
        kernel_dtypes=("bfloat16", "float16", "float32"),
        replay_seqs=(32768,),  # the goal's length (PLATFORM.md has 128K's from the first run)
        replay_cps=(4, 8),
        replay_ring_windows=(1, 2),
        replay_heads=(16, 4, 128),
        replay_dtype="bfloat16",
        replay_reps=3,
        speed_seqs=(32768, 131072),
        speed_documents=((32768, 2048), (131072, 2048)),
        speed_reps=3,
        calibration_seqs=(8192, 32768),
        calibration_sizes={"hbm_bytes": 2**32, "host_bytes": 2**30, "adamw_params": 2**28, "reps": 3},
        train_model=GPU_MODEL,
        train_model_name=f"{GPU_MODEL.num_params() / 1e9:.1f}B llama",
        train_cases=tuple(TrainCase(s, m) for s in (32768, 131072) for m in ("auto", "sc++")),
        compiled_cases=(TrainCase(32768, "auto", compiled=True),),
        float8_cases=tuple(TrainCase(32768, "auto", compiled=True, float8=r) for r in ("tensorwise", "rowwise")),
        auto_budget_gib=0.0,
        ceiling_reps=3,
        train_dtype="bfloat16",
        train_steps=2,
        train_warmup=1,
        offload_case=TrainCase(
            32768,
            "sc++",
            memory=MemoryOptions(
                activation_checkpoint="sc++",
                loss_chunk=4096,
                mlp_tile=8192,
                head_groups=2,
                offload_activations=True,
                offload_states=True,
            ),
        ),  # fmt: skip
        offload_steps=4,
        packed_case=TrainCase(32768, "sc++"),
        packed_window=4096,
        packed_median=2048,
        matmul_n=8192,
        dist=DistSizes(
            tokens_per_rank=1024,
            heads=16,
            kv_heads=4,
            head_dim=128,
            dtypes=("bfloat16", "float32"),
            model=model_config("debug", dim=256, n_heads=8, n_kv_heads=2, ffn_dim=704, vocab_size=1024),
            train_tokens_per_rank=64,
        ),
        goals=True,
        budget_s=300.0,
        compile_reserve_s=90.0,
        longest_cap=0,
    ),
    "cpu": Profile(
        name="cpu",
        kernel_batch=1,
        kernel_seq=40,
        kernel_heads=4,
        kernel_kv_heads=(4, 1),
        kernel_head_dim=16,
        kernel_dtypes=("bfloat16", "float16", "float32"),
        replay_seqs=(256, 512),
        replay_cps=(4, 8),
        replay_ring_windows=(1, 2),
        replay_heads=(4, 2, 16),
        replay_dtype="bfloat16",
        replay_reps=1,
        speed_seqs=(256,),
        speed_documents=((512, 40),),
        speed_reps=1,
        calibration_seqs=(128, 256),
        calibration_sizes={"hbm_bytes": 2**23, "host_bytes": 2**20, "adamw_params": 2**20, "reps": 1},
        train_model=TINY_MODEL,
        train_model_name="debug llama",
        train_cases=tuple(TrainCase(s, m) for s in (64, 128) for m in ("auto", "sc++", "full")),
        compiled_cases=(TrainCase(64, "auto", compiled=True),),
        # eager on the CPU (float8 through torch._scaled_mm, no FP8 units: the path, not a speed)
        float8_cases=tuple(TrainCase(64, "auto", float8=r) for r in ("tensorwise", "rowwise")),
        # between the planner's peaks at 128 tokens of no checkpointing and sc++ on the first layer
        # (at 64 tokens every policy's peak is the optimizer step's): auto takes both
        auto_budget_gib=0.00234,
        ceiling_reps=1,
        train_dtype="bfloat16",
        train_steps=1,
        train_warmup=1,
        offload_case=TrainCase(
            128,
            "sc++",
            memory=MemoryOptions(
                activation_checkpoint="sc++",
                loss_chunk=32,
                mlp_tile=48,
                head_groups=2,
                offload_activations=True,
                offload_states=True,
            ),
        ),  # fmt: skip
        offload_steps=3,
        packed_case=TrainCase(256, "sc++"),
        packed_window=48,
        packed_median=40,
        matmul_n=512,
        dist=DistSizes(
            tokens_per_rank=16,
            heads=4,
            kv_heads=2,
            head_dim=16,
            dtypes=("bfloat16", "float32"),
            model=TINY_MODEL,
            train_tokens_per_rank=16,
        ),
        goals=False,
        budget_s=0.0,
        compile_reserve_s=0.0,
        longest_cap=512,
    ),
}


@dataclass
class Row:
    """One line of the table: ``result`` is what was measured, ``target`` what it is judged against."""

    section: str
    case: str
    result: str
    target: str
    status: str
    values: dict = field(default_factory=dict)


class Budget:
    """Wall-clock budget: items that would start after it are skipped (0: no budget)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def exhausted(self, reserve: float = 0.0) -> bool:
        """True if an item that needs ``reserve`` seconds would end after the budget."""
        return self.seconds > 0 and self.elapsed() + reserve > self.seconds


class RowLog(list):
    """The rows so far. With a ``path``, every row is also written there the moment it is added, as
    one flushed JSON line (``{"row": ..., "t_s": seconds since the start}``), after a first line
    ``{"profile": ..., "environment": ...}``; :meth:`close` writes ``{"end": ...}``. A check killed by
    a timeout keeps every row it finished (:mod:`~loongtrain.tools.gpucheck.verdict` reads them)."""

    def __init__(self, path: str | Path | None = None, header: dict | None = None, clock=None) -> None:
        super().__init__()
        self._clock = clock or (lambda: 0.0)
        self._file = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "w")  # noqa: SIM115 - written line by line until close()
            self._write(header or {})

    def _write(self, obj: dict) -> None:
        self._file.write(json.dumps(obj, default=str) + "\n")
        self._file.flush()

    def append(self, row: Row) -> None:
        super().append(row)
        if self._file is not None:
            self._write({"row": asdict(row), "t_s": round(self._clock(), 1)})

    def extend(self, rows) -> None:
        for row in rows:
            self.append(row)

    def __iadd__(self, rows):
        self.extend(rows)
        return self

    def close(self, end: dict) -> None:
        """Write the last line (``{"end": end}``) and close the file."""
        if self._file is not None:
            self._write({"end": end})
            self._file.close()
            self._file = None


def _new_rows(rows: list | None) -> tuple[list, int]:
    """``(rows, where the new ones start)``: a section appends to the caller's rows (a
    :class:`RowLog` writes each as it comes) or to a list of its own, and returns its new rows."""
    rows = [] if rows is None else rows
    return rows, len(rows)


def _progress(message: str) -> None:
    print(f"[gpu-check] {message}", file=sys.stderr, flush=True)


def _error_row(section: str, case: str, exc: BaseException) -> Row:
    _progress(f"{section} {case}: {type(exc).__name__}\n{traceback.format_exc()}")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return Row(section, case, f"{type(exc).__name__}: {first}"[:200], "runs", FAIL)


def _skip_row(section: str, case: str, why: str) -> Row:
    return Row(section, case, why, "-", SKIP)


def _budget_row(section: str, case: str, budget: Budget, estimate_s: float = 0.0) -> Row:
    if estimate_s:
        why = (f"estimated {estimate_s:.0f} s, {max(0.0, budget.seconds - budget.elapsed()):.0f} s of the time "
               f"budget of {budget.seconds:.0f} s left (--budget-s)")  # fmt: skip
        return Row(section, case, why, "-", SKIP, {"estimate_s": estimate_s})
    return _skip_row(section, case, f"time budget of {budget.seconds:.0f} s spent (--budget-s)")


def _measure(rows: list[Row], section: str, label: str, budget: Budget, fn, *args, release: torch.device | None = None,
             estimate_s: float = 0.0):  # fmt: skip
    """``fn(*args)``'s result, or None with a row appended to ``rows``: skipped where it would end
    past the budget (``estimate_s``: its estimated seconds), failed on an exception; ``release``: free
    that device's memory afterwards."""
    if budget.exhausted(estimate_s):
        rows.append(_budget_row(section, label, budget, estimate_s))
        return None
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - reported as a failed row (out of memory included)
        rows.append(_error_row(section, label, exc))
        return None
    finally:
        if release is not None:
            release_memory(release)


def _kernel_row(label: str, r: dict) -> Row:
    target = f"<= {r['tolerance']:.0e}, lse <= {r['lse_tolerance']:.0e}"
    return Row("kernels", label, _fmt_errors(r["errors"]), target, PASS if r["ok"] else FAIL, r)


def _fmt_errors(errors: dict[str, float]) -> str:
    return " ".join(f"{name} {value:.1e}" for name, value in errors.items())


def kernel_rows(profile: Profile, device: torch.device, budget: Budget, rows: list | None = None) -> list[Row]:
    """Section 1: every installed backend over the kernel grid (appended to ``rows``; the new rows)."""
    p = profile
    rows, start = _new_rows(rows)
    cases = kernel_grid(
        p.kernel_dtypes, p.kernel_batch, p.kernel_seq, p.kernel_heads, p.kernel_kv_heads, p.kernel_head_dim
    )
    backends, missing = installed_backends(device)
    rows += [_skip_row("kernels", name, why) for name, why in missing]
    documents = documents_grid(p.kernel_dtypes, p.kernel_seq, p.kernel_heads, p.kernel_kv_heads, p.kernel_head_dim)
    for name, backend in backends:
        dtypes = [str(d).removeprefix("torch.") for d in backend.dtypes]
        work = [(f"{name}: {kernel_name(name, c)} {c.label()}", check_case, c) for c in cases if c.dtype in dtypes]
        if backend.varlen is not None:  # packed documents in one variable-length call
            work += [(f"{name}: {c.label()}", check_documents_case, c) for c in documents]
        for label, check, case in work:
            r = _measure(rows, "kernels", label, budget, check, name, backend, case, device)
            if r is not None:
                rows.append(_kernel_row(label, r))
    _progress(f"kernels: {len(rows) - start} rows, {budget.elapsed():.0f} s")
    return rows[start:]


def replay_rows(profile: Profile, device: torch.device, budget: Budget, rows: list | None = None) -> list[Row]:
    """The ring replayed in one process vs one fused call."""
    heads, kv_heads, head_dim = profile.replay_heads
    dtype = getattr(torch, profile.replay_dtype)
    tol, _ = tolerance(device.type, profile.replay_dtype)
    rows, start = _new_rows(rows)
    for seq in profile.replay_seqs:
        for cp in profile.replay_cps:
            for ring_window in profile.replay_ring_windows:
                case = f"S={format_length(seq)} cp={cp} ring_window={ring_window} {profile.replay_dtype}"
                if budget.exhausted():
                    rows.append(_budget_row("replay", case, budget))
                    continue
                try:
                    reps = profile.replay_reps
                    r = decomposition_overhead(seq, cp, ring_window, heads, kv_heads, head_dim, reps, dtype, device)
                except Exception as exc:  # noqa: BLE001 - reported as a failed row
                    rows.append(_error_row("replay", case, exc))
                    continue
                finally:
                    release_memory(device)
                result = (
                    f"{r['ratio']:.3f}x (fused {r['fused_s'] * 1e3:.1f} ms, replay {r['replay_s'] * 1e3:.1f} ms), "
                    f"out err {r['max_rel_err']:.1e}"
                )
                target, status = replay_status(r, tol, profile.goals)
                rows.append(Row("replay", case, result, target, status, r))
    _progress(f"replay: {len(rows) - start} rows, {budget.elapsed():.0f} s")
    return rows[start:]


def calibration_rows(profile: Profile, device: torch.device, budget: Budget, rows: list | None = None) -> list[Row]:
    """The rates ``loongtrain plan --calibrate-gpu`` fits the planner's cluster with, measured here."""
    label = f"{profile.train_model_name} S={format_length(profile.train_cases[0].seq)} {profile.train_dtype}"
    dtype = getattr(torch, profile.train_dtype)
    rows, start = _new_rows(rows)
    r = _measure(rows, "calibrate", label, budget, calibration, profile.train_model, profile.train_cases[0].seq,
                 profile.calibration_seqs, dtype, device, profile.calibration_sizes, release=device)  # fmt: skip
    if r is None:
        return rows[start:]
    parts = [f"matmul {r['matmul']['tflops']:.4g} TFLOP/s"]
    parts += [f"{a['kernel']} S={format_length(a['seq'])} fwd {a['fwd_s'] * 1e3:.2f} ms, fwd+bwd "
              f"{a['fwd_bwd_s'] * 1e3:.2f} ms" for a in r["attention"]]  # fmt: skip
    parts.append(f"copy {r['hbm']['gbs']:.4g} GB/s")
    if "host_link" in r:
        parts.append(f"host link {r['host_link']['h2d_gbs']:.3g} / {r['host_link']['d2h_gbs']:.3g} GB/s in / out")
    parts.append(f"CPU AdamW {r['cpu_adamw']['params'] / r['cpu_adamw']['seconds'] / 1e6:.4g} M params/s")
    _progress(f"calibrate: {budget.elapsed():.0f} s")
    rows.append(Row("calibrate", label, "; ".join(parts), "loongtrain plan --calibrate-gpu", MEASURED, r))
    return rows[start:]


def speed_rows(profile: Profile, device: torch.device, budget: Budget, rows: list | None = None) -> list[Row]:
    """The kernel speed section: dense against SDPA's backends, packed documents against one sequence."""
    heads, kv_heads, head_dim = profile.replay_heads
    dtype = getattr(torch, profile.replay_dtype)
    rows, start = _new_rows(rows)
    for seq in profile.speed_seqs:
        case = f"dense causal S={format_length(seq)} H{heads}/G{kv_heads} {profile.replay_dtype}"
        r = _measure(rows, "speed", case, budget, dense_speed, seq, heads, kv_heads, head_dim, dtype, device,
                     profile.speed_reps, release=device)  # fmt: skip
        if r is None:
            continue
        times = ", ".join(f"{n} {t * 1e3:.1f} ms" if t is not None else f"{n} does not run" for n, t in
                          r["times_s"].items())  # fmt: skip
        ratio = r["ratio_to_fastest"]
        result = f"{times}; {ratio:.2f}x the fastest ({r['fastest_sdpa']})" if ratio else times
        goal = profile.goals and seq >= 32768
        target = f"<= {DENSE_GOAL:.2f}x the fastest SDPA backend" if goal else "-"
        status = MEASURED if not goal else (MET if ratio is not None and ratio <= DENSE_GOAL else MISSED)
        rows.append(Row("speed", case, result, target, status, r))
    for seq, median in profile.speed_documents:
        case = f"packed documents S={format_length(seq)} median {median} H{heads}/G{kv_heads} {profile.replay_dtype}"
        r = _measure(rows, "speed", case, budget, documents_speed, seq, median, heads, kv_heads, head_dim, dtype,
                     device, profile.speed_reps, release=device)  # fmt: skip
        if r is None:
            continue
        result = (
            f"{r['documents']} documents ({r['fewer_keys']:.1f}x fewer keys): {r['packed_s'] * 1e3:.1f} ms vs one "
            f"sequence {r['one_sequence_s'] * 1e3:.1f} ms = {r['speedup']:.2f}x; {r['kernel_calls']} kernel call(s) "
            f"for {r['plan_calls']} plan calls; peak {r['packed_peak_bytes'] / GiB:.3g} vs "
            f"{r['one_sequence_peak_bytes'] / GiB:.3g} GiB"
        )
        goal = DOCUMENTS_GOAL.get(seq) if profile.goals else None
        memory_ok = r["packed_peak_bytes"] <= r["one_sequence_peak_bytes"]
        target = f">= {goal:.1f}x, peak <= one sequence's" if goal else "-"
        status = MEASURED if not goal else (MET if r["speedup"] >= goal and memory_ok else MISSED)
        rows.append(Row("speed", case, result, target, status, r))
    _progress(f"speed: {len(rows) - start} rows, {budget.elapsed():.0f} s")
    return rows[start:]


def replay_status(r: dict, tol: float, goals: bool) -> tuple[str, str]:
    """``(target, status)`` of a replay row: its output within ``4 * tol`` (max error relative to
    max |out|) of the fused call, and with ``goals`` the overhead goal at S >= 32K."""
    goal = goals and r["seq"] >= 32768
    target = f"err <= {4 * tol:.0e}" + (f", ratio <= {REPLAY_GOAL:.2f}" if goal else "")
    if not r["max_rel_err"] <= 4 * tol:
        return target, FAIL
    if not goal:
        return target, MEASURED
    return target, MET if r["ratio"] <= REPLAY_GOAL else MISSED


def training_status(goals: bool, case: TrainCase, m: dict, pred: dict | None) -> tuple[str, str]:
    """``(target, status)`` of a training row: a finite loss, and with ``goals`` (eager rows) the
    tokens/s and peak memory goals of its length and policy (H200), the auto rows' peak within 5%
    of the planner's, and the planner's step time within 20% of the measured one."""
    if not m["finite"]:
        return "finite loss", FAIL
    if not goals:
        return "MFU = tokens/s x FLOPs/token / peak", MEASURED
    targets, missed = [], []
    key = (case.seq, case.checkpoint)
    if key in TOKENS_GOAL and not case.compiled:
        targets.append(f"tok/s >= {TOKENS_GOAL[key]:,} (H200)")
        if m["tokens_per_s"] < TOKENS_GOAL[key]:
            missed.append("tok/s")
    if key in PEAK_GIB_GOAL:
        targets.append(f"peak <= {PEAK_GIB_GOAL[key]:g} GiB")
        if m["peak_memory_gib"] > PEAK_GIB_GOAL[key]:
            missed.append("peak memory")
    if case.compiled and m.get("compile"):
        targets.append("no recompile in the timed steps")
        if m["compile"]["graphs_in_timed_steps"]:
            missed.append("recompiles")
    if case.checkpoint == "auto" and pred is not None:
        targets.append(f"peak within {POLICY_MEMORY_GOAL:.0%} of the planner's")
        if abs(m["peak_memory_gib"] / pred["memory_gib"] - 1) > POLICY_MEMORY_GOAL:
            missed.append("planner's peak")
    if pred is not None:
        targets.append(f"planner within {PLANNER_GOAL:.0%}")
        if abs(pred["step_s"] / m["step_s"] - 1) > PLANNER_GOAL:
            missed.append("planner")
    if not targets:
        return "-", MEASURED
    return ", ".join(targets), MET if not missed else f"{MISSED}: {', '.join(missed)}"


def _train_result(m: dict, pred: dict | None, planner_note: str, ceiling: Ceiling | None = None) -> str:
    text = (
        f"{m['step_s']:.3f} s/step, {m['tokens_per_s']:.0f} tok/s, {m['tflops']:.3g} TFLOP/s, "
        f"MFU {m['mfu']:.1%}, peak mem {m['peak_memory_gib']:.3g} GiB"
    )
    if ceiling is not None:
        text += (
            f", {fraction_of_ceiling(m['tokens_per_s'], ceiling):.0%} of the ceiling ({ceiling.tokens_per_s:.0f} tok/s)"
        )
    if m.get("compile"):
        c = m["compile"]
        text += (
            f", graphs compiled: {c['graphs_in_warmup']} in the warm-up, {c['graphs_in_timed_steps']} in the timed "
            f"steps; {c['graph_breaks']} graph breaks"
        )
    if pred is None:
        return f"{text} | planner: {planner_note}"
    return (
        f"{text} | planner ({planner_note}) {pred['step_s']:.3f} s, meas/pred {m['step_s'] / pred['step_s']:.2f}, "
        f"MFU {pred['mfu']:.1%}, mem {pred['memory_gib']:.3g} GiB"
    )


def _ceiling_row(name: str, report: dict) -> Row:
    """The ceiling of one length: each policy's step from the best measured kernels alone."""
    policies = ", ".join(
        f"{p['mode']}{'' if p['mode'] == 'none' else ' every layer'} {p['tokens_per_s']:.0f} tok/s"
        + (f" ({p['mfu']:.1%})" if p["mfu"] is not None else "")
        for p in report["policies"]
    )
    rates = [m["tflops"] for m in report["matmuls"]]
    a = report["attention"]
    result = (
        f"{policies}; matmuls {min(rates):.3g}-{max(rates):.3g} TFLOP/s, attention fwd {a['fwd_s'] * 1e3:.3g} ms "
        f"({a['fwd_tflops']:.3g} TFLOP/s), bwd {a['bwd_s'] * 1e3:.3g} ms ({a['bwd_tflops']:.3g})"
    )
    target = "measured kernels only: no elementwise work, no launches"
    return Row("ceiling", f"{name} S={format_length(report['tokens'])}", result, target, MEASURED, report)


def _ceiling_rates(profile: Profile, seq: int, dtype: torch.dtype, device: torch.device, peak: Peak,
                   ceilings: dict, rows: list) -> KernelRates | None:  # fmt: skip
    """The kernel rates at ``seq`` tokens (measured once per length, with its ceiling row); None
    where they cannot be measured (an error row says why)."""
    if seq not in ceilings:
        label = f"{profile.train_model_name} S={format_length(seq)}"
        _progress(f"ceiling {label} ...")
        try:
            rates, report = measure_ceiling(
                profile.train_model, seq, dtype, device, reps=profile.ceiling_reps, peak_tflops=peak.tflops
            )
            rows.append(_ceiling_row(profile.train_model_name, report))
        except Exception as exc:  # noqa: BLE001 - reported as a failed row (out of memory included)
            rows.append(_error_row("ceiling", label, exc))
            rates = None
        finally:
            release_memory(device)
        ceilings[seq] = rates
    return ceilings[seq]


def _training_on_one_rank(
    device: torch.device,
    profile: Profile,
    cases: list[TrainCase],
    peak: Peak,
    args,
    budget: Budget,
    reserve: float,
    rows: list,
    ceilings: dict,
    section: str = "training",
) -> None:
    """Body run in a one-rank process group (``launch`` with ``nproc=1``): appends to ``rows``;
    ``ceilings`` holds each length's kernel rates, measured before its first row. A row starts only
    where its estimate (:func:`~loongtrain.tools.gpucheck.train.row_seconds`, the length's ceiling
    included when still to measure; at least ``reserve``) ends inside the budget."""
    state = one_rank_state()
    dtype = getattr(torch, profile.train_dtype)
    cluster, planner_note = planner_cluster(device, args.cluster)
    for case in cases:
        label = f"{profile.train_model_name} {case.label()}"
        try:
            budget_bytes = auto_budget_bytes(device, profile.auto_budget_gib)
            case, policy = resolve_auto_case(case, profile.train_model, dtype, budget_bytes, device.type == "cuda")
        except ValueError as exc:
            rows.append(_error_row(section, label, exc))
            continue
        label = f"{profile.train_model_name} {case.label()}"
        steps = profile.train_steps + profile.train_warmup
        estimate = row_seconds(cluster, profile.train_model, case, dtype, steps) if budget.seconds else 0.0
        if estimate and case.seq not in ceilings:
            estimate += CEILING_S
        if budget.exhausted(max(reserve, estimate)):
            rows.append(_budget_row(section, label, budget, max(reserve, estimate)))
            continue
        rates = _ceiling_rates(profile, case.seq, dtype, device, peak, ceilings, rows)
        _progress(f"training {label} ...")
        try:
            m = measure_training_step(
                state, profile.train_model, case, dtype, device, profile.train_steps, profile.train_warmup, peak
            )
        except Exception as exc:  # noqa: BLE001 - reported as a failed row (out of memory included)
            rows.append(_error_row(section, label, exc))
            continue
        finally:
            release_memory(device)
        pred = predict_step(cluster, profile.train_model, case, dtype) if cluster is not None else None
        ceiling = None
        if rates is not None:
            n_ckpt = checkpointed_count(case.options, profile.train_model.n_layers)
            ceiling = ceiling_step(profile.train_model, case.seq, case.options.activation_checkpoint, n_ckpt, rates,
                                   peak.tflops)  # fmt: skip
        target, status = training_status(profile.goals, case, m, pred)
        values = {**m, **asdict(case), "planner": pred, "planner_cluster": planner_note,
                  "policy": policy.describe() if policy is not None else None,
                  "ceiling": asdict(ceiling) if ceiling is not None else None,
                  "of_ceiling": fraction_of_ceiling(m["tokens_per_s"], ceiling) if ceiling else None,
                  "estimate_s": estimate}  # fmt: skip
        row = Row(section, label, _train_result(m, pred, planner_note, ceiling), target, status, values)
        rows.append(float8_beside_bf16(compiled_gain(row, rows), rows, profile.goals))


#: issue 54's goal: the float8 training row's tokens/s over the bf16 row's at 32K on the check model
FLOAT8_SPEEDUP_GOAL = 1.15


def float8_beside_bf16(row: Row, rows: list[Row], goals: bool = False) -> Row:
    """A float8 training ``row`` with its tokens/s and peak memory over the bf16 row of the same
    length, policy and compilation among ``rows`` (``values['over_bf16']``), where that ran;
    ``goals``: judged against :data:`FLOAT8_SPEEDUP_GOAL`."""
    if not row.values.get("float8") or "tokens_per_s" not in row.values:
        return row
    key = (row.values["seq"], row.values["checkpoint"], row.values["compiled"])
    for r in rows:
        if r.section == "training" and "tokens_per_s" in r.values and not r.values.get("float8"):
            if (r.values["seq"], r.values["checkpoint"], r.values["compiled"]) == key:
                speed = row.values["tokens_per_s"] / r.values["tokens_per_s"]
                memory = row.values["peak_memory_gib"] / max(r.values["peak_memory_gib"], 1e-12)
                row.values["over_bf16"] = {"tokens_per_s": speed, "peak_memory": memory, "bf16_case": r.case}
                row.result = f"{speed:.2f}x the bf16 row's tokens/s, {memory:.2f}x its peak memory; {row.result}"
                if goals and row.status != FAIL:
                    row.target = f">= {FLOAT8_SPEEDUP_GOAL}x the bf16 row's tokens/s"
                    row.status = "goal met" if speed >= FLOAT8_SPEEDUP_GOAL else "below goal"
                break
    return row


def compiled_gain(row: Row, rows: list[Row]) -> Row:
    """A compiled training ``row`` with its tokens/s over the eager row of its length and policy
    among ``rows`` (its result and ``values['gain_over_eager']``), where that ran; others as they are."""
    if not row.values.get("compiled") or "tokens_per_s" not in row.values:
        return row
    key = (row.values["seq"], row.values["checkpoint"])
    for r in rows:
        if r.section == "training" and "tokens_per_s" in r.values and not r.values["compiled"]:
            if r.values.get("float8") != row.values.get("float8"):
                continue
            if (r.values["seq"], r.values["checkpoint"]) == key:
                row.values["gain_over_eager"] = row.values["tokens_per_s"] / r.values["tokens_per_s"]
                row.result = f"{row.values['gain_over_eager']:.2f}x the eager row; {row.result}"
                break
    return row


def _longest_on_one_rank(device: torch.device, profile: Profile, peak: Peak, args, budget: Budget, rows: list) -> None:
    """The longest sequence of the training model that trains here: the planner's longest length
    for one device with the memory options it chooses (shorter if the time budget says so),
    three steps; on running out of memory, three quarters of the length (twice at most)."""
    state = one_rank_state()
    dtype = getattr(torch, profile.train_dtype)
    cluster, planner_note = planner_cluster(device, args.cluster)
    if cluster is None:
        rows.append(_skip_row("longest", profile.train_model_name, planner_note))
        return
    if budget.exhausted():
        rows.append(_budget_row("longest", profile.train_model_name, budget))
        return
    left = min(LONGEST_SHARE_S, max(1.0, budget.seconds - budget.elapsed())) if budget.seconds else 0.0
    try:
        case, planned, why = longest_case(cluster, profile.train_model, dtype, left, profile.longest_cap)
    except PlanError as exc:
        rows.append(_error_row("longest", profile.train_model_name, exc))
        return
    for attempt in range(3):
        label = f"{profile.train_model_name} longest {case.label()}"
        _progress(f"longest: {label} ...")
        try:
            m = measure_training_step(state, profile.train_model, case, dtype, device, 2, 1, peak)
        except torch.OutOfMemoryError:
            release_memory(device)
            why = f"out of memory at {case.seq}; three quarters"
            case = TrainCase(max(1024, case.seq * 3 // 4 // 1024 * 1024), case.checkpoint, memory=case.memory)
            continue
        except Exception as exc:  # noqa: BLE001 - reported as a failed row
            rows.append(_error_row("longest", label, exc))
            return
        finally:
            release_memory(device)
        pred = predict_step(cluster, profile.train_model, case, dtype)
        status = PASS if m["finite"] else FAIL
        note = f"planner's longest {planned} tokens" + (f" ({why})" if why else "")
        values = {**m, "seq": case.seq, "planner_longest": planned, "planner": pred, "why_shorter": why,
                  "memory": asdict(case.options), "attempts": attempt + 1}  # fmt: skip
        rows.append(Row("longest", label, f"{_train_result(m, pred, planner_note)}; {note}", "trains", status, values))
        return
    rows.append(Row("longest", profile.train_model_name, f"out of memory three times (last {case.seq})", "trains",
                    FAIL, {"why": why}))  # fmt: skip


def _memory_options_on_one_rank(
    device: torch.device, profile: Profile, peak: Peak, args, budget: Budget, rows: list
) -> None:
    """The offload row (every memory option, beside the same run without offload) and the packed
    documents row (a sliding window, beside the documents run as separate sequences); each starts
    where its estimate ends inside the budget."""
    state = one_rank_state()
    dtype = getattr(torch, profile.train_dtype)
    cluster, _ = planner_cluster(device, args.cluster) if budget.seconds else (None, "")
    name, case = profile.train_model_name, profile.offload_case
    label = f"{name} {case.label()}"
    plain = TrainCase(case.seq, case.checkpoint, memory=dataclasses.replace(
        case.options, offload_activations=False, offload_states=False))  # fmt: skip
    estimate = row_seconds(cluster, profile.train_model, case, dtype, profile.offload_steps, PLANNER_OPTIMISM)
    estimate += row_seconds(cluster, profile.train_model, plain, dtype, profile.offload_steps)
    _progress(f"memory: {label} ...")
    r = _measure(rows, "memory", label, budget, offload_pair, state, profile.train_model, case, dtype, device,
                 profile.offload_steps, peak, functools.partial(release_memory, device), release=device,
                 estimate_s=estimate)  # fmt: skip
    if r is not None:
        base = r["baseline"]
        result = (
            f"losses {_losses(r['losses'])} vs without offload {_losses(base['losses'])} (max rel diff "
            f"{r['max_rel_diff']:.1e}); {r['step_s']:.3f} vs {base['step_s']:.3f} s/step, peak mem "
            f"{r['peak_memory_gib']:.3g} vs {base['peak_memory_gib']:.3g} GiB"
        )
        result += "".join(f"; {alone}: {r[alone]}" for alone in ("activations only", "states only") if alone in r)
        target = f"every loss finite, within {SAME_LOSS_RTOL:.0e} of the run without offload"
        rows.append(Row("memory", label, result, target, PASS if r["same"] else FAIL, {**r, **asdict(case)}))
    case, window = profile.packed_case, profile.packed_window
    label = f"{name} {case.label()} packed documents (median {profile.packed_median}), window {window}"
    # its two forwards at the initial weights (a second build) and its steps; the planner's step of one
    # sequence bounds the packed one's
    steps = profile.train_steps + profile.train_warmup + 1
    estimate = row_seconds(cluster, profile.train_model, case, dtype, steps, STEP_FACTOR)
    estimate += row_seconds(cluster, profile.train_model, case, dtype, 0)
    _progress(f"memory: {label} ...")
    r = _measure(rows, "memory", label, budget, packed_window_row, state, profile.train_model, case, window,
                 profile.packed_median, dtype, device, profile.train_steps, profile.train_warmup, peak,
                 release=device, estimate_s=estimate)  # fmt: skip
    if r is not None:
        result = (
            f"{r['documents']} documents: loss {r['packed_loss']:.4f} packed vs {r['separate_loss']:.4f} as separate "
            f"sequences (rel diff {r['rel_diff']:.1e}); training losses {_losses(r['losses'])}; "
            f"{r['step_s']:.3f} s/step, {r['tokens_per_s']:.0f} tok/s, MFU {r['mfu']:.1%} (keys seen), "
            f"peak mem {r['peak_memory_gib']:.3g} GiB"
        )
        target = f"loss within {SAME_LOSS_RTOL:.0e} of separate sequences, training losses finite"
        status = PASS if r["same"] and r["finite"] else FAIL
        rows.append(Row("memory", label, result, target, status, {**r, **asdict(case)}))


def _losses(values: list[float]) -> str:
    return "[" + ", ".join(f"{x:.4f}" for x in values) + "]"


def memory_rows(
    profile: Profile, device: torch.device, peak: Peak, args, budget: Budget, rows: list | None = None
) -> list[Row]:
    """The offload and packed-documents rows, in a one-rank process group."""
    rows, start = _new_rows(rows)
    launch(_memory_options_on_one_rank, 1, profile, peak, args, budget, rows, device=device.type)
    _progress(f"memory: {len(rows) - start} rows, {budget.elapsed():.0f} s")
    return rows[start:]


def longest_rows(
    profile: Profile, device: torch.device, peak: Peak, args, budget: Budget, rows: list | None = None
) -> list[Row]:
    """The longest-sequence row, in a one-rank process group."""
    rows, start = _new_rows(rows)
    launch(_longest_on_one_rank, 1, profile, peak, args, budget, rows, device=device.type)
    return rows[start:]


def training_rows(
    profile: Profile, device: torch.device, peak: Peak, args, budget: Budget, compiled: bool, ceilings: dict,
    rows: list | None = None,
) -> list:  # fmt: skip
    """The training steps (or the compiled rows) in a one-rank process group, each length's ceiling
    first (``ceilings``: the kernel rates measured so far, by length)."""
    if compiled:
        cases, reserve = list(profile.compiled_cases), profile.compile_reserve_s
    else:
        cases = [dataclasses.replace(c, compiled=args.compile == "all") for c in profile.train_cases]
        reserve = 0.0
    rows, start = _new_rows(rows)
    launch(_training_on_one_rank, 1, profile, cases, peak, args, budget, reserve, rows, ceilings, device=device.type)
    _progress(f"training: {len(rows) - start} rows, {budget.elapsed():.0f} s")
    return rows[start:]


def float8_rows(
    profile: Profile, device: torch.device, peak: Peak, args, budget: Budget, ceilings: dict, rows: list | None = None
) -> list:
    """FP8 training (docs/fp8.md): the compiled row's model and length with each recipe, beside the
    bf16 row (tokens/s, peak memory), then the step's block matmuls in bf16 and float8 (the kernel
    row). A skipped row names why where they cannot run (torchao missing, no FP8 units)."""
    from loongtrain.tools.gpucheck.float8 import float8_matmul_times, float8_unavailable

    rows, start = _new_rows(rows)
    why = float8_unavailable(device)
    if why is not None:
        rows.append(_skip_row("float8", "float8 training and matmuls", why))
        return rows[start:]
    reserve = profile.compile_reserve_s if any(c.compiled for c in profile.float8_cases) else 0.0
    cases = list(profile.float8_cases)
    launch(_training_on_one_rank, 1, profile, cases, peak, args, budget, reserve, rows, ceilings, "float8",
           device=device.type)  # fmt: skip
    seq = profile.float8_cases[0].seq
    label = f"{profile.train_model_name} S={format_length(seq)}: the step's block matmuls, bf16 vs float8"
    if budget.exhausted():
        rows.append(_budget_row("float8", label, budget))
        return rows[start:]
    try:
        t = float8_matmul_times(profile.train_model, seq, device, reps=profile.ceiling_reps)
    except Exception as exc:  # noqa: BLE001 - reported as a failed row
        rows.append(_error_row("float8", label, exc))
        return rows[start:]
    result = f"bf16 {t['bf16_s'] * 1e3:.2f} ms, float8 {t['fp8_s'] * 1e3:.2f} ms: {t['speedup']:.2f}x"
    target, status = ("float8 >= 1.6x bf16", "goal met" if t["speedup"] >= 1.6 else "below goal") if profile.goals \
        else ("-", "measured")  # fmt: skip
    rows.append(Row("float8", label, result, target, status, t))
    _progress(f"float8: {len(rows) - start} rows, {budget.elapsed():.0f} s")
    return rows[start:]


def dist_rows(
    profile: Profile, device: torch.device, world: int, budget: Budget, rows: list | None = None
) -> list[Row]:
    """Spawn ``world`` ranks (NCCL on GPUs, gloo on CPU) and collect their rows."""
    rows, start = _new_rows(rows)
    rows += _dist_rows(profile, device, world, budget)
    return rows[start:]


def _dist_rows(profile: Profile, device: torch.device, world: int, budget: Budget) -> list[Row]:
    if world < 2:
        found = torch.cuda.device_count() if device.type == "cuda" else 0
        why = f"needs 2+ GPUs, {found} visible" if device.type == "cuda" else "--dist-world < 2"
        return [_skip_row("distributed", "attention layouts and training equivalence", why)]
    if device.type == "cuda" and torch.cuda.device_count() < world:
        why = f"--dist-world {world} needs {world} GPUs, {torch.cuda.device_count()} visible"
        return [_skip_row("distributed", f"world {world}", why)]
    if budget.exhausted():
        return [_budget_row("distributed", f"world {world}", budget)]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.json")
        try:
            launch(run_dist_checks, world, profile.dist, out_path, device=device.type)
            with open(out_path) as f:
                results = json.load(f)
        except Exception as exc:  # noqa: BLE001 - reported as a failed row
            return [_error_row("distributed", f"world {world}", exc)]
    rows = []
    for r in results:
        tol = r["tolerance"]
        target = f"<= {tol:.0e}" if isinstance(tol, float) else ", ".join(f"{k} <= {v:.0e}" for k, v in tol.items())
        rows.append(Row("distributed", r["case"], _fmt_errors(r["errors"]), target, PASS if r["ok"] else FAIL, r))
    _progress(f"distributed: {len(rows)} rows, {budget.elapsed():.0f} s")
    return rows


def environment(device: torch.device, peak: Peak, train_dtype: str) -> dict:
    """What ran: versions, device, installed kernels, and the peak MFU divides by."""
    try:
        flash = importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        flash = "not installed"
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device.type,
        "flash_attn": flash,
        "peak_tflops": peak.tflops,
        "peak_source": peak.source,
        "peak_dtype": train_dtype,
    }
    if device.type == "cuda":
        env.update(
            cuda=torch.version.cuda,
            gpu=torch.cuda.get_device_name(device),
            gpus=torch.cuda.device_count(),
            cudnn=torch.backends.cudnn.version(),
        )
    else:
        env.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return env


def format_table(rows: list[Row]) -> str:
    """The rows as one fixed-width text table."""
    header = ("section", "case", "result", "target", "status")
    cells = [header] + [(r.section, r.case, r.result, r.target, r.status) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cell, widths)).rstrip() for cell in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA if a GPU is visible, else CPU; ``cuda`` without one is an error."""
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "loongtrain gpu-check: error: --device cuda but no CUDA device is visible "
            f"(torch {torch.__version__}); run with --device cpu for the CPU check at tiny sizes"
        )
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name, 0) if name == "cuda" else torch.device(name)


def main(args: argparse.Namespace) -> None:
    if under_torchrun():
        raise SystemExit("loongtrain gpu-check: error: run it without torchrun; it starts its own ranks")
    device = resolve_device(args.device)
    profile = PROFILES[device.type]
    if args.compile is None:
        args.compile = "extra" if device.type == "cuda" else "off"
    budget = Budget(profile.budget_s if args.budget_s is None else args.budget_s)
    world = args.dist_world
    if world is None:
        world = torch.cuda.device_count() if device.type == "cuda" else 2
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        _progress("no GPU in use: every path at tiny CPU sizes (--device cpu); performance goals are not judged")
    dtype = getattr(torch, profile.train_dtype)
    peak = stated_peak(device, dtype, args.peak_tflops, profile.matmul_n)
    env = environment(device, peak, profile.train_dtype)
    env["train_model"] = asdict(profile.train_model)
    _progress(f"{env}")
    rows = RowLog(args.jsonl, {"profile": profile.name, "environment": env}, clock=budget.elapsed)
    # correctness first (the kernels, then the offload run that proves the step-3 NaN gone and the
    # packed documents), so that a budget or a timeout cuts measurements, not them; speed after
    kernel_rows(profile, device, budget, rows)
    memory_rows(profile, device, peak, args, budget, rows)
    calibration_rows(profile, device, budget, rows)
    ceilings: dict = {}  # kernel rates by length, measured once for the eager and the compiled rows
    training_rows(profile, device, peak, args, budget, compiled=False, ceilings=ceilings, rows=rows)
    speed_rows(profile, device, budget, rows)
    replay_rows(profile, device, budget, rows)
    if args.compile == "extra":  # beside the eager rows: the compiled path's gain is a goal of its own
        training_rows(profile, device, peak, args, budget, compiled=True, ceilings=ceilings, rows=rows)
    float8_rows(profile, device, peak, args, budget, ceilings, rows)
    longest_rows(profile, device, peak, args, budget, rows)
    dist_rows(profile, device, world, budget, rows)
    failures = sum(r.status == FAIL for r in rows)
    env["elapsed_s"] = budget.elapsed()
    rows.close({"failures": failures, "rows": len(rows), "elapsed_s": env["elapsed_s"]})
    print(
        f"loongtrain GPU check, {profile.name} profile: torch {env['torch']}, "
        f"{env.get('gpu', env.get('cpu'))}, flash_attn {env['flash_attn']}; "
        f"MFU peak {peak.tflops:.4g} TFLOP/s {profile.train_dtype} ({peak.source}); {env['elapsed_s']:.0f} s"
    )
    print(format_table(rows))
    print(f"{failures} failed, {sum(r.status == SKIP for r in rows)} skipped, {len(rows)} rows")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"profile": profile.name, "environment": env, "failures": failures, "complete": True,
              "rows": [asdict(r) for r in rows]}  # fmt: skip
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"written to {path}")
    if failures:
        raise SystemExit(1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=["auto", "cuda", "cpu"],
        default="auto",
        help="cuda: one GPU's sizes; cpu: tiny sizes (what the tests run); auto: cuda if visible",
    )
    parser.add_argument("--json", default="runs/gpu_check.json", help="where the table is written as JSON")
    parser.add_argument(
        "--jsonl",
        default=None,
        help="also write each row to this file as a JSON line the moment it is measured (a killed check keeps them)",
    )
    parser.add_argument(
        "--dist-world",
        type=int,
        default=None,
        help="ranks of the distributed checks (default: every GPU; 2 gloo processes on CPU; <2 skips)",
    )
    parser.add_argument(
        "--compile",
        choices=["off", "extra", "all"],
        default=None,
        help="torch.compile the blocks: extra = one more compiled row at the end (default on CUDA), "
        "all = every training row, off (default on CPU)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip items whose estimate ends after this many seconds (default 300 on CUDA, none on CPU)",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak dense TFLOP/s for MFU (default: the GPU's spec sheet, else a measured matmul)",
    )
    parser.add_argument(
        "--cluster", default=None, help="planner cluster for the predictions (default: by GPU name; 'local' on CPU)"
    )
