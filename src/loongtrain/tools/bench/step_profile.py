"""Where one training step's time goes, from a ``torch.profiler`` trace.

A step's wall time is split into four parts, each the union of the intervals of the
matching profiler events on the timeline that runs the step (the main thread on CPU, the
device's kernels on a GPU), claimed in this order of precedence:

- ``attention``: the block-attention kernels (SDPA flash / memory-efficient / CPU flash,
  ``flash_attn``), forward and backward;
- ``communication``: waiting for transfers: the attention's ``loongtrain::comm_wait`` range,
  c10d / gloo / NCCL collectives and FSDP2's all-gather and reduce-scatter;
- ``compute``: every other operator (aten ops, inductor's compiled graphs, the optimizer);
- ``framework``: the rest: Python, module hooks, autograd and FSDP bookkeeping, and (on a
  shared CPU) time the process waited for a core.

The arithmetic is pure (:func:`breakdown` on :class:`Span` lists); :func:`spans_of` reads a
profiler's events.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from loongtrain.attention.comm import WAIT_LABEL

#: The parts of a step, in their order of precedence (framework is what no event covers).
KINDS = ("attention", "communication", "compute")
PARTS = (*KINDS, "framework")

#: Substrings of the names of block-attention kernels (aten ops on CPU, kernels on CUDA).
ATTENTION_NAMES = (
    "scaled_dot_product_flash_attention",
    "scaled_dot_product_efficient_attention",
    "scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_flash_attention_backward",
    "_efficient_attention_forward",
    "_efficient_attention_backward",
    "flash_attn",
    "flash_fwd",
    "flash_bwd",
    "fmha",
)
#: Substrings of the names of transfers and waits for them.
COMMUNICATION_NAMES = (
    WAIT_LABEL,
    "c10d::",
    "gloo:",
    "nccl",
    "record_param_comms",
    "FSDP::all_gather",
    "FSDP::post_backward_reduce",
    "_c10d_functional",
    "wait_tensor",
)
#: Prefixes of operator events (everything else is a Python-level range, not compute).
COMPUTE_PREFIXES = ("aten::", "Torch-Compiled Region", "## Call CompiledFxGraph", "CompiledFunction", "cpp_fused")


@dataclass(frozen=True)
class Span:
    """One event's interval (seconds on any common clock) and its part."""

    start: float
    end: float
    kind: str


def classify(name: str, device_kernel: bool = False) -> str | None:
    """The part an event of this name belongs to, or None (not an operator: framework).

    ``device_kernel``: the event is a kernel on a device stream (every kernel computes).
    """
    if any(s in name for s in ATTENTION_NAMES):
        return "attention"
    if any(s in name for s in COMMUNICATION_NAMES):
        return "communication"
    if device_kernel or name.startswith(COMPUTE_PREFIXES):
        return "compute"
    return None


def breakdown(spans: Iterable[Span], start: float, end: float) -> dict[str, float]:
    """Seconds of ``[start, end]`` per part: each instant goes to the highest-precedence
    part whose span covers it, or to ``framework`` when none does."""
    if end < start:
        raise ValueError(f"breakdown: the step ends ({end}) before it starts ({start})")
    edges: list[tuple[float, int, int]] = []  # (time, +1 open / -1 close, kind index)
    for span in spans:
        lo, hi = max(span.start, start), min(span.end, end)
        if hi > lo:
            kind = KINDS.index(span.kind)
            edges += [(lo, 1, kind), (hi, -1, kind)]
    edges.sort()
    totals = dict.fromkeys(PARTS, 0.0)
    open_count = [0] * len(KINDS)
    last = start
    for t, delta, kind in edges:
        covering = next((k for k, n in enumerate(open_count) if n > 0), None)
        totals[KINDS[covering] if covering is not None else "framework"] += t - last
        open_count[kind] += delta
        last = t
    totals["framework"] += end - last
    return totals


def spans_of(events, step_name: str, device_kernels: bool) -> tuple[list[Span], float, float]:
    """The spans of the step range ``step_name`` in a profiler's ``events()``, and its start
    and end (seconds).

    ``device_kernels``: take the device's kernels (a GPU run) rather than the host thread
    that ran the step (a CPU run: its operators, whose nesting the precedence resolves).
    """
    step = next((e for e in events if e.name == step_name), None)
    if step is None:
        raise ValueError(f"no profiler range named {step_name!r}: profile the step inside record_function")
    start, end = step.time_range.start, step.time_range.end
    spans = []
    for e in events:
        if e is step:
            continue
        on_device = e.device_type.name != "CPU"
        if on_device != device_kernels or (not on_device and e.thread != step.thread):
            continue
        kind = classify(e.name, device_kernel=on_device)
        if kind is not None:
            spans.append(Span(e.time_range.start / 1e6, e.time_range.end / 1e6, kind))
    return spans, start / 1e6, end / 1e6
