"""What the CUDA kernels are given, checked on the meta device and on a CPU stand-in (no GPU here).

- cuDNN builds a graph per new shape (260-400 ms each, forward and backward): over 20 packed
  batches at cp 8 (32K tokens, lognormal documents) and over 64 decoded tokens it receives a small
  set of shapes that does not grow with the batches or the tokens; the calls routed away give the
  same results (float64 reference, CPU stand-in).
- The variable-length offsets and indices reach the device in at most two copies that do not
  block the host (pinned where there is an accelerator, never without one).
- The SDPA flash backward gets the philox seed/offset its forward returned; a one-block shard's
  output is the kernel's own tensor (no float32 round trip).
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cuda_rules import CudaArgumentRules
from loongtrain.attention.backends import CpuFlashBackend, CudaSdpaBackend, CudnnBackend
from loongtrain.attention.blocks import OutputAccumulator, forward_work
from loongtrain.attention.layout import sequence_layout
from loongtrain.attention.mask_plan import CAUSAL, Call, MaskPlan
from loongtrain.attention.replay import RingReplay
from loongtrain.attention.sharding import sequence_sharding
from loongtrain.parallel import ParallelConfig
from loongtrain.tools.bench.documents import document_lengths
from replay_check import check_masked_replay
from varlen_emulation import EmulatedFlashBackend

pytestmark = pytest.mark.unit
CUDNN_OPS = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward")


def _arg(args, kwargs, index: int, name: str, default=False):
    """An op's argument by position or name (a trailing default is left out of the call)."""
    return args[index] if len(args) > index else kwargs.get(name, default)


class _Shapes(TorchDispatchMode):
    """Records the (q, k, causal) shapes of every cuDNN call, and every host-to-device copy."""

    def __init__(self) -> None:
        super().__init__()
        self.cudnn: list[tuple] = []
        self.copies: list[dict] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == CUDNN_OPS[0]:
            self.cudnn.append(("fwd", tuple(args[0].shape), tuple(args[1].shape), _arg(args, kwargs, 6, "is_causal")))
        elif name == CUDNN_OPS[1]:
            self.cudnn.append(("bwd", tuple(args[1].shape), tuple(args[2].shape), _arg(args, kwargs, 14, "is_causal")))
        elif name == "_to_copy" and args[0].device.type == "cpu" and kwargs.get("device") is not None:
            self.copies.append({"non_blocking": kwargs.get("non_blocking", False), "numel": args[0].numel()})
        return func(*args, **kwargs)


def _use(monkeypatch, backend) -> None:
    import loongtrain.attention.blocks as blocks
    import loongtrain.attention.kernels as kernels

    monkeypatch.setattr(kernels, "backend_for", lambda device, dtype: backend)
    monkeypatch.setattr(blocks, "backend_for", lambda device, dtype: backend)


