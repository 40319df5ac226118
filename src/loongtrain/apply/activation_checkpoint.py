"""Activation checkpointing per transformer block: ``none``, ``full`` and ``sc++``.

- ``full``: the block's forward is recomputed in backward, distributed attention
  included (its all-to-alls, ring hops and kernels run again).
- ``sc++`` (Selective Checkpoint++): the block is recomputed but the attention ops are
  kept (PyTorch selective checkpointing with a MUST_SAVE policy), so recompute runs the
  projections, norms and MLP only: no attention communication, no attention kernels.
  The cost over ``full`` is what the attention backward needs per layer: its output
  (and lse) and, when ``hp > 1``, the head-scattered q, k, v, which is what spares the
  all-to-all in recompute. Saved values live in the autograd graph and go with it.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from loongtrain.apply.offload import ActivationOffload, LayerStash
from loongtrain.attention.ops import ATTENTION_OPS
from loongtrain.model.llama import Transformer
from loongtrain.options import MemoryOptions, check_activation_checkpoint, checkpointed_count

__all__ = ["apply_activation_checkpoint", "checkpointed_layers"]

# The attention ops kept by sc++: the distributed ones, and PyTorch's own SDPA kernels so
# that sc++ means the same on a single device.
_KEPT_OPS = frozenset(
    [*ATTENTION_OPS]
    + [
        getattr(torch.ops.aten, name).default
        for name in (
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
        )
        if hasattr(torch.ops.aten, name)
    ]
)


def _keep_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _sc_plus_plus_context():
    return create_selective_checkpoint_contexts(_keep_attention)


class _HandKeptOutputs(TorchDispatchMode):
    """Hands the outputs of every op that sc++ keeps to ``stash`` (the forward only). Entered
    above the selective-checkpoint mode, so it sees each op's outputs as that mode returns
    them; PyTorch's policy context carries the outputs itself only from 2.13
    (``SelectiveCheckpointContext.op_output``), and this works on every version we test.
    ``TorchDispatchMode`` is PyTorch's documented extension point, though it lives in the
    private ``torch.utils._python_dispatch``; this is its one use."""

    def __init__(self, stash: LayerStash) -> None:
        super().__init__()
        self.stash = stash

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _KEPT_OPS:
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor):
                    self.stash.keep(t)
        return out


def _sc_plus_plus_offloading(stash: LayerStash):
    """The sc++ policy, handing every result it keeps to ``stash`` (moved to host memory)."""

    def contexts():
        forward, recompute = _sc_plus_plus_context()
        return _entered_together(forward, _HandKeptOutputs(stash)), recompute

    return contexts


@contextlib.contextmanager
def _entered_together(*managers):
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


def apply_activation_checkpoint(
    model: Transformer,
    mode: str,
    every: int = 1,
    offload: ActivationOffload | None = None,
    span: int = 1,
    layers: int = 0,
) -> None:
    """Checkpoint layers ``0, every, 2*every, ...`` (``layers > 0``: the first ``layers``; the
    others keep their activations and recompute nothing) with ``mode``; with ``offload``, what each
    checkpointed layer keeps (its input; under sc++ also the attention results) lives in
    host memory between its forward and its backward (:mod:`loongtrain.apply.offload`).
    ``span > 1`` (``full`` only): spans of ``span`` layers run in one checkpoint that keeps
    the span's input alone (offloaded with ``offload``); its recompute in backward runs the
    span's layers, each checkpointed again, so one layer's recompute at a time.

    The block's ``forward`` is wrapped in place (parameter names do not change, so
    checkpoints load across modes).
    """
    check_activation_checkpoint(mode, every, span, layers)
    checkpointed = checkpointed_layers(len(model.layers), mode, every, layers)
    if span > 1:
        _checkpoint_spans(model, span, offload)
        offload = None  # the spans' inputs are what is offloaded; a layer's input inside a span is not kept
    if mode == "none":
        if offload is not None:
            raise ValueError(
                "activation offload moves what activation checkpointing keeps; with activation_checkpoint='none' "
                "there is nothing to move: use 'full' or 'sc++'"
            )
        return
    for index, layer in enumerate(model.layers):
        if index not in checkpointed:
            continue
        inner = layer.forward

        def forward(self, x, *args, _inner=inner, _first=index == 0):
            if offload is None:
                kwargs = {"context_fn": _sc_plus_plus_context} if mode == "sc++" else {}
                return checkpoint(_inner, x, *args, use_reentrant=False, **kwargs)
            stash = offload.new_stash(first_layer=_first)
            kwargs = {"context_fn": _sc_plus_plus_offloading(stash)} if mode == "sc++" else {}
            with offload.saving(stash, x):
                out = checkpoint(_inner, x, *args, use_reentrant=False, **kwargs)
            stash.forward_done()
            return out

        layer.forward = types.MethodType(forward, layer)
        if offload is not None:
            layer.attention.attention_fn = offload.mark_attention(layer.attention.attention_fn)


def checkpointed_layers(n_layers: int, mode: str, every: int = 1, layers: int = 0) -> range:
    """The layers ``mode`` checkpoints: ``0, every, 2*every, ...``, or with ``layers > 0`` the first
    ``layers`` (none under ``"none"``). The first ones, because backward reaches them last: the
    layers without recompute have freed their activations by then, so a checkpointed layer's
    recompute never adds to the peak at the start of backward."""
    memory = MemoryOptions(activation_checkpoint=mode, activation_checkpoint_every=every,
                           activation_checkpoint_layers=layers)  # fmt: skip
    count = checkpointed_count(memory, n_layers)
    return range(count) if layers else range(0, count * every, every)


def _checkpoint_spans(model: Transformer, span: int, offload: ActivationOffload | None) -> None:
    """``model.run_layers`` over spans of ``span`` layers, each span one checkpoint."""

    def run_layers(self, h, ropes, layout):
        layers = list(self.layers)
        for first in range(0, len(layers), span):
            part = layers[first : first + span]

            def run(x, *args, _part=part):
                for layer in _part:
                    x = layer(x, *args)
                return x

            if offload is None:
                h = checkpoint(run, h, ropes, layout, use_reentrant=False)
                continue
            stash = offload.new_stash(first_layer=first == 0)
            with offload.saving(stash, h):
                h = checkpoint(run, h, ropes, layout, use_reentrant=False)
            stash.forward_done()
        return h

    model.run_layers = types.MethodType(run_layers, model)
