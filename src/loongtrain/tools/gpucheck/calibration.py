"""The GPU check's calibration part: the rates the planner prices a step with, measured on this
device, for ``loongtrain plan --calibrate-gpu`` (:mod:`loongtrain.planner.calibrate_gpu`):

- ``matmul``: one layer's matrix products of the training model at its length (every
  projection forward and both products of its backward), in the training dtype;
- ``attention``: the chosen block kernel on one causal sequence, forward alone and forward +
  backward, at two lengths;
- ``hbm``: a device-to-device copy (bytes read + written per second);
- ``host_link``: pinned host <-> device copies, each direction;
- ``cpu_adamw``: ``torch.optim.AdamW`` (foreach) stepping float32 parameters in host memory (the
  optimizer of offloaded states).

Each is the median of ``reps`` timed runs after a warm-up (waiting for the device).
"""

from __future__ import annotations

import torch

from loongtrain.attention.backends import chosen_kernel
from loongtrain.attention.kernels import block_backward, block_forward
from loongtrain.model import ModelConfig
from loongtrain.tools.harness import make_inputs, median_time, release_memory


def layer_matmul_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """``(in, out)`` features of one layer's projections: q/k/v, o, gate and up, down."""
    d, hd = cfg.dim, cfg.head_dim
    qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd
    return [(d, qkv), (cfg.n_heads * hd, d), (d, 2 * cfg.ffn_dim), (cfg.ffn_dim, d)]


def measure_matmul(cfg: ModelConfig, tokens: int, dtype: torch.dtype, device: torch.device, reps: int) -> dict:
    """One layer's products at ``tokens``: forward ``x @ W^T`` and backward ``dy @ W`` and ``dy^T @ x``."""
    gen = torch.Generator(device).manual_seed(0)
    mats = []
    for fan_in, fan_out in layer_matmul_shapes(cfg):
        x = torch.randn(tokens, fan_in, generator=gen, device=device).to(dtype)
        w = torch.randn(fan_out, fan_in, generator=gen, device=device).to(dtype)
        dy = torch.randn(tokens, fan_out, generator=gen, device=device).to(dtype)
        mats.append((x, w, dy))

    def layer() -> None:
        for x, w, dy in mats:
            torch.mm(x, w.t())
            torch.mm(dy, w)
            torch.mm(dy.t(), x)

    seconds = median_time(layer, reps, device)
    flops = 3 * 2 * tokens * sum(i * o for i, o in layer_matmul_shapes(cfg))
    return {"tokens": tokens, "flops": flops, "seconds": seconds, "tflops": flops / seconds / 1e12}


def measure_attention(seq: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                      reps: int) -> dict:  # fmt: skip
    """The chosen kernel on one causal sequence: the forward and the backward, each timed alone
    (the backward from one saved forward), so ``fwd_bwd_s = fwd_s + bwd_s`` cannot come out below
    the forward's time as two separate timings of forward and forward + backward can on a loaded
    machine."""
    q, k, v, dout = make_inputs(1, seq, heads, kv_heads, head_dim, dtype, device=device)
    scale = head_dim**-0.5

    def forward() -> tuple:
        return block_forward(q, k, v, causal=True, scale=scale)

    out, lse = forward()

    def backward() -> None:
        block_backward(dout, q, k, v, out, lse, causal=True, scale=scale)

    fwd_s, bwd_s = median_time(forward, reps, device), median_time(backward, reps, device)
    return {
        "seq": seq, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "causal": True,
        "kernel": chosen_kernel(device), "fwd_s": fwd_s, "bwd_s": bwd_s, "fwd_bwd_s": fwd_s + bwd_s,
    }  # fmt: skip


def measure_hbm(nbytes: int, device: torch.device, reps: int) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(
        generator=torch.Generator(device).manual_seed(0)
    )
    dst = torch.empty_like(src)
    seconds = median_time(lambda: dst.copy_(src), reps, device)
    return {"bytes": nbytes, "seconds": seconds, "gbs": 2 * nbytes / seconds / 1e9}


def measure_host_link(nbytes: int, device: torch.device, reps: int) -> dict:
    """Pinned host -> device and device -> host copies of ``nbytes`` (one device alone)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = median_time(lambda: dev.copy_(host, non_blocking=True), reps, device)
    d2h = median_time(lambda: host.copy_(dev, non_blocking=True), reps, device)
    return {"bytes": nbytes, "h2d_gbs": nbytes / h2d / 1e9, "d2h_gbs": nbytes / d2h / 1e9}


def measure_cpu_adamw(params: int, reps: int) -> dict:
    """One AdamW step (foreach, the trainer's default off the device) over ``params`` float32
    parameters in 8 tensors, in host memory."""
    tensors = [torch.nn.Parameter(torch.randn(params // 8)) for _ in range(8)]
    for t in tensors:
        t.grad = torch.randn_like(t)
    opt = torch.optim.AdamW(tensors, lr=1e-4, foreach=True)
    seconds = median_time(opt.step, reps, None)
    return {"params": params // 8 * 8, "seconds": seconds, "threads": torch.get_num_threads()}


def calibration(cfg: ModelConfig, seq: int, attention_seqs: tuple[int, ...], dtype: torch.dtype,
                device: torch.device, sizes: dict) -> dict:  # fmt: skip
    """Every measurement above (``sizes``: ``hbm_bytes``, ``host_bytes``, ``adamw_params``, ``reps``)."""
    reps = sizes["reps"]
    out = {"matmul": measure_matmul(cfg, seq, dtype, device, reps)}
    release_memory(device)
    out["attention"] = []
    for s in attention_seqs:
        out["attention"].append(measure_attention(s, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, dtype, device, reps))
        release_memory(device)
    out["hbm"] = measure_hbm(sizes["hbm_bytes"], device, reps)
    if device.type == "cuda":
        out["host_link"] = measure_host_link(sizes["host_bytes"], device, reps)
    release_memory(device)
    out["cpu_adamw"] = measure_cpu_adamw(sizes["adamw_params"], reps)
    return out
