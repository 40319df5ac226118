"""Local block attention returning the log-sum-exp, and its backward.

Every distributed scheme is built from these two functions. Layout convention:
``q`` is ``[B, Sq, H, d]``, ``k``/``v`` are ``[B, Sk, G, d]`` with ``H % G == 0`` (query
head ``h`` uses key/value head ``h // (H // G)``), ``out`` is ``[B, Sq, H, d]`` in the
input dtype and ``lse`` is ``[B, Sq, H]`` in float32 (float64 for float64 inputs), natural
log, scale included.
``causal`` masks top-left aligned (query ``i`` sees keys ``j <= i``). ``band`` (optional, the
sliding-window edges of document / window masks) is a :class:`Band`: a kernel that takes a
window (``flash_attn``'s ``window_size``) runs it as one, the others with the band's additive
float ``[Sq, Sk]`` mask (0 visible, -inf hidden); every row must see at least one key.

This module is the only place that picks a kernel by device; the rest of the code calls
:func:`block_forward` / :func:`block_backward`. Kernels used:

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``); GQA native.
- CUDA, fp16/bf16: the ``flash_attn`` package (>= 2.7) when installed (a band as its
  ``window_size``), else ``aten._scaled_dot_product_flash_attention``; GQA native.
- CUDA, fp32, and a band no window expresses (or without ``flash_attn``):
  ``aten._scaled_dot_product_efficient_attention`` with key/value heads expanded to the
  query heads (that kernel has no GQA), gradients summed back; the band's mask goes in as
  its additive bias.

The aten ``_scaled_dot_product_*`` ops are private PyTorch API, and so are ``flash_attn``'s
``_flash_attn_forward`` / ``_backward``: they are the only kernels that return the
log-sum-exp needed to merge partial results (``flash_attn``'s public functions run their own
backward, from their own output), so they are wrapped here and nowhere else, and
``flash_attn``'s are called by keyword, checked against the installed version's signature.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import NamedTuple, Protocol

import torch

from loongtrain.attention.workspace import backward_heads_per_call

Tensor = torch.Tensor


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

    def flash_window(self, sq: int, sk: int) -> tuple[int, int] | None:
        """``flash_attn``'s ``(window_size_left, window_size_right)`` for this band, or None where
        it has none. Its convention (bottom-right aligned): query ``i`` sees keys
        ``[i + sk - sq - left, i + sk - sq + right]``; negative sizes mean unbounded."""
        shift = sk - sq
        left = shift - self.offset + self.window - 1
        right = self.offset - shift + (0 if self.causal else self.window - 1)
        return (left, right) if left >= 0 and right >= 0 else None


Window = tuple[int, int]  # flash_attn's (window_size_left, window_size_right)


class BlockBackend(Protocol):
    """A kernel pair for one device family. ``takes_window``: ``forward``/``backward`` take a
    ``window`` (a band as ``flash_attn``'s window sizes) in place of its mask."""

    name: str
    dtypes: tuple[torch.dtype, ...]
    takes_window: bool

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


def _bhsd(x: Tensor) -> Tensor:
    """[B, S, H, d] -> [B, H, S, d] view (kernels take this layout)."""
    return x.transpose(1, 2)


class CpuFlashBackend:
    """``aten._scaled_dot_product_flash_attention_for_cpu``: fp32 lse for every dtype."""

    name = "cpu-flash"
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    takes_window = False

    def forward(self, q, k, v, causal, scale, mask=None, window=None):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, attn_mask=mask, scale=scale
        )
        return out.transpose(1, 2), lse.transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None, window=None):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout),
            _bhsd(q),
            _bhsd(k),
            _bhsd(v),
            _bhsd(out),
            lse.transpose(1, 2),
            0.0,
            causal,
            attn_mask=mask,
            scale=scale,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _expand_kv(x: Tensor, heads: int) -> Tensor:
    """[B, S, G, d] -> [B, S, heads, d], each key/value head repeated heads // G times."""
    groups = x.shape[2]
    if groups == heads:
        return x
    return x.repeat_interleave(heads // groups, dim=2)


def _sum_kv_grad(dx: Tensor, groups: int) -> Tensor:
    """Inverse of :func:`_expand_kv` for gradients: sum the replicas of each head."""
    b, s, heads, d = dx.shape
    if heads == groups:
        return dx
    return (
        dx.view(b, s, groups, heads // groups, d)
        .sum(dim=3, dtype=torch.promote_types(dx.dtype, torch.float32))
        .to(dx.dtype)
    )


def _aligned_bias(mask: Tensor, batch: int, heads: int, dtype: torch.dtype) -> Tensor:
    """[Sq, Sk] additive mask -> a [B, H, Sq, Sk] view whose rows start 16-element aligned
    (what the memory-efficient kernel needs for its bias)."""
    sq, sk = mask.shape
    padded = mask.new_zeros((sq, -(-sk // 16) * 16), dtype=dtype)
    padded[:, :sk] = mask
    return padded[:, :sk].expand(batch, heads, sq, sk)


class CudaSdpaBackend:
    """PyTorch's CUDA SDPA aten kernels: flash for fp16/bf16, efficient for fp32 and masks."""

    name = "cuda-sdpa"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    takes_window = False

    @staticmethod
    def _use_flash(q: Tensor, mask: Tensor | None) -> bool:
        return mask is None and q.dtype in (torch.float16, torch.bfloat16)

    def forward(self, q, k, v, causal, scale, mask=None, window=None):
        sq = q.shape[1]
        if self._use_flash(q, mask):
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, False, scale=scale
            )
            out, lse = res[0], res[1]
        else:
            b, _, heads, _ = q.shape
            bias = None if mask is None else _aligned_bias(mask, b, heads, q.dtype)
            out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
                _bhsd(q),
                _bhsd(_expand_kv(k, heads)),
                _bhsd(_expand_kv(v, heads)),
                bias,
                True,
                0.0,
                causal,
                scale=scale,
            )
        return out.transpose(1, 2), lse[..., :sq].transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None, window=None):
        sq, sk = q.shape[1], k.shape[1]
        if self._use_flash(q, mask):
            # dense inputs: cum_seq_q/k None, as the forward returns them for dense inputs and as
            # PyTorch's own context parallelism hands them back (a defined tensor there selects the
            # variable-length kernel, which wants int32 offsets)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.transpose(1, 2).contiguous(),
                None, None, sq, sk, 0.0, causal, _unused_rng(q.device), _unused_rng(q.device), scale=scale,
            )  # fmt: skip
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        b, _, heads, _ = q.shape
        groups = k.shape[2]
        bias = None if mask is None else _aligned_bias(mask, b, heads, q.dtype)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            _bhsd(dout.contiguous()),
            _bhsd(q),
            _bhsd(_expand_kv(k, heads)),
            _bhsd(_expand_kv(v, heads)),
            bias,
            _bhsd(out.contiguous()),  # the kernel reads out with a fixed row stride (heads x head dim)
            efficient_lse(lse),
            seed,
            seed,
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return (
            dq.transpose(1, 2),
            _sum_kv_grad(dk.transpose(1, 2), groups),
            _sum_kv_grad(dv.transpose(1, 2), groups),
        )


#: Rows of the log-sum-exp the memory-efficient kernel's forward returns are padded to a multiple
#: of this (``kAlignLSE``); its backward checks that the lse's head and batch strides are aligned.
EFFICIENT_LSE_ALIGN = 32


def efficient_lse(lse: Tensor) -> Tensor:
    """``lse`` [B, Sq, H] as the memory-efficient backward takes it: ``[B, H, Sq']`` with ``Sq'`` the
    next multiple of :data:`EFFICIENT_LSE_ALIGN` (the padding is never read), as its forward
    returns it."""
    b, sq, heads = lse.shape
    padded = lse.new_zeros((b, heads, -(-sq // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN))
    padded[..., :sq] = lse.transpose(1, 2)
    return padded


def _unused_rng(device: torch.device) -> Tensor:
    """A philox seed / offset for the flash backward: read only with dropout, which is 0 here."""
    return torch.empty(0, dtype=torch.int64, device=device)


class FlashAttnBackend:
    """The ``flash_attn`` package (2.7 or newer): fp16/bf16 on CUDA, head dim % 8 == 0; a band
    as its window, an arbitrary mask on PyTorch's SDPA."""

    name = "flash-attn"
    dtypes = (torch.float16, torch.bfloat16)
    takes_window = True

    def __init__(self, module) -> None:
        self._fa = module
        self._masked = CudaSdpaBackend()  # flash_attn takes no arbitrary mask

    def forward(self, q, k, v, causal, scale, mask=None, window=None):
        if mask is not None:
            return self._masked.forward(q, k, v, causal, scale, mask)
        left, right = window if window is not None else (-1, -1)
        res = self._fa._flash_attn_forward(
            q.contiguous(), k.contiguous(), v.contiguous(), dropout_p=0.0, softmax_scale=scale, causal=causal,
            window_size_left=left, window_size_right=right, softcap=0.0, alibi_slopes=None, return_softmax=False,
        )  # fmt: skip
        return res[0], res[1].transpose(1, 2)

    def backward(self, dout, q, k, v, out, lse, causal, scale, mask=None, window=None):
        if mask is not None:
            return self._masked.backward(dout, q, k, v, out, lse, causal, scale, mask)
        left, right = window if window is not None else (-1, -1)
        q, k, v, out, dout = (x.contiguous() for x in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        self._fa._flash_attn_backward(
            dout, q, k, v, out, lse.transpose(1, 2).contiguous(), dq, dk, dv, dropout_p=0.0, softmax_scale=scale,
            causal=causal, window_size_left=left, window_size_right=right, softcap=0.0, alibi_slopes=None,
            deterministic=False, rng_state=None,
        )  # fmt: skip
        return dq, dk, dv


#: The keyword arguments the calls above pass (flash_attn 2.7 and 2.8 take these names).
FLASH_FORWARD_ARGS = frozenset({"dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right",
                                "softcap", "alibi_slopes", "return_softmax"})  # fmt: skip
FLASH_BACKWARD_ARGS = frozenset({"dropout_p", "softmax_scale", "causal", "window_size_left", "window_size_right",
                                 "softcap", "alibi_slopes", "deterministic", "rng_state"})  # fmt: skip


def parameter_names(fn) -> frozenset[str]:
    """Parameter names of ``fn``; of the Python function a ``torch.library.custom_op`` wraps
    (flash_attn 2.7+ registers its kernels as custom ops, whose own ``__call__`` takes
    ``*args, **kwargs``)."""
    fn = getattr(fn, "_init_fn", fn)
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


def flash_attn_incompatibility(module) -> str | None:
    """Why the ``flash_attn`` interface ``module`` cannot be called as above, or None."""
    for fn_name, needed in (("_flash_attn_forward", FLASH_FORWARD_ARGS), ("_flash_attn_backward", FLASH_BACKWARD_ARGS)):
        fn = getattr(module, fn_name, None)
        if fn is None:
            return f"flash_attn has no {fn_name}"
        missing = needed - parameter_names(fn)
        if missing:
            return f"flash_attn's {fn_name} takes no {', '.join(sorted(missing))} (2.7 or newer needed)"
    return None


def flash_attn_unavailable() -> str | None:
    """Why ``flash_attn`` is not used (not importable, or a version these calls do not fit), or None."""
    try:
        from flash_attn import flash_attn_interface as fa
    except ModuleNotFoundError:
        return "flash_attn>=2.7 is not installed (pip install flash-attn to use it)"
    except Exception as e:  # installed but broken (e.g. built for another torch)
        return f"flash_attn does not import ({type(e).__name__}: {e})"
    return flash_attn_incompatibility(fa)


def _load_flash_attn():
    """Return the flash_attn interface module if a compatible version is installed."""
    if flash_attn_unavailable() is not None:
        return None
    from flash_attn import flash_attn_interface as fa

    return fa


@functools.cache
def _backend_for(device_type: str, dtype: torch.dtype) -> BlockBackend:
    choice = os.environ.get("LOONGTRAIN_ATTENTION_BACKEND", "auto")
    if device_type == "cpu":
        return CpuFlashBackend()
    if device_type == "cuda":
        if choice in ("auto", "flash-attn") and dtype in FlashAttnBackend.dtypes:
            fa = _load_flash_attn()
            if fa is not None:
                return FlashAttnBackend(fa)
            if choice == "flash-attn":
                raise RuntimeError(
                    f"LOONGTRAIN_ATTENTION_BACKEND=flash-attn, but {flash_attn_unavailable()}; "
                    "unset the variable to use PyTorch's SDPA kernels"
                )
        return CudaSdpaBackend()
    raise NotImplementedError(
        f"loongtrain: no block-attention kernel for device type {device_type!r}; supported: cpu, cuda"
    )


def backend_for(device: torch.device, dtype: torch.dtype) -> BlockBackend:
    """The kernel pair used for tensors of ``dtype`` on ``device``."""
    return _backend_for(device.type, dtype)


def check_supported(device: torch.device, dtype: torch.dtype) -> None:
    """Raise a clear error if no kernel handles ``dtype`` on ``device``."""
    backend = backend_for(device, dtype)
    if dtype not in backend.dtypes:
        raise TypeError(
            f"loongtrain: dtype {dtype} is not supported by the {backend.name} attention kernel "
            f"on {device.type}; use one of {[str(d) for d in backend.dtypes]}"
        )


def band_inputs(
    backend: BlockBackend,
    band: Band | None,
    sq: int,
    sk: int,
    dtype: torch.dtype,
    device: torch.device,
    mask: Tensor | None = None,
) -> tuple[Tensor | None, Window | None]:
    """``(mask, window)`` that ``backend`` takes for ``band``: its window where the backend
    takes one and the band has one, else its mask; with no band, ``mask`` as it is."""
    if band is None:
        return mask, None
    if mask is not None:
        raise ValueError("block attention takes a band or a mask, not both")
    if backend.takes_window:
        window = band.flash_window(sq, sk)
        if window is not None:
            return None, window
    return band.mask(sq, sk, dtype, device), None


def block_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    scale: float,
    band: Band | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of a query block against a key/value block: ``(out, lse)``; under a sliding-
    window ``band`` or an arbitrary additive ``mask`` [Sq, Sk] (one of them)."""
    backend = backend_for(q.device, q.dtype)
    mask, window = band_inputs(backend, band, q.shape[1], k.shape[1], q.dtype, q.device, mask)
    return backend.forward(q, k, v, causal, scale, mask, window)


def block_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool,
    scale: float,
    band: Band | None = None,
    mask: Tensor | None = None,
    stacked: bool = False,
) -> tuple[Tensor, ...]:
    """Gradients ``(dq, dk, dv)`` of one block given the *final* ``out`` and ``lse`` rows;
    with ``stacked``, ``(dq, dkv)``: dk and dv as one ``[2, *k.shape]`` tensor.

    With ``out``/``lse`` of the full (merged) attention, the block's probabilities are
    the global ones, so summing the returned gradients over blocks gives the exact
    gradient of the whole attention. A block of many rows runs over groups of heads
    (:func:`~loongtrain.attention.workspace.backward_heads_per_call`), which bounds the
    kernel's own workspace; heads are independent, so the gradients are the same. Over head
    groups each call's dk/dv go straight into their place in the stacked tensor (one call
    returns them apart, and stacking copies them).
    """
    backend = backend_for(q.device, q.dtype)
    b, rows, heads, _ = q.shape
    groups = k.shape[2]
    mask, window = band_inputs(backend, band, rows, k.shape[1], q.dtype, q.device, mask)
    per_call = backward_heads_per_call(b * rows, heads, groups)
    if per_call == heads:
        dq, dk, dv = backend.backward(dout, q, k, v, out, lse, causal, scale, mask, window)
        return (dq, torch.stack((dk, dv))) if stacked else (dq, dk, dv)

    def call(qh: slice, kh: slice) -> tuple[Tensor, Tensor, Tensor]:
        return backend.backward(dout[:, :, qh], q[:, :, qh], k[:, :, kh], v[:, :, kh], out[:, :, qh], lse[:, :, qh],
                                causal, scale, mask, window)  # fmt: skip

    dq, dkv = torch.empty_like(q), k.new_empty((2, *k.shape))
    dk, dv = dkv[0], dkv[1]
    ratio = heads // groups
    if per_call >= ratio:  # whole key/value groups a call
        kv_per_call = per_call // ratio
        for g in range(0, groups, kv_per_call):
            qh, kh = slice(g * ratio, (g + kv_per_call) * ratio), slice(g, g + kv_per_call)
            dq[:, :, qh], dk[:, :, kh], dv[:, :, kh] = call(qh, kh)
    else:
        for g in range(groups):  # part of one group a call: its dk/dv summed in fp32, as the kernel's GQA sum does
            kh = slice(g, g + 1)
            sums = torch.zeros((2, *dk[:, :, kh].shape), dtype=torch.promote_types(k.dtype, torch.float32),
                               device=k.device)  # fmt: skip
            for h in range(g * ratio, (g + 1) * ratio, per_call):
                qh = slice(h, h + per_call)
                dq[:, :, qh], dk_part, dv_part = call(qh, kh)
                sums[0] += dk_part
                sums[1] += dv_part
            dk[:, :, kh], dv[:, :, kh] = sums[0], sums[1]
    return (dq, dkv) if stacked else (dq, dk, dv)
