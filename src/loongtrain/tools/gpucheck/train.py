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

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loongtrain.apply import MemoryOptions, materialize, parallelize
from loongtrain.apply.compile import compile_counts
from loongtrain.config import OptimSection
from loongtrain.data.batch import Microbatch
from loongtrain.model import ModelConfig, build_model
from loongtrain.model.loss import IGNORE_INDEX
from loongtrain.options import Float8Options, GuardOptions, checkpoint_label
from loongtrain.parallel import ParallelConfig, ParallelState, init_parallel
from loongtrain.planner import Candidate, ClusterSpec, PlanError, Workload, cluster_spec, estimate
from loongtrain.planner.policy import CheckpointPolicy, auto_policy
from loongtrain.planner.report import format_length
from loongtrain.planner.specs import CLUSTER_PRESETS
from loongtrain.tools.bench.documents import document_lengths
from loongtrain.tools.gpucheck.goals import SAME_LOSS_RTOL
from loongtrain.tools.harness import median_time, sync
from loongtrain.train.guard import GuardStop, StepGuard
from loongtrain.train.guard_actions import nonfinite_summary
from loongtrain.train.memory_policy import USABLE_FRACTION
from loongtrain.train.metrics import device_peak_tflops, mfu, reset_peak_memory
from loongtrain.train.spec import build_optimizer
from loongtrain.train.step import forward_backward
from loongtrain.train.trainer import peak_memory_gib, train_step

GiB = 2**30
ZERO = "dp_sp"  # one rank: FSDP2 only for the bf16 mixed precision


@dataclass(frozen=True)
class TrainCase:
    """One training row: sequence length, checkpoint mode (``auto``: the planner's policy for
    this device, resolved by :func:`resolve_auto_case`), whether blocks are compiled, and (the
    longest-sequence row) every memory option."""

    seq: int
    checkpoint: str
    compiled: bool = False
    memory: MemoryOptions | None = None
    policy: str = ""  # auto, resolved: the checkpointing chosen, in words
    float8: str = ""  # the blocks' linears in float8 with this torchao recipe ("": the compute dtype)

    @property
    def options(self) -> MemoryOptions:
        return self.memory or MemoryOptions(activation_checkpoint=self.checkpoint)

    @property
    def float8_options(self) -> Float8Options:
        return Float8Options(enabled=bool(self.float8), recipe_name=self.float8 or "tensorwise")

    def label(self) -> str:
        text = f"S={format_length(self.seq)} {self.checkpoint}" + (" compiled" if self.compiled else "")
        text += f" float8 {self.float8}" if self.float8 else ""
        if self.policy:
            return f"{text}: {self.policy}"
        if self.memory is not None:
            m = self.memory
            offload = [n for n, on in (("activations", m.offload_activations), ("states", m.offload_states)) if on]
            text += f" loss_chunk {m.loss_chunk} mlp_tile {m.mlp_tile}"
            text += f" head_groups {m.head_groups}" if m.head_groups > 1 else ""
            text += f" offload {'+'.join(offload) or 'none'}"
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
    workload = Workload(cfg, case.seq, batch=1, micro_batch=1, dtype_bytes=dtype_bytes, float8=case.float8)
    layout = Candidate(ParallelConfig(dp=1), ZERO, case.options)
    est = estimate(cluster, workload, layout)
    return {
        "step_s": est.step_s,
        "mfu": est.mfu,
        "memory_gib": est.memory.total / GiB,
        "fits": est.fits,
    }


def auto_budget_bytes(device: torch.device, budget_gib: float) -> float:
    """What ``auto`` may fill: ``budget_gib`` if given, else 90% of the GPU's memory (as the trainer)."""
    if budget_gib:
        return budget_gib * GiB
    if device.type != "cuda":
        raise ValueError(f"an auto checkpoint row on {device.type} needs a budget in GiB (auto_budget_gib)")
    return torch.cuda.get_device_properties(device).total_memory * USABLE_FRACTION


