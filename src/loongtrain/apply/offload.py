"""Activation offload: what activation checkpointing keeps per layer goes to host memory
after the layer's forward and comes back just before its backward needs it.

What a checkpointed layer keeps between forward and backward is its input (saved by
``torch.utils.checkpoint`` through :func:`torch.autograd.graph.saved_tensors_hooks`, so
a pack hook here moves it) and, under Selective Checkpoint++, the attention ops' results
(kept by PyTorch's selective-checkpoint cache: the sc++ policy hands them to
:meth:`LayerStash.keep`, and their storage is moved out and back in place, so the cache
entries stay valid). InternEvo's ``selective_checkpoint_offload`` offloads the same
attention results.

On an accelerator the copies run on a side stream into pinned host buffers, overlapped
with compute: device -> host as soon as the layer's forward has produced the tensor,
host -> device for layer ``i - 1`` as soon as layer ``i``'s attention has made its
backward (its peak: :meth:`ActivationOffload.mark_attention` puts the point in the graph),
overlapped with the rest of layer ``i``'s backward (RoPE, the q/k/v projections). So
through a layer's attention and MLP backward the device holds that layer's kept tensors
alone, and two layers' only while the projections' backward runs.
On the CPU the same code runs and the "host" copy is a second CPU buffer, kept outside
torch's tensor allocator (tested here; it saves no memory on a CPU, but allocation
tracking sees the compute side's tensors alone, as it would on a GPU).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import numpy as np
import torch

Tensor = torch.Tensor


class _Copies:
    """The side stream and pinned allocation of one device (nothing on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.accelerated = device.type != "cpu"
        self.stream = torch.Stream(device=device) if self.accelerated else None

    def to_host(self, t: Tensor) -> tuple[Tensor, object]:
        """Start copying ``t`` to host memory; returns the host buffer and the copy's event."""
        if not self.accelerated:
            # the CPU is both device and host here: keep the copy outside torch's CPU tensor
            # allocator (numpy-owned bytes), as pinned host memory is outside a GPU's, so
            # allocation tracking tells the two apart
            raw = torch.from_numpy(np.empty(t.untyped_storage().nbytes(), dtype=np.uint8))
            host = raw[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            return host.copy_(t), None
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        self.stream.wait_stream(torch.accelerator.current_stream(self.device))
        with self.stream:
            host.copy_(t, non_blocking=True)
            event = self.stream.record_event()
        t.record_stream(self.stream)  # the allocator keeps t's memory until the copy has read it
        return host, event

    def to_device(self, host: Tensor, done_offload: object) -> tuple[Tensor, object]:
        """Start copying ``host`` back; returns the device tensor and the copy's event."""
        if not self.accelerated:
            return host.clone(), None
        with self.stream:
            # allocated on the side stream that fills it: a block the compute stream freed may
            # still be read by kernels queued there, which this stream does not wait for
            dev = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            self.stream.wait_event(done_offload)
            dev.copy_(host, non_blocking=True)
            event = self.stream.record_event()
        return dev, event

    def wait(self, t: Tensor, event: object) -> Tensor:
        """``t`` ready for the current stream."""
        if self.accelerated and event is not None:
            current = torch.accelerator.current_stream(self.device)
            current.wait_event(event)
            t.record_stream(current)
        return t


class _Entry:
    """One offloaded tensor: its host copy, and (once prefetched) its device copy."""

    def __init__(self, copies: _Copies, t: Tensor) -> None:
        self.host, self.offloaded = copies.to_host(t)
        self.device_copy: Tensor | None = None
        self.reloaded: object = None

    def prefetch(self, copies: _Copies) -> None:
        if self.device_copy is None and self.host is not None:
            self.device_copy, self.reloaded = copies.to_device(self.host, self.offloaded)

    def take(self, copies: _Copies) -> Tensor:
        self.prefetch(copies)
        t = copies.wait(self.device_copy, self.reloaded)
        self.device_copy, self.host = None, None  # the host copy is freed once its data is back
        return t


class _AttentionDone(torch.autograd.Function):
    """The identity on an attention's q, k, v; its backward runs when the attention's backward
    has made their gradients, and starts fetching the previous layer's kept tensors."""

    @staticmethod
    def forward(ctx, offload: ActivationOffload, stash: weakref.ref, q: Tensor, k: Tensor, v: Tensor):
        ctx.offload, ctx.stash = offload, stash
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor):
        stash = ctx.stash()
        if stash is not None:
            ctx.offload.prefetch_before(stash)
        return None, None, dq, dk, dv


class LayerStash:
    """What one checkpointed layer keeps, offloaded; made per layer and forward call."""

    def __init__(self, store: ActivationOffload) -> None:
        self.store = store
        self.inputs: list[_Entry] = []
        self.kept: list[tuple[Tensor, int]] = []  # selective-checkpoint cache tensors, moved in place
        self.kept_entries: list[_Entry] = []
        self.restored = False

    # -- forward ---------------------------------------------------------------------
    def keep(self, t: Tensor) -> None:
        """Offload ``t`` in place once the layer's forward is done (a tensor the sc++ cache keeps)."""
        storage = t.untyped_storage()
        if storage.nbytes() and all(storage.data_ptr() != k.untyped_storage().data_ptr() for k, _ in self.kept):
            self.kept.append((t, storage.nbytes()))

    def pack_input(self, t: Tensor) -> _Entry:
        entry = _Entry(self.store.copies, t)
        self.inputs.append(entry)
        return entry

    def forward_done(self) -> None:
        """Move the kept cache tensors' storage to the host (the forward no longer reads them)."""
        for t, _ in self.kept:
            storage = t.untyped_storage()
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)  # every byte, views included
            self.kept_entries.append(_Entry(self.store.copies, whole))
            storage.resize_(0)

    # -- backward --------------------------------------------------------------------
    def prefetch(self) -> None:
        for entry in (*self.inputs, *self.kept_entries):
            entry.prefetch(self.store.copies)

    def restore(self) -> None:
        """Bring the kept cache tensors back before the layer's recompute reads them; start
        fetching the previous layer's."""
        if self.restored:
            return
        self.restored = True
        for (t, nbytes), entry in zip(self.kept, self.kept_entries):
            data = entry.take(self.store.copies)
            storage = t.untyped_storage()
            storage.resize_(nbytes)
            storage.copy_(data.untyped_storage())  # a storage copy: the cached tensor's version is unchanged
        self.kept, self.kept_entries = [], []


