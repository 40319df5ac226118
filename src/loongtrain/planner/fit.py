"""Least-squares fits for calibration, and the local cluster they give. Pure.

Fits minimise the *relative* error (weights ``1/t^2``), so small measurements decide the
intercept (latency, kernel overhead) and large ones the slope (bandwidth, throughput)
instead of the largest sizes deciding both.
"""

from __future__ import annotations

from collections.abc import Sequence

from loongtrain.planner.cost import BWD_FLOP_RATIO
from loongtrain.planner.specs import ClusterSpec


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


# -- the local cluster from calibration measurements ---------------------------------------
def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def fit_cluster(meas: dict, name: str = "local") -> tuple[ClusterSpec, dict[str, str]]:
    """Turn ``loongtrain plan --calibrate``'s raw measurements into a one-node cluster and
    per-field comments: ``(ClusterSpec, {field: comment})``.

    ``meas`` holds (times in seconds, sizes in bytes or forward FLOPs): ``pair``/``ring``
    ``[(bytes, t)]`` exchanges; ``a2a`` ``[(group, bytes, t)]``; ``fwd``/``bwd``
    ``[(fwd FLOPs, t, causal)]`` ring steps (kernel and merge) of every rank at once;
    ``matmul_alone``/``matmul_all`` FLOP/s; ``overlap`` ``{compute, transfer, both}``;
    ``step`` ``{step, block}``: a ring step (block + tiny exchange) of every rank and the
    same block without the exchange; ``host_copy`` ``(bytes, t)``: a host-to-host ``copy_``
    of every rank at once (optional: the host link of CPU processes is a memory copy); plus
    ``nproc``, ``memory_gib``, ``calib_heads``, ``calib_head_dim`` and optional ``cpus``,
    ``threads``, ``date``.

    The host memory for offload is 0: the "devices" of CPU processes are the host's RAM, so
    offloading frees nothing (the planner refuses it on this cluster).
    """
    n = meas["nproc"]
    a_pair, b_pair = fit_line(*zip(*meas["pair"]))
    _, b_ring = fit_line(*zip(*meas["ring"]))
    if meas["a2a"]:
        rows = [(g - 1, (g - 1) / g * nbytes) for g, nbytes, _ in meas["a2a"]]
        a_a2a, b_a2a = fit_two(rows, [t for *_, t in meas["a2a"]])
    else:  # one process: nothing to exchange
        a_a2a, b_a2a = a_pair, b_pair
    t_fwd, s_fwd = fit_line(*zip(*[(f, t) for f, t, causal in meas["fwd"] if not causal]))
    t_bwd, s_bwd = fit_line(*zip(*[(f * BWD_FLOP_RATIO, t) for f, t, causal in meas["bwd"] if not causal]))

    def causal_tile(rows, t0, slope, ratio):
        # a causal block of S tokens costs (1 + tile/S) x its FLOPs: solve for tile
        tiles = []
        for f, t, causal in rows:
            if causal:
                tokens = (f / (2.0 * meas["calib_heads"] * meas["calib_head_dim"])) ** 0.5
                tiles.append(tokens * ((t - t0) / (f * ratio * slope) - 1.0))
        return _median(tiles)

    tile = (causal_tile(meas["fwd"], t_fwd, s_fwd, 1.0) + causal_tile(meas["bwd"], t_bwd, s_bwd, BWD_FLOP_RATIO)) / 2
    ov = meas["overlap"]
    hidden = (ov["compute"] + ov["transfer"] - ov["both"]) / min(ov["compute"], ov["transfer"])
    overlap = min(1.0, max(0.05, hidden))
    step = meas["step"]
    hop_sync = max(0.0, step["step"] - step["block"] - a_pair)
    intra_bw = 1e-9 / b_pair
    host = {}
    if "host_copy" in meas:
        nbytes, t = meas["host_copy"]
        host = dict(host_link_gbs=nbytes / t / 1e9, host_mem_bw_gbs=2 * n * nbytes / t / 1e9, host_memory_gib=0.0)
    spec = ClusterSpec(
        name=name,
        nodes=1,
        devices_per_node=n,
        device_memory_gib=round(meas["memory_gib"] / n, 2),
        usable_memory_fraction=0.8,
        peak_tflops=meas["matmul_alone"] / 1e12,
        matmul_tflops=meas["matmul_all"] / 1e12,
        attn_fwd_tflops=1e-12 / s_fwd,
        attn_bwd_tflops=1e-12 / s_bwd,
        causal_tile=max(1.0, tile),
        kernel_overhead_us=t_fwd * 1e6,
        kernel_bwd_overhead_us=t_bwd * 1e6,
        hop_sync_us=hop_sync * 1e6,
        intra_bw_gbs=intra_bw,
        intra_node_bw_gbs=max(intra_bw, n * 1e-9 / b_ring),
        intra_latency_us=a_pair * 1e6,
        a2a_bw_gbs=1e-9 / b_a2a,
        a2a_latency_us=a_a2a * 1e6,
        nics_per_node=1,
        nic_bw_gbs=intra_bw,
        inter_latency_us=a_pair * 1e6,
        overlap=overlap,
        **host,
        description=f"this machine: {n} gloo processes on {meas.get('cpus', '?')} CPUs, "
        f"{meas.get('threads', '?')} thread(s) each, calibrated {meas.get('date', '')}",
    )
    comments = {
        "devices_per_node": "processes of the calibration (compute rates are per process with all busy)",
        "device_memory_gib": "RAM / processes",
        "peak_tflops": "torch.mm 1024^3 fp32, one process alone (MFU denominator)",
        "matmul_tflops": "torch.mm 1024^3 fp32, every process at once",
        "attn_fwd_tflops": "forward_block (kernel + merge), non-causal half blocks, all at once (fit)",
        "attn_bwd_tflops": "backward_block, 2.5x forward FLOPs, all at once (fit)",
        "causal_tile": "extra work of causal diagonal blocks, (1 + tile/S) (median)",
        "kernel_overhead_us": "intercept of the forward block-time fit",
        "kernel_bwd_overhead_us": "intercept of the backward block-time fit",
        "hop_sync_us": f"ring step {step['step'] * 1e3:.1f} ms - its block {step['block'] * 1e3:.1f} ms - latency "
        "(time-shared cores meeting at each transfer)",
        "intra_bw_gbs": "ring_exchange between two ranks (fit)",
        "intra_node_bw_gbs": "ring_exchange around all ranks at once, summed (fit)",
        "intra_latency_us": "intercept of the two-rank fit",
        "a2a_bw_gbs": "all_to_all_start over pairs and all ranks (fit)",
        "a2a_latency_us": "per peer (fit)",
        "nics_per_node": "one node: never used",
        "nic_bw_gbs": "one node: never used",
        "inter_latency_us": "one node: never used",
        "host_link_gbs": "copy_ between host buffers, every process at once (a CPU process's host link)",
        "host_mem_bw_gbs": "the same copies' reads and writes, all processes together",
        "host_memory_gib": "0: the processes' 'device' memory is this RAM; offload frees nothing",
        "overlap": f"block alone {ov['compute'] * 1e3:.0f} ms, transfer alone {ov['transfer'] * 1e3:.0f} ms, "
        f"both {ov['both'] * 1e3:.0f} ms",
    }
    return spec, comments
