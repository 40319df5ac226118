"""A CPU stand-in for the CUDA backends' FlashAttention calls, so that everything around them
(the variable-length grouping, packing, merges and gradient scatter, bands as windows) runs and
is checked against float64 here. Each packed piece (and each windowed dense call) runs through
the CPU kernel with FlashAttention's masking written out as a mask: bottom-right aligned, query
``r`` of a piece of ``sq`` rows over ``sk`` keys sees key ``c`` where
``r + sk - sq - left <= c <= r + sk - sq + right`` (a negative size: unbounded) and, ``causal``,
``c <= r + sk - sq``. Its outputs have FlashAttention's shapes: packed ``[T, H, d]``, lse ``[H, T]``.
"""

from __future__ import annotations

import torch

from loongtrain.attention.backends.cpu import CpuFlashBackend


def flash_visible(sq: int, sk: int, causal: bool, window) -> torch.Tensor:
    """[sq, sk] bool: what a FlashAttention call sees (its bottom-right convention)."""
    r = torch.arange(sq)[:, None]
    c = torch.arange(sk)[None]
    shift = sk - sq
    keep = torch.ones(sq, sk, dtype=torch.bool)
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left >= 0:
        keep &= c >= r + shift - left
    if right >= 0:
        keep &= c <= r + shift + right
    return keep


def _as_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if not keep.any(dim=1).all():
        raise AssertionError("a FlashAttention call with a row that sees nothing (its lse would be +inf)")
    return torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf"))


class EmulatedVarlen:
    """The variable-length kernel pair, piece by piece on the CPU kernel."""

    def __init__(self) -> None:
        self.calls: list[int] = []  # pieces per forward call
        self._cpu = CpuFlashBackend()

    def _pieces(self, cu_q, cu_k):
        for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
            yield slice(a, b), slice(c, d)

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window):
        assert cu_q.dtype == cu_k.dtype == torch.int32 and q.dim() == 3
        assert max_q == int(cu_q.diff().max()) and max_k == int(cu_k.diff().max())
        out, lse = torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
        self.calls.append(len(cu_q) - 1)
        for rows, cols in self._pieces(cu_q, cu_k):
            sq, sk = rows.stop - rows.start, cols.stop - cols.start
            mask = _as_mask(flash_visible(sq, sk, causal, window), q.dtype)
            o, s = self._cpu.forward(q[None, rows], k[None, cols], v[None, cols], False, scale, mask)
            out[rows], lse[:, rows] = o[0], s[0].t()
        return out, lse

    def backward(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window):
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows, cols in self._pieces(cu_q, cu_k):
            sq, sk = rows.stop - rows.start, cols.stop - cols.start
            mask = _as_mask(flash_visible(sq, sk, causal, window), q.dtype)
            g = self._cpu.backward(dout[None, rows], q[None, rows], k[None, cols], v[None, cols], out[None, rows],
                                   lse[:, rows].t()[None], False, scale, mask)  # fmt: skip
            dq[rows] = g[0][0]
            dk[cols] += g[1][0]
            dv[cols] += g[2][0]
        return dq, dk, dv


class EmulatedFlashBackend(CpuFlashBackend):
    """A CPU backend with the CUDA flash backend's interface: bands as windows, a varlen form."""

    name = "emulated-flash"
    takes_window = True

    def __init__(self) -> None:
        self.varlen = EmulatedVarlen()
        self.dense_calls = 0

    def forward(self, q, k, v, causal, scale, mask=None, window=None):
        self.dense_calls += 1
        if window is not None:
            mask = _as_mask(flash_visible(q.shape[1], k.shape[1], causal, window), q.dtype)
            causal = False
        return super().forward(q, k, v, causal, scale, mask)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None, window=None):
        if window is not None:
            mask = _as_mask(flash_visible(q.shape[1], k.shape[1], causal, window), q.dtype)
            causal = False
        return super().backward(dout, q, k, v, out, lse, causal, scale, mask)


def use_emulated_flash(monkeypatch) -> EmulatedFlashBackend:
    """Make every block-attention call in this process run on an :class:`EmulatedFlashBackend`."""
    import loongtrain.attention.blocks as blocks
    import loongtrain.attention.kernels as kernels

    backend = EmulatedFlashBackend()
    monkeypatch.setattr(kernels, "backend_for", lambda device, dtype: backend)
    monkeypatch.setattr(blocks, "backend_for", lambda device, dtype: backend)
    return backend
