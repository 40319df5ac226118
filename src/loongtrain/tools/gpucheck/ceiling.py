"""The GPU check's ceiling row: the rates of a step's kernels measured on this device, and the
step time they allow (:mod:`loongtrain.planner.ceiling`: the best measured kernels only, no
elementwise work, no launches).

Each distinct matmul shape is timed with ``torch.mm`` on contiguous random matrices of the
compute dtype; the attention is loongtrain's chosen kernel (``block_forward`` /
``block_backward``) on one causal sequence. A timed run repeats the call enough times to last
``min_time_s`` (so a short kernel's launch and the device sync are spread thin); the rate is
the median of ``reps`` such runs after a warm-up, each waiting for the device.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from loongtrain.attention.backends import chosen_kernel
from loongtrain.attention.kernels import block_backward, block_forward
from loongtrain.model.config import ModelConfig
from loongtrain.planner.ceiling import (
    KernelRates,
    Shape,
    attention_forward_flops,
    ceiling_step,
    matmul_shapes,
    standard_policies,
    step_matmuls,
)
from loongtrain.planner.cost import BWD_FLOP_RATIO
from loongtrain.tools.harness import make_inputs, median_time, release_memory
from loongtrain.train.metrics import device_peak_tflops


def _per_call_seconds(fn, reps: int, device: torch.device, min_time_s: float) -> float:
    """Seconds of one ``fn()``: median of ``reps`` runs of ``n`` back-to-back calls, ``n`` chosen
    so that a run lasts about ``min_time_s``."""
    once = median_time(fn, 1, device)  # after a warm-up (kernel selection, workspace)
    n = max(1, min(1000, math.ceil(min_time_s / max(once, 1e-9))))

    def run() -> None:
        for _ in range(n):
            fn()

    return median_time(run, reps, device) / n


def matmul_rates(
    shapes: tuple[Shape, ...], dtype: torch.dtype, device: torch.device, reps: int = 3, min_time_s: float = 0.01
) -> dict[Shape, float]:
    """Measured ``torch.mm`` TFLOP/s at each ``(M, K, N)`` shape (``[M, K] x [K, N]``), freeing
    each shape's matrices before the next."""
    gen = torch.Generator(device).manual_seed(0)
    rates: dict[Shape, float] = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=gen, device=device, dtype=dtype)
        b = torch.randn(k, n, generator=gen, device=device, dtype=dtype)
        c = torch.empty(m, n, device=device, dtype=dtype)
        seconds = _per_call_seconds(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), reps, device, min_time_s)
        rates[(m, k, n)] = 2.0 * m * k * n / seconds / 1e12
        del a, b, c
        release_memory(device)
    return rates


def _attention_times(
    model: ModelConfig, tokens: int, dtype: torch.dtype, device: torch.device, reps: int, min_time_s: float
) -> tuple[float, float]:
    q, k, v, dout = make_inputs(1, tokens, model.n_heads, model.n_kv_heads, model.head_dim, dtype, device=device)
    scale = model.head_dim**-0.5
    out, lse = block_forward(q, k, v, causal=True, scale=scale)

    def forward() -> None:
        block_forward(q, k, v, causal=True, scale=scale)

    def backward() -> None:
        block_backward(dout, q, k, v, out, lse, causal=True, scale=scale)

    return _per_call_seconds(forward, reps, device, min_time_s), _per_call_seconds(backward, reps, device, min_time_s)


def attention_seconds(
    model: ModelConfig, tokens: int, dtype: torch.dtype, device: torch.device, reps: int = 3,
    min_time_s: float = 0.01,
) -> tuple[float, float]:  # fmt: skip
    """Forward and backward seconds of one layer's attention (all heads) over one causal
    sequence of ``tokens`` tokens, on loongtrain's chosen kernel (its inputs freed after)."""
    times = _attention_times(model, tokens, dtype, torch.device(device), reps, min_time_s)
    release_memory(torch.device(device))  # the inputs died with the call
    return times


def measure_rates(
    model: ModelConfig, tokens: int, dtype: torch.dtype, device: torch.device, reps: int = 3,
    min_time_s: float = 0.01,
) -> KernelRates:  # fmt: skip
    """The rates :func:`~loongtrain.planner.ceiling.ceiling_step` needs, measured on ``device``."""
    device = torch.device(device)
    rates = matmul_rates(matmul_shapes(model, tokens), dtype, device, reps, min_time_s)
    fwd, bwd = attention_seconds(model, tokens, dtype, device, reps, min_time_s)
    return KernelRates(tokens, rates, fwd, bwd)


def ceiling_report(
    model: ModelConfig,
    rates: KernelRates,
    policies: tuple[tuple[str, int], ...] | None = None,
    peak_tflops: float | None = None,
) -> dict:
    """A JSON-ready report of ``rates`` and the ceiling of each ``(mode, checkpointed)`` policy
    (default: none, sc++ and full on every layer); MFU against ``peak_tflops`` when given."""
    tokens = rates.tokens
    uses: dict[Shape, list[str]] = {}
    for m in step_matmuls(model, tokens):
        uses.setdefault(m.shape, []).append(f"{m.name}.{m.phase}")
    attn = attention_forward_flops(model, tokens)
    rows = []
    for mode, checkpointed in policies or standard_policies(model):
        ceiling = ceiling_step(model, tokens, mode, checkpointed, rates, peak_tflops)
        rows.append({**dataclasses.asdict(ceiling), "executed_flops": ceiling.executed_flops})
    return {
        "tokens": tokens,
        "matmuls": [
            {
                "shape": list(shape),
                "tflops": tflops,
                "seconds": 2.0 * math.prod(shape) / (tflops * 1e12),
                "uses": uses.get(shape, []),
            }
            for shape, tflops in sorted(rates.matmul_tflops.items())
        ],  # fmt: skip
        "attention": {
            "fwd_s": rates.attention_fwd_s,
            "bwd_s": rates.attention_bwd_s,
            "fwd_tflops": attn / rates.attention_fwd_s / 1e12,
            "bwd_tflops": BWD_FLOP_RATIO * attn / rates.attention_bwd_s / 1e12,  # executed FLOPs
        },
        "peak_tflops": peak_tflops,
        "policies": rows,
    }


def measure_ceiling(
    model: ModelConfig,
    tokens: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    reps: int = 3,
    min_time_s: float = 0.01,
    policies: tuple[tuple[str, int], ...] | None = None,
    peak_tflops: float | None = None,
) -> tuple[KernelRates, dict]:
    """Measure the rates on ``device`` and report the ceiling of each policy (see
    :func:`ceiling_report`): ``(rates, report)``; ``peak_tflops`` ``None``: the spec sheet's of a
    known GPU, else no MFU."""
    device = torch.device(device)
    rates = measure_rates(model, tokens, dtype, device, reps, min_time_s)
    peak = peak_tflops if peak_tflops is not None else device_peak_tflops(device, dtype)
    report = ceiling_report(model, rates, policies, peak)
    report["dtype"] = str(dtype).removeprefix("torch.")
    report["device"] = str(device)
    report["attention"]["kernel"] = chosen_kernel(device)
    return rates, report
