"""The GPU check's training part: timed training steps on one device, MFU against a stated
peak, and the planner's prediction for the same step.

A step is the trainer's: the model built by :func:`parallelize` (``compile=True`` for the
compiled rows), then :func:`~loongtrain.train.trainer.train_step` on one full sequence with
the default ``[optim]`` (AdamW, gradient clipping), fp32 master weights and ``param_dtype``
compute through FSDP2's mixed precision on a one-rank mesh. Model FLOPs per token are
:meth:`ModelConfig.flops_per_token` (the trainer's and the planner's definition), so
``MFU = tokens/s x FLOPs/token / peak``.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from loongtrain.apply import MemoryOptions, materialize, parallelize
from loongtrain.config import OptimSection
from loongtrain.model import ModelConfig, build_model
from loongtrain.parallel import ParallelConfig, ParallelState, init_parallel
from loongtrain.planner import Candidate, ClusterSpec, PlanError, Workload, cluster_spec, estimate
from loongtrain.planner.report import format_length
from loongtrain.planner.specs import CLUSTER_PRESETS
from loongtrain.tools.harness import median_time, sync
from loongtrain.train.metrics import device_peak_tflops, mfu, reset_peak_memory
from loongtrain.train.spec import build_optimizer
from loongtrain.train.trainer import peak_memory_gib, train_step

GiB = 2**30
ZERO = "dp_sp"  # one rank: FSDP2 only for the bf16 mixed precision


@dataclass(frozen=True)
class TrainCase:
    """One training row: sequence length, checkpoint mode, whether blocks are compiled, and
    (the longest-sequence row) every memory option."""

    seq: int
    checkpoint: str
    compiled: bool = False
    memory: MemoryOptions | None = None

    @property
    def options(self) -> MemoryOptions:
        return self.memory or MemoryOptions(activation_checkpoint=self.checkpoint)

    def label(self) -> str:
        text = f"S={format_length(self.seq)} {self.checkpoint}" + (" compiled" if self.compiled else "")
        if self.memory is not None:
            m = self.memory
            offload = [n for n, on in (("activations", m.offload_activations), ("states", m.offload_states)) if on]
            text += f" loss_chunk {m.loss_chunk} mlp_tile {m.mlp_tile} offload {'+'.join(offload) or 'none'}"
        return text


@dataclass(frozen=True)
class Peak:
    """The dense TFLOP/s that MFU divides by, and where the number comes from."""

    tflops: float
    source: str


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int, reps: int = 3) -> float:
    """Measured ``torch.mm`` rate of two ``n x n`` matrices of ``dtype`` (median of ``reps``)."""
    gen = torch.Generator(device).manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen, device=device).to(dtype) for _ in range(2))
    return 2 * n**3 / median_time(lambda: torch.mm(a, b), reps, device) / 1e12


def stated_peak(device: torch.device, dtype: torch.dtype, override: float | None, matmul_n: int) -> Peak:
    """``override`` if given, else the spec-sheet peak of a known GPU, else a measured matmul rate."""
    if override is not None:
        if not override > 0:
            raise ValueError(f"--peak-tflops={override} must be positive")
        return Peak(override, "--peak-tflops")
    known = device_peak_tflops(device, dtype)
    if known is not None:
        return Peak(known, f"spec sheet, {torch.cuda.get_device_name(device)}")
    rate = matmul_tflops(device, dtype, matmul_n)
    return Peak(rate, f"measured torch.mm {matmul_n}^3 {str(dtype).removeprefix('torch.')} on {device.type}")


def planner_cluster(device: torch.device, name: str | None) -> tuple[ClusterSpec | None, str]:
    """The planner's cluster for this device (``name``, else by GPU name, else ``local`` on CPU)
    and a note saying which (or why none)."""
    if name is None:
        if device.type == "cuda":
            gpu = torch.cuda.get_device_name(device)
            name = next((preset for preset in CLUSTER_PRESETS if preset.upper() in gpu), None)  # "NVIDIA H200"
            if name is None:
                return None, f"no planner preset for {gpu!r}: pass --cluster (a preset or a TOML file)"
        else:
            name = "local"
    try:
        return cluster_spec(name), name
    except PlanError as exc:
        return None, str(exc)


def predict_step(cluster: ClusterSpec, cfg: ModelConfig, case: TrainCase, dtype: torch.dtype) -> dict:
    """The planner's estimate of ``case`` on one device of ``cluster``."""
    dtype_bytes = dtype.itemsize
    workload = Workload(cfg, case.seq, batch=1, micro_batch=1, dtype_bytes=dtype_bytes)
    layout = Candidate(ParallelConfig(dp=1), ZERO, case.options)
    est = estimate(cluster, workload, layout)
    return {
        "step_s": est.step_s,
        "mfu": est.mfu,
        "memory_gib": est.memory.total / GiB,
        "fits": est.fits,
    }


