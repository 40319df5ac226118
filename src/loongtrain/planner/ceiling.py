"""The ceiling of one training step: the best measured kernels only.

A step of one sequence of ``tokens`` tokens is priced as its matmuls at their shapes (the q, k,
v, o projections and the SwiGLU ``w1``/``w3``/``w2`` of every layer, and the output layer over
the vocabulary; each forward matmul with its two backward ones) and the attention kernel's
forward and backward of each layer, every one at a rate measured on the device
(:mod:`loongtrain.tools.gpucheck.ceiling` measures them). No elementwise work, no launches, no
communication: that is the definition. A training step's tokens/s divided by the ceiling's
(:func:`fraction_of_ceiling`) says how much of the step goes to everything else.

Shapes: ``(M, K, N)`` is ``[M, K] x [K, N]``. A forward ``(M, K, N)`` (``M`` tokens) has the
input gradient ``(M, N, K)`` and the weight gradient ``(N, M, K)`` (``dY^T X``, the
``[out, in]`` weight of ``nn.Linear``).

FLOPs: the model FLOPs are :meth:`ModelConfig.flops_per_token` times ``tokens`` (the MFU
definition): the matmuls above forward and backward, and the causal attention, ``4 * H *
head_dim * (S + 1) / 2`` per token and layer forward, 2x that backward. The attention backward
kernel does :data:`~loongtrain.planner.cost.BWD_FLOP_RATIO` (2.5) times its forward (it
re-computes the scores): the extra 0.5 is ``score_recompute_flops``. A checkpointing policy
re-runs the checkpointed layers' forward matmuls (``sc++``), and also their attention forward
(``full``): ``recompute_flops``.

Pure Python: no torch, no process group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from loongtrain.model.config import ModelConfig
from loongtrain.options import ACTIVATION_CHECKPOINT_MODES
from loongtrain.planner.cost import BWD_FLOP_RATIO

Shape = tuple[int, int, int]

#: the three matmuls of one linear layer in a training step
PHASES: tuple[str, ...] = ("forward", "grad_input", "grad_weight")


@dataclass(frozen=True)
class Matmul:
    """One matmul of a training step: ``count`` calls of ``shape`` (``(M, K, N)``: ``[M, K] x [K, N]``).

    ``name`` is the weight (``wq``, ``wk``, ``wv``, ``wo``, ``w1``, ``w3``, ``w2``, ``output``),
    ``phase`` one of :data:`PHASES`, ``in_layer`` whether it belongs to a transformer layer
    (``count`` = layers; a checkpointed layer re-runs its forward ones)."""

    name: str
    phase: str
    shape: Shape
    count: int
    in_layer: bool

    @property
    def flops(self) -> float:
        """FLOPs of all ``count`` calls (a multiply-add counts 2)."""
        m, k, n = self.shape
        return 2.0 * m * k * n * self.count


@dataclass(frozen=True)
class KernelRates:
    """Measured rates for :func:`ceiling_step` at ``tokens`` tokens.

    ``matmul_tflops``: TFLOP/s of ``torch.mm`` at each shape of :func:`matmul_shapes`
    (``2*M*K*N / seconds / 1e12``). ``attention_fwd_s`` / ``attention_bwd_s``: seconds of one
    layer's attention kernel, forward and backward, over the whole causal sequence."""

    tokens: int
    matmul_tflops: Mapping[Shape, float]
    attention_fwd_s: float
    attention_bwd_s: float


@dataclass(frozen=True)
class Ceiling:
    """The ceiling of one step under one checkpointing policy.

    Seconds: ``matmul_s`` (forward and backward matmuls, output layer included), ``attention_s``
    (the attention kernels, forward and backward, every layer), ``recompute_s`` (the policy's
    re-run forwards). FLOPs: ``model_flops = matmul_flops + attention_flops`` (the MFU
    definition); the step also executes ``score_recompute_flops`` (inside the attention
    backward, timed in ``attention_s``) and ``recompute_flops``. ``mfu`` is ``None`` without a peak.
    """

    tokens: int
    mode: str
    checkpointed: int
    step_s: float
    tokens_per_s: float
    matmul_s: float
    attention_s: float
    recompute_s: float
    matmul_flops: float
    attention_flops: float
    score_recompute_flops: float
    recompute_flops: float
    model_flops: float
    peak_tflops: float | None
    mfu: float | None

    @property
    def executed_flops(self) -> float:
        """Every FLOP the step's kernels run: model FLOPs plus both kinds of recomputation."""
        return self.model_flops + self.score_recompute_flops + self.recompute_flops


def _check_tokens(tokens: int) -> None:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise ValueError(f"tokens={tokens!r} must be a positive integer (the length of the one sequence of a step)")


def step_matmuls(model: ModelConfig, tokens: int) -> tuple[Matmul, ...]:
    """The matmuls of one training step on one sequence of ``tokens`` tokens, forward and backward."""
    _check_tokens(tokens)
    d, f, t = model.dim, model.ffn_dim, tokens
    q, kv = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    weights = [
        ("wq", d, q, True), ("wk", d, kv, True), ("wv", d, kv, True), ("wo", q, d, True),
        ("w1", d, f, True), ("w3", d, f, True), ("w2", f, d, True), ("output", d, model.vocab_size, False),
    ]  # fmt: skip
    out = []
    for name, k, n, in_layer in weights:
        count = model.n_layers if in_layer else 1
        for phase, shape in zip(PHASES, ((t, k, n), (t, n, k), (n, t, k))):
            out.append(Matmul(name, phase, shape, count, in_layer))
    return tuple(out)


