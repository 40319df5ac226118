"""The GPU check's FP8 part (docs/fp8.md): the step's matmuls in bf16 and in float8 on the device.

:func:`float8_matmul_times` times every block matmul of one training step (the shapes of
:func:`~loongtrain.planner.ceiling.step_matmuls`, the output layer left out as float8 leaves it)
with ``torch.mm`` in bf16 and with ``torch._scaled_mm`` on float8 e4m3 operands (tensorwise scales,
bf16 out: the kernel torchao's tensorwise recipe calls), each shape times its count. The float8
training rows themselves are the training part's (:mod:`loongtrain.tools.gpucheck.train`) with
``TrainCase.float8`` set.
"""

from __future__ import annotations

import torch

from loongtrain.model import ModelConfig
from loongtrain.options import FLOAT8_MIN_CAPABILITY
from loongtrain.planner.ceiling import step_matmuls
from loongtrain.tools.gpucheck.ceiling import _per_call_seconds
from loongtrain.tools.harness import release_memory


def float8_unavailable(device: torch.device) -> str | None:
    """Why the float8 rows cannot run on ``device`` (torchao missing or too old; a GPU without
    FP8 units), or None. The CPU runs ``torch._scaled_mm`` itself (the dry run)."""
    from loongtrain.apply.float8 import require_torchao

    try:
        require_torchao()
    except ValueError as exc:
        return str(exc)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FLOAT8_MIN_CAPABILITY:
        cap = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} has compute capability {cap[0]}.{cap[1]}: no FP8 units (8.9+)"
    return None


def float8_matmul_times(
    model: ModelConfig, tokens: int, device: torch.device, reps: int = 3, min_time_s: float = 0.01
) -> dict:
    """Seconds of one step's block matmuls (forward and both backward products, every layer) in
    bf16 (``torch.mm``) and float8 (``torch._scaled_mm``), their ratio, and each shape's."""
    gen = torch.Generator(device).manual_seed(0)
    counts: dict[tuple[int, int, int], int] = {}
    for mm in step_matmuls(model, tokens):
        if mm.in_layer:
            counts[mm.shape] = counts.get(mm.shape, 0) + mm.count
    shapes, bf16_s, fp8_s = [], 0.0, 0.0
    one = torch.ones((), device=device)
    for (m, k, n), count in sorted(counts.items()):
        a = torch.randn(m, k, generator=gen, device=device).bfloat16()
        b = torch.randn(n, k, generator=gen, device=device).bfloat16()
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        mm16 = _per_call_seconds(lambda a=a, b=b: torch.mm(a, b.t()), reps, device, min_time_s)
        mm8 = _per_call_seconds(
            lambda a8=a8, b8=b8: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
            reps, device, min_time_s,
        )  # fmt: skip
        shapes.append({"shape": [m, k, n], "count": count, "bf16_s": mm16, "fp8_s": mm8})
        bf16_s += count * mm16
        fp8_s += count * mm8
        del a, b, a8, b8
        release_memory(device)
    return {"tokens": tokens, "bf16_s": bf16_s, "fp8_s": fp8_s, "speedup": bf16_s / fp8_s, "shapes": shapes}
