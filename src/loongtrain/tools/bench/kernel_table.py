"""The top kernels of a profiled step, by device time and by call count, with totals by kind.

On a GPU the entries are the device's kernels (and its memcpy/memset), timed on the device.
On CPU they are the aten operators, each timed by its own CPU time (its callees' excluded), so
the times add up; operators nest there, so the calls count wrappers too (``aten::linear``
beside the ``aten::addmm`` it calls), except that an operator calling one of its own kind
(``aten::matmul`` calling ``aten::mm``, ``aten::_to_copy`` calling ``aten::copy_``) is left
out, so that each product and each copy counts once. The arithmetic is pure
(:func:`kernel_table` on ``(name, time_us, calls)`` records); :func:`profiler_records` reads a
``torch.profiler`` profile.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

#: kind -> pattern of the (lower-cased) names counted as that kind. Matrix products: GEMM
#: libraries' kernels (``gemm``, cuBLAS's Hopper ``nvjet``), ``matmul``, and ``mm``/``addmm``/
#: ``bmm``/``baddbmm`` as a word (not ``comm`` or ``symmetric``); copies: ``copy_``, ``Memcpy``
#: and the copy kernels: a ``to``/``contiguous``/``clone`` that copies is counted by the copy
#: it makes (one that copies nothing, a leaf on CPU, is no copy); multiplies:
#: ``mul``/``mul_``/``_foreach_mul_`` and CUDA's ``MulFunctor`` (not ``multi_tensor_apply``).
KINDS: dict[str, re.Pattern] = {
    "matmul": re.compile(r"gemm|matmul|nvjet|(?:^|[^a-z])(?:add|b|baddb|addb)?mm(?:[^a-z]|$)"),
    "copy": re.compile(r"copy|memcpy"),
    "multiply": re.compile(r"(?:^|[^a-z])mul(?:[^a-z]|$)|mulfunctor"),
}


@dataclass(frozen=True)
class KernelRow:
    """One kernel (all its calls): name, total time (µs) and number of calls."""

    name: str
    time_us: float
    calls: int


@dataclass(frozen=True)
class KernelTable:
    """The ``top`` kernels by time and by calls, and totals over every kernel."""

    by_time: list[KernelRow]
    by_calls: list[KernelRow]
    total_time_us: float
    total_calls: int
    kind_calls: dict[str, int]  # kind (of :data:`KINDS`) -> calls
    kind_time_us: dict[str, float]

    def as_dict(self) -> dict:
        """The table as plain JSON-able values."""
        return {
            "by_time": [vars(r) for r in self.by_time],
            "by_calls": [vars(r) for r in self.by_calls],
            "total_time_us": self.total_time_us,
            "total_calls": self.total_calls,
            "kind_calls": self.kind_calls,
            "kind_time_us": self.kind_time_us,
        }


def kind_of(name: str) -> str | None:
    """The kind of :data:`KINDS` a kernel of this name is counted as, or None."""
    low = name.lower()
    return next((kind for kind, pattern in KINDS.items() if pattern.search(low)), None)


def kernel_table(records: Iterable[tuple[str, float, int]], top: int = 15) -> KernelTable:
    """Sum ``(name, time_us, calls)`` records by name; the ``top`` names by total time and by
    calls (ties by name), and the totals: all calls, all time, and each kind's calls and time."""
    if top < 1:
        raise ValueError(f"kernel_table: top={top} must be at least 1")
    time_us: dict[str, float] = {}
    calls: dict[str, int] = {}
    for name, t, n in records:
        time_us[name] = time_us.get(name, 0.0) + float(t)
        calls[name] = calls.get(name, 0) + int(n)
    rows = [KernelRow(name, time_us[name], calls[name]) for name in time_us]
    kind_calls = dict.fromkeys(KINDS, 0)
    kind_time = dict.fromkeys(KINDS, 0.0)
    for row in rows:
        kind = kind_of(row.name)
        if kind is not None:
            kind_calls[kind] += row.calls
            kind_time[kind] += row.time_us
    return KernelTable(
        by_time=sorted(rows, key=lambda r: (-r.time_us, r.name))[:top],
        by_calls=sorted(rows, key=lambda r: (-r.calls, r.name))[:top],
        total_time_us=sum(time_us.values()),
        total_calls=sum(calls.values()),
        kind_calls=kind_calls,
        kind_time_us=kind_time,
    )


def _short(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def format_kernel_table(table: KernelTable, title: str, width: int = 90) -> str:
    """``table`` as text: a title, the totals, then the top kernels by time and by calls."""
    total = table.total_time_us or 1.0
    kinds = ", ".join(
        f"{kind} {table.kind_calls[kind]} calls ({table.kind_time_us[kind] / total:.1%} of time)" for kind in KINDS
    )
    lines = [
        title,
        f"total {table.total_calls} calls, {table.total_time_us / 1e3:.3f} ms; {kinds}",
        f"  by time: {'ms':>10s} {'share':>6s} {'calls':>7s}  name",
    ]
    lines += [
        f"  {'':8s} {r.time_us / 1e3:10.3f} {r.time_us / total:6.1%} {r.calls:7d}  {_short(r.name, width)}"
        for r in table.by_time
    ]
    lines.append(f"  by calls: {'calls':>7s} {'ms':>10s}  name")
    lines += [f"  {'':9s} {r.calls:7d} {r.time_us / 1e3:10.3f}  {_short(r.name, width)}" for r in table.by_calls]
    return "\n".join(lines)


def _calls_own_kind(event, kind: str) -> bool:
    """Whether ``event`` calls (at any depth) an operator of ``kind``."""
    stack = list(event.cpu_children)
    while stack:
        child = stack.pop()
        if kind_of(child.name) == kind:
            return True
        stack += child.cpu_children
    return False


def profiler_records(prof, device_kernels: bool) -> list[tuple[str, float, int]]:
    """``(name, time_us, 1)`` per kernel call of a finished ``torch.profiler.profile``: the
    device's kernels (``device_kernels``), or the CPU's aten operators by their own time
    (less those that call one of their own kind: see the module's doc)."""
    out = []
    for e in prof.events():
        on_device = e.device_type.name != "CPU"
        if device_kernels:
            if on_device:
                out.append((e.name, e.time_range.elapsed_us(), 1))
        elif not on_device and e.name.startswith("aten::"):
            kind = kind_of(e.name)
            if kind is None or not _calls_own_kind(e, kind):
                out.append((e.name, e.self_cpu_time_total, 1))
    return out