def matmul_shapes(model: ModelConfig, tokens: int) -> tuple[Shape, ...]:
    """The distinct matmul shapes of a step (sorted): the ones to measure for :class:`KernelRates`."""
    return tuple(sorted({m.shape for m in step_matmuls(model, tokens)}))


def attention_forward_flops(model: ModelConfig, tokens: int) -> float:
    """Model FLOPs of one layer's causal attention forward over ``tokens`` tokens (as
    :meth:`ModelConfig.flops_per_token` counts it: ``4 * H * head_dim * (S + 1) / 2`` per token);
    the backward kernel runs ``BWD_FLOP_RATIO`` times this."""
    _check_tokens(tokens)
    return 2.0 * model.n_heads * model.head_dim * tokens * (tokens + 1)


def check_policy(model: ModelConfig, mode: str, checkpointed: int) -> None:
    """Raise ValueError unless ``mode`` is a checkpoint mode and ``checkpointed`` a layer count it allows."""
    if mode not in ACTIVATION_CHECKPOINT_MODES:
        raise ValueError(f"unknown checkpoint mode {mode!r}; choose one of {list(ACTIVATION_CHECKPOINT_MODES)}")
    if isinstance(checkpointed, bool) or not isinstance(checkpointed, int) or checkpointed < 0:
        raise ValueError(f"checkpointed={checkpointed!r} must be a layer count from 0 to {model.n_layers}")
    if checkpointed > model.n_layers:
        raise ValueError(
            f"checkpointed={checkpointed} but the model has {model.n_layers} layers; use at most {model.n_layers}"
        )
    if mode == "none" and checkpointed:
        raise ValueError(
            f"mode 'none' checkpoints no layer but checkpointed={checkpointed}; use 0 or mode 'sc++'/'full'"
        )


def _check_rates(model: ModelConfig, tokens: int, rates: KernelRates) -> None:
    if rates.tokens != tokens:
        raise ValueError(
            f"the rates were measured at tokens={rates.tokens}, the step has tokens={tokens}; measure at {tokens}"
        )
    missing = [s for s in matmul_shapes(model, tokens) if s not in rates.matmul_tflops]
    if missing:
        raise ValueError(f"no measured rate for matmul shape(s) {missing}; measure every shape of matmul_shapes()")
    bad = {s: r for s, r in rates.matmul_tflops.items() if not r > 0}
    if bad:
        raise ValueError(f"matmul rates must be positive TFLOP/s, got {bad}")
    for name in ("attention_fwd_s", "attention_bwd_s"):
        value = getattr(rates, name)
        if not value > 0:
            raise ValueError(f"{name}={value!r} must be positive seconds")


def ceiling_step(
    model: ModelConfig,
    tokens: int,
    mode: str,
    checkpointed: int,
    rates: KernelRates,
    peak_tflops: float | None = None,
) -> Ceiling:
    """The ceiling of one step of one ``tokens``-token sequence when ``checkpointed`` layers are
    checkpointed in ``mode`` (``none``, ``sc++``, ``full``), from measured ``rates``; MFU
    against ``peak_tflops`` (dense TFLOP/s; ``None``: no MFU)."""
    _check_tokens(tokens)
    check_policy(model, mode, checkpointed)
    _check_rates(model, tokens, rates)
    if peak_tflops is not None and not peak_tflops > 0:
        raise ValueError(f"peak_tflops={peak_tflops!r} must be positive (or None: no MFU)")

    def seconds(m: Matmul) -> float:
        return m.flops / (rates.matmul_tflops[m.shape] * 1e12)

    matmuls = step_matmuls(model, tokens)
    layer_forward = [m for m in matmuls if m.in_layer and m.phase == "forward"]
    matmul_s = sum(seconds(m) for m in matmuls)
    matmul_flops = sum(m.flops for m in matmuls)
    n = model.n_layers
    attention_s = n * (rates.attention_fwd_s + rates.attention_bwd_s)
    attn = attention_forward_flops(model, tokens)
    reruns = 0 if mode == "none" else checkpointed  # each checkpointed layer's forward runs once more
    recompute_s = reruns * sum(seconds(m) for m in layer_forward) / n
    recompute_flops = reruns * sum(m.flops for m in layer_forward) / n
    if mode == "full":
        recompute_s += reruns * rates.attention_fwd_s
        recompute_flops += reruns * attn
    step_s = matmul_s + attention_s + recompute_s
    model_flops = matmul_flops + 3 * n * attn
    mfu = model_flops / step_s / (peak_tflops * 1e12) if peak_tflops else None
    return Ceiling(
        tokens=tokens, mode=mode, checkpointed=checkpointed, step_s=step_s, tokens_per_s=tokens / step_s,
        matmul_s=matmul_s, attention_s=attention_s, recompute_s=recompute_s, matmul_flops=matmul_flops,
        attention_flops=3 * n * attn, score_recompute_flops=(BWD_FLOP_RATIO - 2) * n * attn,
        recompute_flops=recompute_flops, model_flops=model_flops, peak_tflops=peak_tflops, mfu=mfu,
    )  # fmt: skip


def standard_policies(model: ModelConfig) -> tuple[tuple[str, int], ...]:
    """The policies the GPU check prices: no checkpointing, ``sc++`` and ``full`` on every layer."""
    return (("none", 0), ("sc++", model.n_layers), ("full", model.n_layers))


def fraction_of_ceiling(measured_tokens_per_s: float, ceiling: Ceiling) -> float:
    """A measured step's tokens/s as a fraction of the ceiling's (same model, tokens and policy)."""
    if not measured_tokens_per_s > 0:
        raise ValueError(f"measured_tokens_per_s={measured_tokens_per_s!r} must be positive")
    return measured_tokens_per_s / ceiling.tokens_per_s
