"""The GPU check's kernel speed part: loongtrain's chosen kernel against each of PyTorch's
``F.scaled_dot_product_attention`` backends on one dense causal sequence, and packed documents
(one variable-length call per block) against the same length as one sequence.

Each row times forward + backward of one call (median of ``reps`` after a warm-up; on CUDA each
timed run waits for the device), and reports the peak tensor memory of one call above its inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongtrain.attention.backends import backend_for, chosen_kernel
from loongtrain.attention.kernels import block_backward, block_forward
from loongtrain.attention.layout import sequence_layout
from loongtrain.attention.local import masked_attention
from loongtrain.attention.mask_plan import MAX_BAND_TILE, MaskPlan
from loongtrain.attention.sharding import sequence_sharding
from loongtrain.attention.varlen_plan import varlen_calls
from loongtrain.tools.bench.documents import document_lengths
from loongtrain.tools.harness import make_inputs, median_time, release_memory

Tensor = torch.Tensor


def _peak_above(fn, device: torch.device) -> float:
    """Peak tensor memory (bytes) of ``fn()`` above what was allocated before it (0 on CPU)."""
    if device.type != "cuda":
        fn()
        return 0.0
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return float(torch.cuda.max_memory_allocated(device) - base)


def sdpa_backends() -> dict[str, object]:
    """PyTorch's SDPA backends to time: name -> ``SDPBackend``."""
    from torch.nn.attention import SDPBackend

    return {
        "sdpa cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa flash": SDPBackend.FLASH_ATTENTION,
        "sdpa efficient": SDPBackend.EFFICIENT_ATTENTION,
    }


def dense_speed(seq: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                reps: int) -> dict:  # fmt: skip
    """Forward + backward seconds of one causal sequence: loongtrain's chosen kernel and each SDPA
    backend that runs here (``None`` for one that refuses)."""
    from torch.nn.attention import sdpa_kernel

    q, k, v, dout = make_inputs(1, seq, heads, kv_heads, head_dim, dtype, device=device)
    scale = head_dim**-0.5

    def ours() -> None:
        out, lse = block_forward(q, k, v, causal=True, scale=scale)
        block_backward(dout, q, k, v, out, lse, causal=True, scale=scale)

    times = {f"loongtrain {chosen_kernel(device)}": median_time(ours, reps, device)}
    memory = {f"loongtrain {chosen_kernel(device)}": _peak_above(ours, device)}
    qt, kt, vt, dt = (x.transpose(1, 2) for x in (q, k, v, dout))
    for name, backend in sdpa_backends().items():
        expand = name == "sdpa efficient"  # no GQA in that kernel
        kk = kt.repeat_interleave(heads // kv_heads, dim=1) if expand else kt
        vv = vt.repeat_interleave(heads // kv_heads, dim=1) if expand else vt
        leaves = [x.detach().requires_grad_() for x in (qt, kk, vv)]

        def call(leaves=leaves, backend=backend, expand=expand) -> None:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale, enable_gqa=not expand)
            out.backward(dt)

        try:
            times[name] = median_time(call, reps, device)
            memory[name] = _peak_above(call, device)
        except RuntimeError as exc:  # this backend does not run these inputs here
            times[name], memory[name] = None, str(exc).splitlines()[0][:120]
        release_memory(device)
    ran = {n: t for n, t in times.items() if t is not None and not n.startswith("loongtrain")}
    fastest = min(ran, key=ran.get) if ran else None
    mine = next(n for n in times if n.startswith("loongtrain"))
    return {"seq": seq, "times_s": times, "peak_bytes": memory, "fastest_sdpa": fastest,
            "ratio_to_fastest": times[mine] / ran[fastest] if fastest else None}  # fmt: skip


def documents_speed(seq: int, median: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                    device: torch.device, reps: int) -> dict:  # fmt: skip
    """Packed lognormal documents through loongtrain's one-device masked attention (the trainer's
    blocks: one variable-length call where the kernel has one) against the same length as one
    causal sequence on the chosen dense kernel: forward + backward seconds, peak memory, and the
    calls the block makes."""
    cu = tuple(document_lengths("lognormal", seq, median))
    layout = sequence_layout(seq, None, cu)
    q, k, v, dout = make_inputs(1, seq, heads, kv_heads, head_dim, dtype, device=device)
    scale = head_dim**-0.5
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]

    def packed() -> None:
        masked_attention(*leaves, layout=layout).backward(dout)

    def one_sequence() -> None:
        out, lse = block_forward(q, k, v, causal=True, scale=scale)
        block_backward(dout, q, k, v, out, lse, causal=True, scale=scale)

    t_docs, t_dense = median_time(packed, reps, device), median_time(one_sequence, reps, device)
    m_docs, m_dense = _peak_above(packed, device), _peak_above(one_sequence, device)
    plan = MaskPlan(sequence_sharding(seq, 1, 1, cu, "zigzag"), cu, True, None, MAX_BAND_TILE)
    calls = plan.calls(0, 0)
    launches = len(varlen_calls(calls, True, None)) if backend_for(device, dtype).varlen is not None else len(calls)
    keys = sum((b - a) * (b - a + 1) // 2 for a, b in zip(cu, cu[1:]))
    return {
        "seq": seq, "documents": len(cu) - 1, "median": median, "fewer_keys": seq * (seq + 1) / 2 / keys,
        "packed_s": t_docs, "one_sequence_s": t_dense, "speedup": t_dense / t_docs,
        "packed_peak_bytes": m_docs, "one_sequence_peak_bytes": m_dense,
        "plan_calls": len(calls), "kernel_calls": launches,
    }  # fmt: skip
