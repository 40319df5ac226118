"""What the allocator holds at a step's memory peak, allocation by allocation, and which line
of code made each: the tool that finds where the memory model and the real code disagree.

:class:`AllocatorPeak` records the block with PyTorch's profiler (its allocator events, with
Python stacks) and replays every allocation and free of the device in order. At the largest
moment it keeps the allocations still held, and names each by the innermost loongtrain line
on its call stack (``file:line:function``, the line that called the op), the ATen op that
allocated it (temporaries inside an op included: ``torch.logsumexp``'s ``x - max`` shows,
which a dispatch mode could not see) and the step's phase. An allocation made by a built-in
op's backward is named by the forward line that made the autograd node (its sequence
number). The held allocations add up to the peak, byte for byte. The profiler reports no
free of a storage made before the block (it warns once), so the peak is of what the block
made: beyond the start, not less what older tensors freed (none in a training step but the
previous step's leftovers).

One private PyTorch name is used, here only: the profiler's event tree
(``kineto_results.experimental_event_tree()``, the tree ``torch.profiler._memory_profiler``
reads): the public events carry an allocation's size but not its address, nor the Python
frame that called it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch._C._profiler import _EventType

__all__ = ["PHASE", "AllocatorPeak", "Held", "by_line", "live_storages", "quiet_stderr"]

#: the name prefix of the phase marks (``record_function`` ranges) the step's hooks emit
PHASE = "loongtrain-phase:"
_BACKWARD = "autograd::engine::evaluate_function: "


@dataclass(frozen=True)
class Held:
    """One allocation held at the peak: its bytes, the ATen op that made it (``outer > inner``
    when the op the code called made it inside another), the line that made it, the phase."""

    nbytes: int
    op: str
    where: str
    phase: str


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


def _event_tree(prof: torch.profiler.profile) -> list:
    """Every node of the profiler's event tree, parents before children (the one private
    profiler API here; see the module docstring)."""
    nodes, todo = [], list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while todo:
        node = todo.pop()
        nodes.append(node)
        todo.extend(reversed(node.children))
    return nodes


def _library_line(frame) -> str | None:
    """``file:line:function`` of a profiler frame in loongtrain's code (not this tool's), else None."""
    path = frame.file_name.replace("\\", "/")
    if "loongtrain/" not in path or "/tools/bench/" in path:
        return None
    return f"{path.rsplit('loongtrain/', 1)[-1]}:{frame.line_number}:{frame.function_name}"


class _Namer:
    """Names an event-tree node by the loongtrain line and the ATen op it runs under."""

    def __init__(self, nodes: list) -> None:
        self.python_frames = any(n.tag == _EventType.PyCall for n in nodes)
        # the ops that made autograd nodes, by sequence number (the outermost of each; a
        # checkpoint's recompute runs inside backward and makes nodes too), to name a backward
        self._forward: dict[int, list] = defaultdict(list)
        for n in nodes:
            if n.tag != _EventType.TorchOp or n.extra_fields.sequence_number < 0 or n.name.startswith(_BACKWARD):
                continue
            parent = n.parent
            if parent is not None and parent.name == _BACKWARD + n.name:  # the node's own record
                continue
            if parent is not None and parent.tag == _EventType.TorchOp:
                if parent.extra_fields.sequence_number == n.extra_fields.sequence_number:
                    continue  # an op inside the op that made the node
            self._forward[n.extra_fields.sequence_number].append(n)

    def _made(self, backward) -> object | None:
        """The op that made the node ``backward`` runs: of those with its sequence number, the
        last to start before it (sequence numbers count per thread)."""
        before = [n for n in self._forward.get(backward.extra_fields.sequence_number, ())
                  if n.start_time_ns < backward.start_time_ns]  # fmt: skip
        return max(before, key=lambda n: n.start_time_ns) if before else None

    def line(self, node, backward: bool = True) -> str:
        """The innermost loongtrain line calling ``node``; in a built-in op's backward, the
        forward line that made the autograd node. An op run by an operator (``x + y``: no
        Python call of its own) is named by its loongtrain function's definition line."""
        while node is not None:
            if node.tag == _EventType.PyCall:
                line = _library_line(node.extra_fields.callsite) or _library_line(node.extra_fields.caller)
                if line is not None:
                    return line
            if node.tag == _EventType.PyCCall:
                line = _library_line(node.extra_fields.caller)
                if line is not None:
                    return line
            if backward and node.tag == _EventType.TorchOp and node.name.startswith(_BACKWARD):
                name = node.name[len(_BACKWARD) :]
                forward = self._made(node)
                made = self.line(forward, backward=False) if forward is not None else "?"
                return f"backward ({name}) of {made}"
            node = node.parent
        return "?"

    @staticmethod
    def op(node) -> str:
        """The ATen op that allocated (``called > innermost``), else the innermost recorded one
        (a backward node's own record)."""
        ops, node = [], node.parent
        while node is not None and node.tag == _EventType.TorchOp and not node.name.startswith(_BACKWARD):
            ops.append(node.name)
            node = node.parent
        aten = [name for name in ops if name.startswith("aten::")]
        if not aten:
            return ops[0] if ops else "?"
        return aten[-1] if aten[-1] == aten[0] else f"{aten[-1]} > {aten[0]}"