def one_rank_state() -> ParallelState:
    """The parallel state of a one-rank process group (no sequence parallelism)."""
    return init_parallel(ParallelConfig(), verify_inputs=False, zero_scopes=(ZERO,))


def measure_training_step(
    state: ParallelState,
    cfg: ModelConfig,
    case: TrainCase,
    dtype: torch.dtype,
    device: torch.device,
    steps: int,
    warmup: int,
    peak: Peak,
) -> dict:
    """Build, time ``steps`` training steps after ``warmup`` ones, and report throughput and memory.

    The model and optimizer are freed when this returns; call :func:`~loongtrain.tools.harness.release_memory` then."""
    model = build_model(cfg)
    parallelize(
        model,
        state,
        memory=case.options,
        zero=ZERO,
        param_dtype=dtype,
        compile=case.compiled,
    )
    materialize(model, device, seed=0)
    optim = OptimSection()
    optimizer = build_optimizer(model.parameters(), optim)
    gen = torch.Generator(device).manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (1, case.seq + 1), generator=gen, device=device)
    batch = [(data[:, :-1], data[:, 1:])]
    losses: list[float] = []

    def step() -> float:
        sync(device)
        t0 = time.perf_counter()
        losses.append(train_step(model, optimizer, state, batch, lr=optim.lr, grad_clip=optim.grad_clip).loss)
        sync(device)
        return time.perf_counter() - t0

    first = [step() for _ in range(warmup)]
    reset_peak_memory(device)
    step_s = statistics.median(step() for _ in range(steps))
    peak_gib = peak_memory_gib(device)
    flops = cfg.flops_per_token(case.seq)
    tokens_per_s = case.seq / step_s
    return {
        "step_s": step_s,
        "warmup_s": sum(first),
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops,
        "tflops": tokens_per_s * flops / 1e12,
        "mfu": mfu(tokens_per_s, flops, peak.tflops),
        "peak_tflops": peak.tflops,
        "peak_memory_gib": peak_gib,
        "losses": losses,
        "finite": all(math.isfinite(x) for x in losses),
    }


def longest_case(cluster: ClusterSpec, cfg: ModelConfig, dtype: torch.dtype, seconds: float, cap: int) -> tuple:
    """The longest-sequence row's case: the planner's longest length for one device of
    ``cluster`` (``loongtrain plan --max-seq-len``) with the memory options it chooses there,
    shortened (halving) until the planner's time for the row's steps fits ``seconds``
    (0: no limit) and at most ``cap`` tokens (0: none). Returns ``(case, planner's longest, why shorter)``."""
    from loongtrain.planner.maxlen import max_seq_len

    answer = max_seq_len(cluster, cfg, 1)
    best = answer.result.best
    unit = answer.unit
    seq, why = answer.seq_len, ""
    if cap and seq > cap:
        seq, why = max(unit, cap // unit * unit), f"capped at {cap} tokens by the profile"
    options = best.candidate.memory
    while seconds and seq > unit:
        est = estimate(cluster, Workload(cfg, seq, dtype_bytes=dtype.itemsize), best.candidate)
        if est.step_s * 4 <= seconds:  # a warm-up step and the timed ones
            break
        seq, why = max(unit, seq // 2 // unit * unit), "halved to fit the time budget"
    return TrainCase(seq, options.activation_checkpoint, memory=options), answer.seq_len, why