class ActivationOffload:
    """The offload of one model's checkpointed layers (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.copies = _Copies(device)
        self._order: list[weakref.ref[LayerStash]] = []  # this forward's stashes, in layer order

    def new_stash(self, first_layer: bool) -> LayerStash:
        if first_layer:  # a new forward: stashes of a forward that had no backward are not ours to fetch
            self._order.clear()
        stash = LayerStash(self)
        self._order.append(weakref.ref(stash))
        return stash

    def host_bytes(self) -> int:
        """Bytes of host copies the stashes of the current forward hold (0 once their backward ran)."""
        total = 0
        for ref in self._order:
            stash = ref()
            if stash is not None:
                entries = [*stash.inputs, *stash.kept_entries]
                total += sum(e.host.numel() * e.host.element_size() for e in entries if e.host is not None)
        return total

    def prefetch_before(self, stash: LayerStash) -> None:
        """``stash``'s layer is past its attention's backward: start fetching the layer before it."""
        for i, ref in enumerate(self._order):
            if ref() is stash:
                previous = self._order[i - 1]() if i > 0 else None
                if previous is not None:
                    previous.prefetch()
                del self._order[i:]
                return

    def mark_attention(self, attention_fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        """``attention_fn`` with a point in the graph after it: once the backward has gone
        through the attention of the layer whose forward is running (its stash: the latest
        made), the previous layer's kept tensors start coming back. Where the point never
        runs (no gradient reaches q/k/v), the previous layer fetches its tensors when its
        backward needs them."""

        def marked(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
            stash = self._order[-1]() if self._order else None
            if stash is not None and torch.is_grad_enabled():
                q, k, v = _AttentionDone.apply(self, weakref.ref(stash), q, k, v)
            return attention_fn(q, k, v, **kwargs)

        return marked

    @contextlib.contextmanager
    def saving(self, stash: LayerStash, block_input: Tensor) -> Iterator[None]:
        """Offload ``block_input`` when the checkpoint saves it (the hooks see every tensor
        saved in this scope; all others are kept as they are)."""

        # a weak reference: autograd keeps the pack hook with each tensor saved in this scope,
        # so a closure over the tensor itself would keep its device copy alive until backward
        target = weakref.ref(block_input)

        def pack(t: Tensor):
            return stash.pack_input(t) if t is target() else t

        def unpack(saved):
            if isinstance(saved, _Entry):
                stash.restore()  # the layer's recompute starts: its cache tensors too
                return saved.take(self.copies)
            return saved

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
