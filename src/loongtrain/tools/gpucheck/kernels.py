"""The GPU check's kernel part: every installed block-attention backend against float64.

A :class:`KernelCase` is one call the ring makes: causal square blocks, non-causal
blocks with more keys than queries, and ``band`` blocks of a sliding window (the kernel
gets ``causal=False`` and an additive mask, as ``attention/blocks.py`` calls it), each
with as many key/value heads as query heads (MHA) or fewer (GQA). The backend's ``out``,
``lse``, ``dq``, ``dk`` and ``dv`` are compared with float64 attention written out with
einsum and softmax; for non-causal unmasked blocks the lse convention is also checked
through the merge: two key halves merged with :func:`merge_into` must give the whole
call's output and lse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongtrain.attention.backends import (
    CpuFlashBackend,
    CudaSdpaBackend,
    CudnnBackend,
    Fa2Backend,
    FlashAttnBackend,
    kernel_unavailable,
    load_flash_attn,
)
from loongtrain.attention.backends.base import BlockBackend
from loongtrain.attention.backends.cudnn import cudnn_takes
from loongtrain.attention.blocks import call_band
from loongtrain.attention.kernels import band_inputs
from loongtrain.attention.mask_plan import BAND, Call
from loongtrain.attention.merge import merge_into
from loongtrain.tools.harness import make_inputs

Tensor = torch.Tensor

# Norm-relative error bounds against float64 (those of the distributed attention tests).
# CUDA fp32 runs the memory-efficient kernel, which may use TF32 tensor cores: a looser
# bound, an assumption until a GPU run measures it.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 4e-3}
CUDA_FP32_TOLERANCE = 2e-3
# Largest |lse - lse_float64| in nats: the scores are accumulated in fp32 for every dtype.
LSE_TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-3, "float16": 1e-3}
CUDA_FP32_LSE_TOLERANCE = 1e-3


def tolerance(device_type: str, dtype: str) -> tuple[float, float]:
    """``(norm-relative bound for out/dq/dk/dv, absolute bound for lse)`` of ``dtype`` on a device type."""
    if device_type == "cuda" and dtype == "float32":
        return CUDA_FP32_TOLERANCE, CUDA_FP32_LSE_TOLERANCE
    return TOLERANCE[dtype], LSE_TOLERANCE[dtype]


@dataclass(frozen=True)
class KernelCase:
    """One block call: ``batch`` x ``seq`` queries of ``heads`` heads against ``kv_heads`` heads."""

    dtype: str
    causal: bool
    kv_heads: int
    masked: bool
    batch: int
    seq: int
    heads: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, int]:
        """``(query rows, key rows)``: a causal square, 1.5x keys when not causal, and for a
        band the last ``seq/2`` positions of ``seq`` keys."""
        if self.masked:
            return self.seq // 2, self.seq
        return (self.seq, self.seq) if self.causal else (self.seq, self.seq + self.seq // 2)

    @property
    def sliding_window(self) -> int:
        return self.seq // 3

    def band_call(self) -> Call:
        """The ``band`` call: query positions ``[sk - sq, sk)`` against key positions ``[0, sk)``."""
        sq, sk = self.shape
        return Call(0, sq, 0, sk, BAND, q_start=sk - sq, k_start=0)

    def keep(self, device: torch.device) -> Tensor:
        """[Sq, Sk] bool: which keys each query sees (written out from positions)."""
        sq, sk = self.shape
        if self.masked:
            return visibility(sq, sk, self.causal, self.sliding_window, q_start=sk - sq, device=device)
        return visibility(sq, sk, self.causal, device=device)

    @property
    def checks_merge(self) -> bool:
        return not self.causal and not self.masked

    def label(self) -> str:
        attn = "MHA" if self.kv_heads == self.heads else "GQA"
        kind = ("causal" if self.causal else "full") + (" band" if self.masked else "")
        return f"{self.dtype} {kind} {attn} H{self.heads}/G{self.kv_heads}"


def kernel_grid(
    dtypes: tuple[str, ...], batch: int, seq: int, heads: int, kv_heads: tuple[int, ...], head_dim: int
) -> list[KernelCase]:
    """Every (dtype, causal, key/value heads, mask) combination."""
    return [
        KernelCase(dtype, causal, kv, masked, batch, seq, heads, head_dim)
        for dtype in dtypes
        for causal in (True, False)
        for kv in kv_heads
        for masked in (False, True)
    ]


#: The CUDA backends the check runs, in order (``loongtrain.attention.backends``).
CUDA_BACKENDS = ("sdpa", "flash", "cudnn", "flash-attn")


def installed_backends(device: torch.device) -> tuple[list[tuple[str, BlockBackend]], list[tuple[str, str]]]:
    """``(backends to check, [(backend, why it is not checked)])`` on ``device``'s type."""
    if device.type == "cpu":
        return [("cpu", CpuFlashBackend())], []
    if device.type != "cuda":
        raise ValueError(f"the GPU check runs on cpu or cuda, not {device.type!r}")
    made = {"sdpa": CudaSdpaBackend, "flash": Fa2Backend, "cudnn": CudnnBackend}
    backends, missing = [], []
    for name in CUDA_BACKENDS:
        why = kernel_unavailable(name, device)
        if why is not None:
            missing.append((name, why))
        elif name == "flash-attn":
            backends.append((name, FlashAttnBackend(load_flash_attn())))
        else:
            backends.append((name, made[name]()))
    return backends, missing