class AllocatorPeak:
    """``with AllocatorPeak(device) as top: ...``; then ``top.bytes``: the most bytes the
    allocator of ``device`` held at once beyond what it held at the start (every allocation
    and free, temporaries inside ops included: the profiler's memory events);
    ``top.held``: the :class:`Held` allocations made in the block and alive at that moment
    (their sum is ``bytes``); ``top.op`` and ``top.where``: the op and line of the
    allocation that reached the peak; ``top.phase``: the phase then (the last
    ``record_function(PHASE + name)`` mark). ``within``: a phase's name, whose own largest
    moment is taken instead of the block's. ``python_frames`` is False where this platform's
    profiler records no Python calls (torch 2.11 and 2.13 here record them): lines are then
    "?" and backward allocations named by their autograd node."""

    def __init__(self, device: torch.device | str = "cpu", within: str | None = None) -> None:
        self.device = torch.device(device)
        self.within = within  # a phase: the largest moment inside it instead of the block's
        self.bytes, self.op, self.where, self.phase = 0, "", "", ""
        self.held: list[Held] = []
        self.python_frames = False

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
        nodes = _event_tree(self._prof)
        namer = _Namer(nodes)
        self.python_frames = namer.python_frames
        marks = [n for n in nodes if n.tag == _EventType.TorchOp and n.name.startswith(PHASE)]
        allocs = [n for n in nodes if n.tag == _EventType.Allocation and self._here(n.extra_fields.device)]
        events = sorted([(n.start_time_ns, 1, n) for n in allocs] + [(n.start_time_ns, 0, n) for n in marks],
                        key=lambda e: (e[0], e[1]))  # fmt: skip
        # first pass: the moment of the peak; second: what is held then
        running, peak_at, made, phase = 0, -1, set(), "start"
        for i, (_, is_alloc, n) in enumerate(events):
            if not is_alloc:
                phase = n.name[len(PHASE) :]
                continue
            size, ptr = n.extra_fields.alloc_size, n.extra_fields.ptr
            if size < 0 and ptr not in made:  # an older storage's free (not reported on the CPU)
                continue
            made.add(ptr) if size > 0 else made.discard(ptr)
            running += size
            if running > self.bytes and self.within in (None, phase):
                self.bytes, peak_at = running, i
        if peak_at < 0:
            return
        live: dict[int, tuple[int, object, str]] = {}
        phase = "start"
        for _, is_alloc, n in events[: peak_at + 1]:
            if not is_alloc:
                phase = n.name[len(PHASE) :]
                continue
            size, ptr = n.extra_fields.alloc_size, n.extra_fields.ptr
            if size > 0:
                live[ptr] = (size, n, phase)
            else:
                live.pop(ptr, None)
        self.phase = phase
        self.held = [Held(size, namer.op(n), namer.line(n), p) for size, n, p in live.values()]
        top = events[peak_at][2]
        self.op, self.where = namer.op(top), namer.line(top)

    def _here(self, device) -> bool:
        return device.type == self.device.type and (self.device.index is None or device.index == self.device.index)


def by_line(held: list[Held]) -> list[tuple[str, str, int, int]]:
    """Held allocations grouped by (code line, op): ``(where, op, count, bytes)``, largest first."""
    groups: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for h in held:
        entry = groups[(h.where, h.op)]
        entry[0] += 1
        entry[1] += h.nbytes
    return sorted(((w, op, n, b) for (w, op), (n, b) in groups.items()), key=lambda row: -row[3])


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