def resolve_auto_case(
    case: TrainCase, cfg: ModelConfig, dtype: torch.dtype, budget_bytes: float, gpu: bool
) -> tuple[TrainCase, CheckpointPolicy | None]:
    """``case`` with ``auto`` resolved as the trainer resolves it (the planner's memory model, the
    least recompute that fits ``budget_bytes``; ``gpu``: the GPU kernels' workspace priced), and the
    choice; other cases as they are."""
    if case.checkpoint != "auto":
        return case, None
    workload = Workload(cfg, case.seq, batch=1, micro_batch=1, dtype_bytes=dtype.itemsize)
    memory = dataclasses.replace(case.options, activation_checkpoint="auto", device_memory_gib=0.0)
    policy = auto_policy(workload, ParallelConfig(dp=1), ZERO, memory, budget_bytes, gpu=gpu)
    label = checkpoint_label(policy.candidate.memory, cfg.n_layers)
    return dataclasses.replace(case, memory=policy.candidate.memory, policy=label), policy


def one_rank_state() -> ParallelState:
    """The parallel state of a one-rank process group (no sequence parallelism)."""
    return init_parallel(ParallelConfig(), verify_inputs=False, zero_scopes=(ZERO,))


def _build(
    state: ParallelState, cfg: ModelConfig, case: TrainCase, dtype: torch.dtype, device: torch.device,
    optim: OptimSection | None = None,
):  # fmt: skip
    """The trainer's model (seed 0) and optimizer (``optim``; default: ``[optim]``'s defaults) for
    ``case`` on one rank."""
    model = build_model(cfg)
    parallelize(
        model, state, memory=case.options, zero=ZERO, param_dtype=dtype, compile=case.compiled,
        float8=case.float8_options,
    )  # fmt: skip
    materialize(model, device, seed=0)
    optim = optim or OptimSection()
    return model, build_optimizer(model.parameters(), optim), optim


def random_tokens(cfg: ModelConfig, seq: int, device: torch.device) -> torch.Tensor:
    """``[1, seq + 1]`` token ids drawn with seed 0 on ``device``."""
    gen = torch.Generator(device).manual_seed(0)
    return torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=gen, device=device)


def measure_training_step(
    state: ParallelState,
    cfg: ModelConfig,
    case: TrainCase,
    dtype: torch.dtype,
    device: torch.device,
    steps: int,
    warmup: int,
    peak: Peak,
    batch: list | None = None,
    optim: OptimSection | None = None,
    profile_step: Callable[[Callable[[], float]], object] | None = None,
) -> dict:
    """Build, time ``steps`` training steps after ``warmup`` ones, and report throughput and memory
    (every step's loss too). ``batch``: the microbatches of each step (default: one random sequence);
    ``optim``: AdamW's settings and the clip (default: ``[optim]``'s defaults); ``profile_step``: called
    after the timed steps with a function that runs one more step (not timed), e.g. to profile it.

    The model and optimizer are freed when this returns; call :func:`~loongtrain.tools.harness.release_memory` then."""
    model, optimizer, optim = _build(state, cfg, case, dtype, device, optim)
    if batch is None:
        data = random_tokens(cfg, case.seq, device)
        batch = [(data[:, :-1], data[:, 1:])]
    losses: list[float] = []
    guard = StepGuard(GuardOptions(nonfinite="stop", spike="off"))  # the trainer's guard: never a NaN row

    def step() -> float:
        sync(device)
        t0 = time.perf_counter()
        out = train_step(model, optimizer, state, batch, lr=optim.lr, grad_clip=optim.grad_clip, guard=guard)
        if out.verdict.action == "stop":
            raise GuardStop(f"training step {len(losses) + 1}: {nonfinite_summary(out)}; the step was not applied")
        losses.append(out.loss)
        sync(device)
        return time.perf_counter() - t0

    keys = None  # every microbatch's keys under its documents and window (what the kernels compute)
    if any(isinstance(mb, Microbatch) for mb in batch):
        keys = sum(mb.attention_keys(cfg.sliding_window) for mb in batch) / case.seq
    flops = cfg.flops_per_token(case.seq, keys_per_query=keys)
    return timed_steps(step, steps, warmup, device, case.seq, flops, peak, losses, profile_step, case.compiled)