def kernel_name(backend: str, case: KernelCase) -> str:
    """The kernel ``backend`` runs for ``case`` (the selection rules of ``attention/backends``)."""
    half = case.dtype in ("bfloat16", "float16")
    if backend == "sdpa" or not half:
        return "flash" if half and not case.masked else "efficient"
    if backend == "flash":
        return "fa2 window" if case.masked else "fa2"
    if backend == "cudnn":
        return "cudnn" if not case.masked and cudnn_takes(getattr(torch, case.dtype), case.head_dim) else "fa2 window"
    if backend == "flash-attn":
        if not case.masked:
            return "flash_attn"
        sq, sk = case.shape
        band = call_band(case.band_call(), case.causal, case.sliding_window)
        return "flash_attn window" if band.flash_window(sq, sk) is not None else "sdpa-efficient fallback"
    return "flash"


def case_inputs(case: KernelCase, device: torch.device, seed: int = 0) -> tuple[Tensor, ...]:
    """q, k, v, dout of ``case`` drawn on ``device``."""
    sq, sk = case.shape
    dtype = getattr(torch, case.dtype)
    return make_inputs(case.batch, sq, case.heads, case.kv_heads, case.head_dim, dtype, seed, device, kv_seq=sk)


def run_case(backend: BlockBackend, case: KernelCase, inputs: tuple[Tensor, ...]) -> dict[str, Tensor]:
    """The backend's ``out``, ``lse``, ``dq``, ``dk``, ``dv`` for ``case`` (as the ring calls it), and
    for non-causal unmasked cases ``merge_out``/``merge_lse`` of two key halves merged in fp32."""
    q, k, v, dout = inputs
    scale = case.head_dim**-0.5
    band = call_band(case.band_call(), case.causal, case.sliding_window) if case.masked else None
    mask, window = band_inputs(backend, band, q.shape[1], k.shape[1], q.dtype, q.device)
    causal = case.causal and not case.masked
    out, lse = backend.forward(q, k, v, causal, scale, mask, window)
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, causal, scale, mask, window)
    got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    if case.checks_merge:
        half = k.shape[1] // 2
        out_a, lse_a = backend.forward(q, k[:, :half], v[:, :half], False, scale, None)
        out_b, lse_b = backend.forward(q, k[:, half:], v[:, half:], False, scale, None)
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        merged, merged_lse = out_a.to(acc_dtype), lse_a.to(acc_dtype)
        merge_into(merged, merged_lse, out_b, lse_b)
        got.update(merge_out=merged, merge_lse=merged_lse)
    return got


def visibility(
    sq: int,
    sk: int,
    causal: bool,
    sliding_window: int | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: list[int] | None = None,
    device: torch.device,
) -> Tensor:
    """[Sq, Sk] bool, written out from positions: query ``i`` (at position ``q_start + i``) sees
    key ``j`` if ``j <= i`` (``causal``), ``|i - j| < sliding_window`` and both lie in one document of
    ``cu_seqlens`` (boundaries of the key positions)."""
    i = q_start + torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        keep &= j <= i
    if sliding_window is not None:
        keep &= (i - j).abs() < sliding_window
    if cu_seqlens is not None:
        bounds = torch.tensor(cu_seqlens[1:-1], dtype=torch.long, device=device)
        keep &= torch.bucketize(i, bounds, right=True) == torch.bucketize(j, bounds, right=True)
    return keep


