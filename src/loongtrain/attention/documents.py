"""Packed documents and sliding windows: the mask convention, input checks and token work.

A packed sequence of ``S`` tokens holds documents with global boundaries ``cu_seqlens``
``[0 = c_0 < c_1 < ... < c_D = S]`` (FlashAttention's varlen convention). Token ``i`` sees
token ``j`` iff both lie in the same document, ``j <= i`` when causal, and
``i - j < sliding_window`` when a sliding window is set (``|i - j| < sliding_window`` when not
causal), the convention of the Hugging Face Mistral/Qwen sliding-window masks.

Everything here is pure arithmetic on Python ints (no process group, no tensors needed).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import torch

Boundaries = tuple[int, ...]


def as_boundaries(cu_seqlens: torch.Tensor | Sequence[int] | None, seq_len: int) -> Boundaries | None:
    """Validate ``cu_seqlens`` for a sequence of ``seq_len`` tokens; return it as a tuple of ints.

    ``None`` stays ``None`` (one causal/full mask over the whole sequence). Accepts a 1-D
    integer tensor (a CPU tensor avoids a device synchronisation) or a list/tuple of ints.
    """
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise ValueError(
                f"cu_seqlens must be a 1-D integer tensor [0, ..., S], got dtype {cu_seqlens.dtype} and "
                f"shape {tuple(cu_seqlens.shape)}"
            )
        values = tuple(int(x) for x in cu_seqlens.tolist())
    else:
        try:
            values = tuple(cu_seqlens)
        except TypeError:
            raise TypeError(
                f"cu_seqlens must be a 1-D integer tensor or a list of ints, got {type(cu_seqlens).__name__}"
            ) from None
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in values):
            raise TypeError(f"cu_seqlens must hold ints, got {list(values)[:8]}")
    if len(values) < 2:
        raise ValueError(f"cu_seqlens={list(values)} needs at least two entries [0, ..., S={seq_len}]")
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {values[0]} (document boundaries of the global sequence)")
    if values[-1] != seq_len:
        raise ValueError(
            f"cu_seqlens must end at the global sequence length S={seq_len}, got {values[-1]}; pass the boundaries "
            f"of the whole packed sequence (the same on every rank), not of a shard"
        )
    for index, (a, b) in enumerate(zip(values, values[1:])):
        if b <= a:
            raise ValueError(
                f"cu_seqlens must be strictly increasing, got {a} then {b} at index {index + 1}; drop empty documents"
            )
    return values


def check_sliding_window(sliding_window: int | None) -> int | None:
    """Validate a sliding-window size (``None``: no window)."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window <= 0:
        raise ValueError(
            f"sliding_window={sliding_window!r} must be a positive int (token i sees j when i - j < "
            "sliding_window) or None"
        )
    return sliding_window


def document_of(boundaries: Boundaries, position: int) -> int:
    """Index of the document holding global ``position``."""
    return bisect_right(boundaries, position) - 1


def _causal_keys(first: int, last: int, sliding_window: int | None) -> int:
    """Keys seen by the tokens at in-document positions ``first..last-1`` (causal)."""
    if sliding_window is None or sliding_window >= last:
        return (last * (last + 1) - first * (first + 1)) // 2
    ramp_end = max(first, min(last, sliding_window))  # positions < window see pos+1 keys, later ones window
    ramp = (ramp_end * (ramp_end + 1) - first * (first + 1)) // 2
    return ramp + (last - ramp_end) * sliding_window


def range_work(
    boundaries: Boundaries, start: int, stop: int, causal: bool = True, sliding_window: int | None = None
) -> int:
    """Attention work of global tokens ``[start, stop)``: the number of keys they see, summed."""
    total = 0
    doc = document_of(boundaries, start)
    pos = start
    while pos < stop:
        doc_start, doc_end = boundaries[doc], boundaries[doc + 1]
        end = min(stop, doc_end)
        first, last = pos - doc_start, end - doc_start
        if causal:
            total += _causal_keys(first, last, sliding_window)
        else:
            length = doc_end - doc_start
            total += (
                sum(_full_keys(p, length, sliding_window) for p in range(first, last))
                if sliding_window
                else (last - first) * length
            )
        pos, doc = end, doc + 1
    return total


def _full_keys(p: int, length: int, sliding_window: int) -> int:
    return min(length - 1, p + sliding_window - 1) - max(0, p - sliding_window + 1) + 1
