"""What is alive at a step's memory peak, tensor by tensor, and which line of code made it:
the tool that finds where the memory model and the real code disagree.

:class:`LiveTensors` watches every op while it is active (a ``TorchDispatchMode``): each
storage an op makes is recorded with the op, its shape and the innermost loongtrain line on
the Python stack, and followed by a weak reference until it is freed. At each new maximum
of the bytes alive, the list of live storages is kept: ``peak`` and ``snapshot`` after the
block. loongtrain's attention ops are custom ops, opaque to a dispatch mode (it would see
their outputs only); their Python implementations are run under the mode instead, so the
ring's and the all-to-alls' own buffers show too.

Only storages made inside the block are seen (parameters and anything made before are
not), and storages smaller than ``min_bytes`` are skipped. Two private PyTorch names are
used here and only here: ``TorchDispatchMode`` (``torch.utils._python_dispatch``: the
extension point for seeing every op, documented in PyTorch's dispatcher notes) and a
custom op's Python implementation (``CustomOpDef._init_fn`` and ``._opoverload``).
"""

from __future__ import annotations

import traceback
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

Tensor = torch.Tensor


@dataclass(frozen=True)
class Made:
    """One storage alive at the peak: its bytes, the op that made it, its shape, the
    loongtrain line that called the op (``file:line:function``), and the phase then."""

    nbytes: int
    op: str
    shape: tuple[int, ...]
    where: str
    phase: str


def _python_implementations() -> dict:
    """loongtrain's custom ops (``attention/ops.py``) -> their Python functions."""
    from loongtrain.attention import ops

    found = {}
    for value in vars(ops).values():  # torch.library.custom_op's CustomOpDef: its op and function
        op, fn = getattr(value, "_opoverload", None), getattr(value, "_init_fn", None)
        if op is not None and fn is not None:
            found[op] = fn
    return found


def _caller() -> str:
    for frame in reversed(traceback.extract_stack(limit=48)):
        if "/loongtrain/" in frame.filename and not frame.filename.endswith("bench/trace.py"):
            return f"{frame.filename.split('/loongtrain/')[-1]}:{frame.lineno}:{frame.name}"
    return "?"


class LiveTensors(TorchDispatchMode):
    """``with LiveTensors() as live: ...``; then ``live.peak`` (bytes) and ``live.snapshot``
    (the :class:`Made` alive at that moment). ``live.phase`` may be set during the block to
    label what follows (it is recorded with each storage and the peak)."""

    def __init__(self, min_bytes: int = 1 << 16) -> None:
        super().__init__()
        self.min_bytes = min_bytes
        self.phase = "start"
        self.peak = 0
        self.peak_phase = ""
        self.snapshot: list[Made] = []
        self._live: dict[int, tuple[StorageWeakRef, Made]] = {}
        self._bytes = 0
        self._impls = _python_implementations()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = self._impls.get(func)
        if impl is not None:
            with self:  # the op's own Python code, its inner ops seen one by one
                out = impl(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        self._record(func, out)
        return out

    def _record(self, func, out) -> None:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self._bytes -= self._live.pop(key)[1].nbytes
        for t in tree_flatten(out)[0]:
            if not isinstance(t, Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() < self.min_bytes or key in self._live:
                continue
            self._live[key] = (StorageWeakRef(storage), Made(storage.nbytes(), str(func), tuple(t.shape), _caller(),
                                                             self.phase))  # fmt: skip
            self._bytes += storage.nbytes()
        if self._bytes > self.peak:
            self.peak, self.peak_phase = self._bytes, self.phase
            self.snapshot = [made for _, made in self._live.values()]


def by_line(snapshot: list[Made]) -> list[tuple[str, str, int, int]]:
    """The snapshot grouped by (code line, op): ``(where, op, count, bytes)``, largest first."""
    groups: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for made in snapshot:
        entry = groups[(made.where, made.op)]
        entry[0] += 1
        entry[1] += made.nbytes
    return sorted(((w, op, n, b) for (w, op), (n, b) in groups.items()), key=lambda row: -row[3])
