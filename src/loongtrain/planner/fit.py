"""Least-squares fits for calibration. Pure.

Fits minimise the *relative* error (weights ``1/t^2``), so small measurements decide the
intercept (latency, kernel overhead) and large ones the slope (bandwidth, throughput)
instead of the largest sizes deciding both.
"""

from __future__ import annotations

from collections.abc import Sequence


def fit_line(xs: Sequence[float], ts: Sequence[float], min_intercept: float = 1e-6) -> tuple[float, float]:
    """Fit ``t = a + b * x`` (``a >= min_intercept``, ``b > 0``); returns ``(a, b)``.

    When the intercept comes out below ``min_intercept`` it is pinned there and the slope
    refitted.
    """
    if len(xs) != len(ts) or len(xs) < 2:
        raise ValueError(f"fit_line needs at least two (x, t) pairs, got {len(xs)} x and {len(ts)} t")
    if len(set(xs)) < 2:
        raise ValueError("fit_line: all x are equal; measure at several sizes")
    ws = [1.0 / (t * t) for t in ts]
    sw = sum(ws)
    sx = sum(w * x for w, x in zip(ws, xs))
    sxx = sum(w * x * x for w, x in zip(ws, xs))
    st = sum(w * t for w, t in zip(ws, ts))
    sxt = sum(w * x * t for w, x, t in zip(ws, xs, ts))
    b = (sw * sxt - sx * st) / (sw * sxx - sx * sx)
    a = (st - b * sx) / sw
    if a < min_intercept:
        a = min_intercept
        b = sum(w * x * (t - a) for w, x, t in zip(ws, xs, ts)) / sxx
    if b <= 0:
        raise ValueError(f"fit_line: time does not grow with size (slope {b:.3g}); the measurements are noise")
    return a, b


def fit_two(rows: Sequence[tuple[float, float]], ts: Sequence[float], min_first: float = 1e-6) -> tuple[float, float]:
    """Fit ``t = a * u + b * v`` over rows ``(u, v)`` (``a >= min_first``, ``b > 0``)."""
    ws = [1.0 / (t * t) for t in ts]
    suu = sum(w * u * u for w, (u, _) in zip(ws, rows))
    svv = sum(w * v * v for w, (_, v) in zip(ws, rows))
    suv = sum(w * u * v for w, (u, v) in zip(ws, rows))
    sut = sum(w * u * t for w, (u, _), t in zip(ws, rows, ts))
    svt = sum(w * v * t for w, (_, v), t in zip(ws, rows, ts))
    det = suu * svv - suv * suv
    if det == 0:
        raise ValueError("fit_two: the rows do not determine both coefficients")
    a = (sut * svv - svt * suv) / det
    b = (suu * svt - suv * sut) / det
    if a < min_first:
        a = min_first
        b = sum(w * v * (t - a * u) for w, (u, v), t in zip(ws, rows, ts)) / svv
    if b <= 0:
        raise ValueError(f"fit_two: non-positive coefficient {b:.3g}; the measurements are noise")
    return a, b