def timed_steps(
    step: Callable[[], float],
    steps: int,
    warmup: int,
    device: torch.device,
    seq: int,
    flops_per_token: float,
    peak: Peak,
    losses: list[float],
    profile_step: Callable[[Callable[[], float]], object] | None = None,
    compiled: bool = False,
) -> dict:
    """Run ``warmup`` then ``steps`` calls of ``step`` (each returns its seconds and appends its
    loss to ``losses``), peak memory over the timed ones, then ``profile_step(step)`` if given:
    the row's median step, tokens/s of ``seq``-token steps, model TFLOP/s, MFU, peak memory, losses;
    ``compiled``: also the graphs compiled in the warm-up and in the timed steps (recompiles), and
    the graph breaks (``compile``)."""
    start = compile_counts()
    first = [step() for _ in range(warmup)]
    warm = compile_counts()
    reset_peak_memory(device)
    step_s = statistics.median(step() for _ in range(steps))
    peak_gib = peak_memory_gib(device)
    end = compile_counts()
    if profile_step is not None:
        profile_step(step)
    tokens_per_s = seq / step_s
    compile_stats = {
        "graphs_in_warmup": warm["graphs"] - start["graphs"],
        "graphs_in_timed_steps": end["graphs"] - warm["graphs"],
        "graph_breaks": end["graph_breaks"] - start["graph_breaks"],
    }
    return {
        "compile": compile_stats if compiled else None,
        "step_s": step_s,
        "warmup_s": sum(first),
        "tokens_per_s": tokens_per_s,
        "flops_per_token": flops_per_token,
        "tflops": tokens_per_s * flops_per_token / 1e12,
        "mfu": mfu(tokens_per_s, flops_per_token, peak.tflops),
        "peak_tflops": peak.tflops,
        "peak_memory_gib": peak_gib,
        "losses": losses,
        "finite": all(math.isfinite(x) for x in losses),
    }


#: How much longer than the planner's step a GPU step took on 2026-12-04 (measured / predicted:
#: 1.8x without offload, 2.9x with every memory option): the longest row's time is sized with it
#: until the planner is calibrated on the GPU.
PLANNER_OPTIMISM = 3.0


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
        if est.step_s * 4 * PLANNER_OPTIMISM <= seconds:  # a warm-up step, the timed ones, and the build
            break
        seq, why = max(unit, seq // 2 // unit * unit), "halved to fit the time budget"
    return TrainCase(seq, options.activation_checkpoint, memory=options), answer.seq_len, why


#: What a row costs beside its steps on a GPU: building the model and optimizer and the warm-up's
#: one-off work (kernel plans, the allocator's growth). A guess until a GPU run records it: every
#: row of the check and of the peer benchmark carries its estimate and its wall time.
BUILD_S = 10.0
#: Measured / planned step time on one H200 (2026-12-04): loongtrain 1.8x without offload, 2.9x with
#: every memory option (:data:`PLANNER_OPTIMISM`); transformers 1.2-1.35x of the planner's step
#: with the same checkpointing.
STEP_FACTOR = 2.0
PEER_STEP_FACTOR = 1.5


def row_seconds(
    cluster: ClusterSpec | None, cfg: ModelConfig, case: TrainCase, dtype: torch.dtype, steps: int,
    factor: float = STEP_FACTOR,
) -> float:  # fmt: skip
    """Estimated wall seconds of a row of ``steps`` steps (warm-up and profiled ones included) of
    ``case``: :data:`BUILD_S` + ``steps`` x ``factor`` x the planner's step on one device of
    ``cluster``; 0 without a cluster (nothing to estimate with: the row starts while any budget is left)."""
    if cluster is None:
        return 0.0
    return BUILD_S + steps * factor * predict_step(cluster, cfg, case, dtype)["step_s"]


def offload_pair(
    state: ParallelState, cfg: ModelConfig, case: TrainCase, dtype: torch.dtype, device: torch.device, steps: int,
    peak: Peak, release,
) -> dict:  # fmt: skip
    """``case`` (its memory options offloading activations and states) and the same run without
    offload, ``steps`` steps each from the same weights and data: each step's loss finite and the
    two runs' losses equal within :data:`SAME_LOSS_RTOL` (the copies are exact; the host optimizer
    rounds as the device's). ``release`` frees the device between the runs."""
    memory = case.options
    plain = TrainCase(case.seq, case.checkpoint, memory=dataclasses.replace(
        memory, offload_activations=False, offload_states=False))  # fmt: skip
    runs = {}
    for name, run in (("offload", case), ("no offload", plain)):
        try:
            runs[name] = measure_training_step(state, cfg, run, dtype, device, steps - 1, 1, peak)
        finally:
            release()
    same, worst = _same_losses(runs["offload"], runs["no offload"])
    result = {**runs["offload"], "baseline": runs["no offload"], "max_rel_diff": worst, "same": same}
    if not same:  # which offload it is: each alone, beside the same baseline
        for name, acts, states in (("activations only", True, False), ("states only", False, True)):
            one = TrainCase(case.seq, case.checkpoint, memory=dataclasses.replace(
                memory, offload_activations=acts, offload_states=states))  # fmt: skip
            try:
                m = measure_training_step(state, cfg, one, dtype, device, steps - 1, 1, peak)
                result[name] = {"losses": m["losses"], "same": _same_losses(m, runs["no offload"])[0]}
            except Exception as exc:  # noqa: BLE001 - reported beside the row
                result[name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            finally:
                release()
    return result


def _same_losses(a: dict, b: dict) -> tuple[bool, float]:
    """Whether two runs' losses are finite and within :data:`SAME_LOSS_RTOL` step by step, and the worst."""
    worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a["losses"], b["losses"]))
    return a["finite"] and b["finite"] and worst <= SAME_LOSS_RTOL, worst