def test_cudnn_gets_the_same_few_shapes_over_20_packed_batches_at_cp_8(monkeypatch):
    """32K tokens of lognormal documents (median 2K) over cp 8 (4K tokens a rank), forward and
    backward of the double ring per batch: cuDNN receives the block's standard shapes only, the
    same few whatever the number of batches (before: every lone document piece was a new shape)."""
    _use(monkeypatch, CudnnBackend())
    seq, cp = 32768, 8
    seen_after: list[int] = []
    shapes: set = set()
    for batch in range(20):
        cu = document_lengths("lognormal", seq, 2048, seed=batch)
        plan = sequence_layout(seq, ParallelConfig(cp=cp), cu).mask_plan(True, None)
        replay = RingReplay(cp, 2, True, plan)
        q = torch.empty(1, seq // cp, 4, 64, device="meta", dtype=torch.bfloat16)
        kv = torch.empty(2, 1, seq // cp, 2, 64, device="meta", dtype=torch.bfloat16)
        with CudaArgumentRules(), _Shapes() as record:
            outs, lses = replay.forward([q] * cp, [kv] * cp, 0.125)
            replay.backward(outs, [q] * cp, [kv] * cp, outs, lses, 0.125)
        shapes |= set(record.cudnn)
        seen_after.append(len(shapes))
    rows = seq // cp
    standard = {(rows, rows), (rows, rows // 2), (rows // 2, rows)}
    assert {(q[2], k[2]) for _, q, k, _ in shapes} <= standard, shapes  # [B, H, S, d]
    # forward and backward of each standard shape, the diagonal causal and the halves not: at most 6
    # whatever the number of batches (before: 9-16 new shapes per batch)
    assert all((q[2] == k[2]) == causal for _, q, k, causal in shapes), shapes
    assert max(seen_after) <= 2 * len(standard), seen_after


def test_cudnn_gets_no_shape_of_a_decoded_token(monkeypatch):
    """64 tokens decoded for 2 prompts (query length 1, keys growing): none reaches cuDNN (PyTorch's
    dispatcher refuses it a one-row query, and each key length would be a new graph)."""
    from loongtrain.generate.cache import DecodeStep, LayerCache, context_positions, prompt_entries

    _use(monkeypatch, CudnnBackend())
    lengths, heads, kv_heads, d = (40, 24), 8, 2, 64
    cu = [0, lengths[0], sum(lengths)]
    layout = sequence_layout(cu[-1], None, cu)
    cache = LayerCache(None)
    kv = torch.empty(2, cu[-1], kv_heads, d, device="meta", dtype=torch.bfloat16)
    cache.fill(kv, prompt_entries(context_positions(layout, 0), cu, 2), lengths, appends=64)
    with CudaArgumentRules() as rules, _Shapes() as record:
        for t in range(64):
            step = DecodeStep(positions=(lengths[0] + t, lengths[1] + t), owners=(0, 0))
            q = torch.empty(2, heads, d, device="meta", dtype=torch.bfloat16)
            out, lse = cache.attend(q, torch.empty(2, 2, kv_heads, d, device="meta", dtype=torch.bfloat16), step, 0)
            assert out.shape == (2, heads, d) and lse.shape == (2, heads)
    assert record.cudnn == []
    assert rules.calls.count("_flash_attention_forward") == 128


class _EmulatedCudnn(CpuFlashBackend):
    """cuDNN's routing on the CPU kernel: dense calls it is given are recorded; ``other_shapes`` is
    the FlashAttention stand-in (bands as windows, a variable-length form)."""

    name = "emulated-cudnn"
    takes_window = True

    def __init__(self) -> None:
        self.other_shapes = EmulatedFlashBackend()
        self.varlen = self.other_shapes.varlen
        self.shapes: list[tuple[int, int]] = []

    def forward(self, q, k, v, causal, scale, mask=None, window=None):
        if window is not None:
            return self.other_shapes.forward(q, k, v, causal, scale, mask, window)
        self.shapes.append((q.shape[1], k.shape[1]))
        return super().forward(q, k, v, causal, scale, mask)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None, window=None):
        if window is not None:
            return self.other_shapes.backward(dout, q, k, v, out, lse, causal, scale, mask, window)
        return super().backward(dout, q, k, v, out, lse, causal, scale, mask)


@pytest.mark.parametrize("seed", range(6))
def test_calls_routed_away_from_cudnn_give_the_float64_result(monkeypatch, seed):
    """Packed documents on a ring (cp 1-4, windows or not): calls of the block's standard shapes on
    the cuDNN stand-in, every other one on the FlashAttention stand-in; forward and backward
    against float64, both routes taken over the seeds."""
    backend = _EmulatedCudnn()
    _use(monkeypatch, backend)
    rng = random.Random(seed)
    cp = rng.choice([1, 2, 4])
    seq = 2 * cp * rng.choice([8, 12])
    cuts = sorted(rng.sample(range(1, seq), rng.randint(1, 4)))
    cu = (0, *cuts, seq) if seed % 3 else (0, seq)
    sliding = rng.choice([None, 5])
    plan = MaskPlan(sequence_sharding(seq, 1, cp, cu, "zigzag"), cu, True, sliding, 0)
    check_masked_replay(plan, 1, batch=1, seed=seed)
    rows = seq // cp
    assert set(backend.shapes) <= {(rows, rows), (rows, rows // 2), (rows // 2, rows)}
    routed_away = backend.other_shapes.dense_calls + len(backend.varlen.calls)
    if seed % 3 == 0 and sliding is None:  # one document: the plain zigzag ring, all on cuDNN
        assert backend.shapes and routed_away == 0
    elif seed % 3:  # documents: their pieces go to FlashAttention
        assert routed_away > 0


def test_varlen_offsets_and_indices_reach_the_device_without_blocking(monkeypatch):
    """A call whose pieces are gathered on both sides: its offsets and indices go in two copies,
    each non-blocking from pinned memory where the device is the accelerator (faked here: no GPU);
    on the CPU nothing is pinned or copied."""
    import loongtrain.attention.kernels as kernels
    from loongtrain.attention.backends import Piece, VarlenCall

    assert not kernels.pins_for(torch.device("cpu")) and not kernels.pins_for(torch.device("meta"))
    call = VarlenCall((Piece(0, 3, 5, 8), Piece(6, 9, 0, 3)), False, None)
    pinned: list[int] = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self.numel()) or self)
    cpu = kernels.Packed(call, torch.device("cpu"))
    assert pinned == [] and cpu.cu_q.tolist() == [0, 3, 6] and cpu.cu_k.tolist() == [0, 3, 6]
    assert cpu.row_index.tolist() == [0, 1, 2, 6, 7, 8] and cpu.col_index.tolist() == [5, 6, 7, 0, 1, 2]
    monkeypatch.setattr(kernels, "pins_for", lambda device: device.type == "meta")  # meta as the accelerator
    with _Shapes() as record:
        p = kernels.Packed(call, torch.device("meta"))
    assert p.cu_q.dtype == p.cu_k.dtype == torch.int32 and p.cu_q.shape == p.cu_k.shape == (3,)
    assert p.row_index.shape == p.col_index.shape == (6,) and p.row_index.dtype == torch.int64
    assert len(record.copies) == 2 and all(c["non_blocking"] for c in record.copies), record.copies
    assert sorted(pinned) == sorted(c["numel"] for c in record.copies) == [6, 12]


@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_backward_gets_the_philox_tensors_its_forward_returned(masked):
    """As autograd and PyTorch's context parallelism do: the flash (bf16) and memory-efficient
    (a mask) backward get the very seed/offset tensors their forward returned (meta device)."""

    class Philox(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.returned, self.given = [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name == "_scaled_dot_product_flash_attention":
                self.returned.append((out[6], out[7]))
            elif name == "_scaled_dot_product_efficient_attention":
                self.returned.append((out[2], out[3]))
            elif name == "_scaled_dot_product_flash_attention_backward":
                self.given.append((args[12], args[13]))
            elif name == "_scaled_dot_product_efficient_attention_backward":
                self.given.append((args[7], args[8]))
            return out

    backend = CudaSdpaBackend()
    q = torch.empty(1, 64, 4, 32, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(1, 64, 2, 32, device="meta", dtype=torch.bfloat16)
    mask = torch.zeros(64, 64, device="meta", dtype=torch.bfloat16) if masked else None
    with CudaArgumentRules(), Philox() as seen:
        out, lse = backend.forward(q, kv, kv, True, 0.1, mask)
        backend.backward(out, q, kv, kv, out, lse, True, 0.1, mask)
    (returned,), (given,) = seen.returned, seen.given
    assert given[0] is returned[0] and given[1] is returned[1]


def test_a_one_block_shard_keeps_the_kernels_output_without_a_float32_copy():
    """One causal call over the whole shard (cp 1, one document): the result is the kernel's bf16
    output itself, with no float32 copy of it; a second block then merges in float32 as before."""

    class Copies(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.to_float: list[tuple] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.overloadpacket.__name__ == "_to_copy" and kwargs.get("dtype") == torch.float32:
                self.to_float.append(tuple(args[0].shape))
            return func(*args, **kwargs)

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 32, 4, 16, generator=gen).bfloat16()
    kv = torch.randn(2, 1, 32, 2, 16, generator=gen).bfloat16()
    whole = (Call(0, 32, 0, 32, CAUSAL),)
    with Copies() as copies:
        acc = OutputAccumulator(q)
        forward_work(q, kv, whole, True, None, 0.25, acc)
        out, lse = acc.result(torch.bfloat16)
    assert copies.to_float == [] and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want, want_lse = CpuFlashBackend().forward(q, kv[0], kv[1], True, 0.25)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    acc.add(0, *CpuFlashBackend().forward(q, kv[0], kv[1], True, 0.25))  # the same block again: same softmax
    merged, merged_lse = acc.result(torch.bfloat16)
    assert acc.out.dtype == torch.float32 and torch.allclose(merged.float(), want.float(), atol=1e-2)
    assert torch.allclose(merged_lse, want_lse + torch.log(torch.tensor(2.0)), atol=1e-5)
