"""What every block-attention backend shares: the sliding-window band, the kernel-pair
interface, and the variable-length call of packed pieces.

Layout convention: ``q`` is ``[B, Sq, H, d]``, ``k``/``v`` are ``[B, Sk, G, d]`` with
``H % G == 0`` (query head ``h`` uses key/value head ``h // (H // G)``), ``out`` is
``[B, Sq, H, d]`` in the input dtype and ``lse`` is ``[B, Sq, H]`` in float32 (float64 for
float64 inputs), natural log, scale included. ``causal`` masks top-left aligned (query ``i``
sees keys ``j <= i``); the calls that get it are square.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

Tensor = torch.Tensor

Window = tuple[int, int]  # FlashAttention's (window_size_left, window_size_right)


class Band(NamedTuple):
    """A sliding-window band: row ``i`` of a call (query position ``offset + i`` relative to
    column 0's) sees column ``j`` where ``offset + i - j < window``, and ``j <= offset + i``
    (``causal``) or ``j - offset - i < window``."""

    offset: int  # query position of row 0 minus key position of column 0
    window: int
    causal: bool

    def visible(self, sq: int, sk: int, device: torch.device) -> Tensor:
        """[Sq, Sk] bool."""
        i = self.offset + torch.arange(sq, device=device).unsqueeze(1)
        j = torch.arange(sk, device=device).unsqueeze(0)
        return (i - j < self.window) & ((j <= i) if self.causal else (j - i < self.window))

    def mask(self, sq: int, sk: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The additive [Sq, Sk] mask: 0 visible, -inf hidden."""
        hidden = ~self.visible(sq, sk, device)
        return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))

    def flash_window(self, sq: int, sk: int) -> Window | None:
        """FlashAttention's ``(window_size_left, window_size_right)`` for this band, or None where
        it has none. Its convention (bottom-right aligned): query ``i`` sees keys
        ``[i + sk - sq - left, i + sk - sq + right]``; negative sizes mean unbounded."""
        shift = sk - sq
        left = shift - self.offset + self.window - 1
        right = self.offset - shift + (0 if self.causal else self.window - 1)
        return (left, right) if left >= 0 and right >= 0 else None


class Piece(NamedTuple):
    """One sequence of a variable-length call: local query rows ``[row0, row1)`` against local
    key/value rows ``[col0, col1)`` of one block."""

    row0: int
    row1: int
    col0: int
    col1: int


class VarlenCall(NamedTuple):
    """One variable-length kernel call over ``pieces`` (their query rows disjoint), each causal
    (square) or not, under one FlashAttention ``window`` (None: none) for all of them."""

    pieces: tuple[Piece, ...]
    causal: bool
    window: Window | None

    @property
    def rows(self) -> int:
        return sum(p.row1 - p.row0 for p in self.pieces)

    @property
    def cols(self) -> int:
        return sum(p.col1 - p.col0 for p in self.pieces)


class BlockBackend(Protocol):
    """A kernel pair for one device family. ``takes_window``: ``forward``/``backward`` take a
    ``window`` (a band as FlashAttention's window sizes) in place of its mask. ``varlen``: the
    variable-length kernel pair (packed pieces of one block in one call), or None.
    ``other_shapes``: for a kernel that builds a graph per new shape (cuDNN), the pair that runs
    the dense calls whose shapes do not repeat; None: this pair takes every shape."""

    name: str
    dtypes: tuple[torch.dtype, ...]
    takes_window: bool
    varlen: VarlenKernel | None
    other_shapes: BlockBackend | None

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool,
        scale: float,
        mask: Tensor | None = None,
        window: Window | None = None,
    ) -> tuple[Tensor, Tensor]: ...

    def backward(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        causal: bool,
        scale: float,
        mask: Tensor | None = None,
        window: Window | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]: ...


class VarlenKernel(Protocol):
    """Attention of packed sequences: ``q`` ``[Tq, H, d]``, ``k``/``v`` ``[Tk, G, d]``, sequence ``i``
    the rows ``cu_q[i]:cu_q[i+1]`` against ``cu_k[i]:cu_k[i+1]`` (int32 offsets on the device,
    ``max_q``/``max_k`` the longest); ``lse`` is ``[H, Tq]`` float32. ``causal`` is bottom-right
    aligned per sequence (the pieces that get it are square)."""

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
        causal: bool, scale: float, window: Window | None,
    ) -> tuple[Tensor, Tensor]: ...  # fmt: skip

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor, cu_k: Tensor,
        max_q: int, max_k: int, causal: bool, scale: float, window: Window | None,
    ) -> tuple[Tensor, Tensor, Tensor]: ...  # fmt: skip


def bhsd(x: Tensor) -> Tensor:
    """[B, S, H, d] -> [B, H, S, d] view (the SDPA kernels take this layout)."""
    return x.transpose(1, 2)