def packed_documents(cfg: ModelConfig, seq: int, median: int, device: torch.device, seed: int = 0) -> Microbatch:
    """One packed row of ``seq`` random tokens cut into lognormal documents (median ``median``),
    labels the next token of the same document (a document's last token predicts nothing)."""
    cu = document_lengths("lognormal", seq, median, seed)
    data = random_tokens(cfg, seq, device)
    labels = data[:, 1:].clone()
    ends = torch.tensor(cu[1:], device=device) - 1
    labels[0, ends] = IGNORE_INDEX
    return Microbatch(data[:, :-1], labels, torch.tensor(cu, dtype=torch.int64))


def as_separate_sequences(batch: Microbatch) -> list[Microbatch]:
    """Each document of a packed ``batch`` as a microbatch of its own (one sequence, no boundaries)."""
    cu = batch.cu_seqlens.tolist()
    return [Microbatch(batch.tokens[:, a:b], batch.labels[:, a:b]) for a, b in zip(cu[:-1], cu[1:])]


def packed_window_row(
    state: ParallelState, cfg: ModelConfig, case: TrainCase, window: int, median: int, dtype: torch.dtype,
    device: torch.device, steps: int, warmup: int, peak: Peak,
) -> dict:  # fmt: skip
    """Packed documents under a sliding ``window``: the loss of the packed row equal (within
    :data:`SAME_LOSS_RTOL`) to the loss of its documents run as separate sequences, both at the
    initial weights (one normaliser: every target of the row), then timed training steps on it."""
    cfg = dataclasses.replace(cfg, sliding_window=window)
    packed = packed_documents(cfg, case.seq, median, device)
    model, _, _ = _build(state, cfg, case, dtype, device)
    whole = forward_backward(model, state, [packed], backward=False).loss
    apart = forward_backward(model, state, as_separate_sequences(packed), backward=False).loss
    del model
    m = measure_training_step(state, cfg, case, dtype, device, steps, warmup, peak, batch=[packed])
    rel = abs(whole - apart) / max(abs(apart), 1e-12)
    documents = len(packed.cu_seqlens) - 1
    return {**m, "documents": documents, "window": window, "packed_loss": whole, "separate_loss": apart,
            "rel_diff": rel, "same": math.isfinite(whole) and rel <= SAME_LOSS_RTOL}  # fmt: skip