def float64_attention(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, keep: Tensor, scale: float) -> dict[str, Tensor]:
    """Float64 ``out``, ``lse`` [B, Sq, H] and gradients of attention where ``keep`` [Sq, Sk] is True."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk).mul(scale).masked_fill(~keep, float("-inf"))
    lse = scores.logsumexp(dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", (scores - lse.unsqueeze(-1)).exp(), vv)
    out.backward(dout.double())
    return {"out": out.detach(), "lse": lse.detach().transpose(1, 2), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def relative_error(got: Tensor, ref: Tensor) -> float:
    """``||got - ref|| / ||ref||`` in float64."""
    ref = ref.double()
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def check_case(backend_name: str, backend: BlockBackend, case: KernelCase, device: torch.device) -> dict:
    """One kernel row: errors of every output against float64, and whether they are within bounds."""
    inputs = case_inputs(case, device)
    got = run_case(backend, case, inputs)
    ref = float64_attention(*inputs, case.keep(device), case.head_dim**-0.5)
    errors = {name: relative_error(got[name], ref[name]) for name in ("out", "dq", "dk", "dv")}
    errors["lse"] = (got["lse"].double() - ref["lse"]).abs().max().item()
    if case.checks_merge:
        errors["merge_out"] = relative_error(got["merge_out"], ref["out"])
        errors["merge_lse"] = (got["merge_lse"].double() - ref["lse"]).abs().max().item()
    tol, lse_tol = tolerance(device.type, case.dtype)
    ok = all(err <= (lse_tol if name.endswith("lse") else tol) for name, err in errors.items())
    return {
        "backend": backend_name,
        "kernel": kernel_name(backend_name, case),
        "case": case.label(),
        "dtype": case.dtype,
        "shape": list(case.shape),
        "errors": errors,
        "tolerance": tol,
        "lse_tolerance": lse_tol,
        "ok": ok,
    }


@dataclass(frozen=True)
class DocumentsCase:
    """Packed documents ``cu`` of one ``seq``-token row in one variable-length call (causal, under a
    sliding ``window`` or none), ``heads`` query heads over ``kv_heads``."""

    dtype: str
    kv_heads: int
    window: int | None
    seq: int
    heads: int
    head_dim: int

    @property
    def cu(self) -> tuple[int, ...]:
        """Documents of 13%, 1 token, 27%, 38% and the rest of the row (ragged lengths)."""
        s = self.seq
        return (0, s * 13 // 100, s * 13 // 100 + 1, s * 40 // 100, s * 78 // 100, s)

    def label(self) -> str:
        attn = "MHA" if self.kv_heads == self.heads else "GQA"
        window = f" window {self.window}" if self.window else ""
        return f"{self.dtype} varlen {len(self.cu) - 1} documents causal{window} {attn} H{self.heads}/G{self.kv_heads}"


def documents_grid(dtypes: tuple[str, ...], seq: int, heads: int, kv_heads: tuple[int, ...], head_dim: int) -> list:
    """Every (half dtype, key/value heads, window) combination of the variable-length rows."""
    return [
        DocumentsCase(dtype, kv, window, seq, heads, head_dim)
        for dtype in dtypes
        if dtype in ("bfloat16", "float16")
        for kv in kv_heads
        for window in (None, seq // 3)
    ]


def check_documents_case(backend_name: str, backend: BlockBackend, case: DocumentsCase, device: torch.device) -> dict:
    """One variable-length row: the packed call's out, lse and gradients against float64 attention
    within each document (and the window)."""
    dtype = getattr(torch, case.dtype)
    q, k, v, dout = make_inputs(1, case.seq, case.heads, case.kv_heads, case.head_dim, dtype, 0, device)
    cu = torch.tensor(case.cu, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(case.cu, case.cu[1:]))
    causal, window = (False, (case.window - 1, 0)) if case.window else (True, None)
    scale = case.head_dim**-0.5
    args = (cu, cu, longest, longest, causal, scale, window)
    out, lse = backend.varlen.forward(q[0], k[0], v[0], *args)
    dq, dk, dv = backend.varlen.backward(dout[0], q[0], k[0], v[0], out, lse, *args)
    keep = visibility(case.seq, case.seq, True, case.window, cu_seqlens=list(case.cu), device=device)
    ref = float64_attention(q, k, v, dout, keep, scale)
    got = {"out": out[None], "dq": dq[None], "dk": dk[None], "dv": dv[None]}
    errors = {name: relative_error(got[name], ref[name]) for name in got}
    errors["lse"] = (lse.t()[None].double() - ref["lse"]).abs().max().item()
    tol, lse_tol = tolerance(device.type, case.dtype)
    ok = all(err <= (lse_tol if name == "lse" else tol) for name, err in errors.items())
    return {
        "backend": backend_name, "kernel": "varlen", "case": case.label(), "dtype": case.dtype,
        "documents": list(case.cu), "errors": errors, "tolerance": tol, "lse_tolerance": lse_tol, "ok": ok,
    }  # fmt: skip
