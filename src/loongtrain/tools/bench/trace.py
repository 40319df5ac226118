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

import contextlib
import gc
import os
import sys
import traceback
import warnings
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


@contextlib.contextmanager
def quiet_stderr():
    """File descriptor 2 to /dev/null for the block: the profiler's C++ side (kineto) writes
    two lines per start and stop there, which no setting turns off."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _python_event_line(name: str) -> str:
    """A profiler Python-function event's name (``loongtrain/model/loss.py(36): _chunk_rows``)
    as ``model/loss.py:36:_chunk_rows``."""
    path, _, func = name.partition(": ")
    file, _, line = path.rpartition("(")
    return f"{file.rsplit('loongtrain/', 1)[-1]}:{line.rstrip(')')}:{func}"


class AllocatorPeak:
    """``with AllocatorPeak(device) as top: ...``; then ``top.bytes``: the most bytes the
    allocator of ``device`` held at once beyond what it held at the start (every allocation
    and free, the temporaries inside an op that a dispatch mode cannot see included: the
    profiler's memory events), ``top.op``: the ATen op running at that moment (the one the code
    called, ``> `` the innermost one inside it), and
    ``top.where``: the innermost loongtrain line running then (the profiler's Python stack;
    ``python_frames`` False where this platform's profiler records none: torch 2.11 on Python
    3.12 here).
    :class:`LiveTensors` names the line of every storage an op returns; the difference
    between the two peaks is what ops hold inside themselves, and this names where."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.bytes, self.op, self.where = 0, "", ""
        self.python_frames = False  # whether the profiler recorded Python calls (not on every platform)

    def __enter__(self) -> AllocatorPeak:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, profile_memory=True, with_stack=True)
        with quiet_stderr():
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        with quiet_stderr():
            self._prof.__exit__(*exc)
        kind = torch.profiler.DeviceType.CUDA if self.device.type == "cuda" else torch.profiler.DeviceType.CPU
        events = [(_event_name(e), e) for e in self._prof.profiler.kineto_results.events()]
        memory = sorted((e for name, e in events if name == "[memory]" and e.device_type() == kind),
                        key=lambda e: e.start_ns())  # fmt: skip
        running, at = 0, None
        for e in memory:
            running += e.nbytes()
            if running > self.bytes:
                self.bytes, at = running, e.start_ns()
        self.python_frames = any(name.partition("(")[0].endswith(".py") for name, _ in events)
        if at is None:
            return
        around = [(name, e.start_ns()) for name, e in events if name != "[memory]" and e.start_ns() <= at <= e.end_ns()]
        running_then = sorted(around, key=lambda x: x[1])
        ops = [name for name, _ in running_then if name.startswith("aten::")]
        if ops:  # the op the code called (the outermost), and the innermost one running inside it
            self.op = ops[0] if ops[0] == ops[-1] else f"{ops[0]} > {ops[-1]}"
        lines = [name for name, _ in running_then if _is_loongtrain_line(name)]
        nodes = [name for name, _ in running_then if name.startswith("autograd::engine::evaluate_function: ")]
        if lines:
            self.where = _python_event_line(lines[-1])
        elif nodes:  # backward of a built-in op: the autograd node that ran it
            self.where = "backward of " + nodes[-1].split(": ", 1)[1]


def _is_loongtrain_line(name: str) -> bool:
    """Whether a profiler event is a Python function of the library (not of this tool)."""
    return name.partition("(")[0].endswith(".py") and "loongtrain/" in name and "tools/bench/" not in name


def _event_name(event) -> str:
    """A profiler event's name; "" where the profiler recorded bytes that are not UTF-8 (seen
    for some Python-function events of a run under a dispatch mode)."""
    try:
        return event.name()
    except UnicodeDecodeError:
        return ""


def live_storages() -> dict[int, int]:
    """``{data_ptr: bytes}`` of the distinct CPU storages of every live tensor (a scan of the
    garbage collector's objects)."""
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on torch.distributed's deprecated aliases warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        if not obj.is_meta:
            try:
                storage = obj.untyped_storage()
                if storage.device.type == "cpu" and storage.nbytes():
                    seen[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # wrapper subclasses (DTensor), freed storages
                continue
    return seen


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
        self._before: set[int] = set()

    def __enter__(self) -> LiveTensors:
        # storages alive before the block (parameters, inputs): an op's view of one is not new
        self._before = set(live_storages())
        return super().__enter__()

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
            if storage.nbytes() < self.min_bytes or key in self._live or key in self._before:
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
