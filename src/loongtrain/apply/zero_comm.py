"""Counting ZeRO's collectives: the bytes FSDP2's all-gathers, reduce-scatters and (HSDP)
all-reduces move per rank, into ``state.stats`` beside the attention's.

FSDP2 takes a custom all-gather and reduce-scatter per module (``FSDPModule.
set_custom_all_gather`` / ``set_custom_reduce_scatter``, public methods) but their base
classes live in a private module: this file is the one place that imports it. The
counting comms call the public collectives FSDP2's defaults call
(``all_gather_single``, ``reduce_scatter_single``; ``*_into_tensor``/``*_tensor`` before
torch 2.13), on the buffers FSDP2 hands them,
so what runs is unchanged (float8 buffers, from the float8 all-gather, travel as the same bytes
viewed as uint8: gloo has no float8 type). The HSDP all-reduce is seen through ``set_all_reduce_hook``,
which FSDP2 calls after it.

Bytes are those a bandwidth-optimal (ring) algorithm sends from each rank, which is also
what it receives: all-gather and reduce-scatter ``(n - 1) x`` the shard, all-reduce
``2 (n - 1) / n x`` the buffer (NCCL's "bus" bytes), for a group of ``n``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from loongtrain.parallel.stats import AttentionStats

try:  # torch >= 2.9 (the custom-comm hooks); older FSDP2 runs uncounted
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - depends on the installed torch
    AllGather = ReduceScatter = None  # type: ignore[assignment,misc]

__all__ = ["ZERO_KINDS", "count_reduce", "count_zero_comm", "reduce_scatter_into", "zero_comm_countable"]

#: ``state.stats`` kinds of ZeRO's collectives.
ZERO_KINDS = ("zero.all_gather", "zero.reduce_scatter", "zero.all_reduce")


def zero_comm_countable() -> bool:
    """Whether this torch's FSDP2 takes custom collectives (so ZeRO's bytes can be counted)."""
    return AllGather is not None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# torch 2.13 renamed the tensor collectives (the old names warn); 2.11 has only the old ones
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


#: one-byte float types a float8 all-gather hands FSDP2's all-gather (``[float8]
#: enable_fsdp_float8_all_gather``): sent as the same bytes viewed as uint8, which every backend carries
FLOAT8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))


def _alloc(size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(size, dtype=dtype, device=device)


if AllGather is not None:

    class _CountingAllGather(AllGather):
        def __init__(self, stats: AttentionStats) -> None:
            self.stats = stats

        def allocate(self, size, *, dtype, device):
            return _alloc(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            _add(self.stats, "zero.all_gather", _nbytes(input_tensor) * (group.size() - 1))
            if output_tensor.dtype in FLOAT8_DTYPES:  # the float8 all-gather: gloo has no float8 type
                output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
            return _all_gather(output_tensor, input_tensor, group=group, async_op=async_op)

    class _CountingReduceScatter(ReduceScatter):
        """``single_shard``: the shard group has one rank, where FSDP2 copies its reduce-scatter
        input into a second buffer of the same size (its "output") instead of reducing; the
        output's allocation then returns the input, so the full-size float32 gradient exists
        once (a vocabulary matrix of Llama-3-8B: 2.1 GB less at the root's reduce). FSDP2's
        ``foreach_reduce`` allocates the input, copies the gradients in, then allocates the
        output while it still holds the input, and copies the input into it (a copy onto
        itself returns at once). The input is handed back only while FSDP2 still holds it (a
        reference count above ours): an input whose reduce never asked for its output (an
        error in between) is dropped, never handed out again.

        Streams: FSDP2 allocates the input on the compute stream and the output on its
        reduce-scatter stream, where it then reads the output after the event it hands the compute
        stream (the division, the copy to the host under offload, the accumulation, HSDP's
        all-reduce on a third stream). The compute stream frees the input once that event has
        passed, so the input handed back as the output is recorded on the stream asking for it
        (and on the all-reduce's, :func:`_all_reduce_counter`): the caching allocator then keeps
        it until every kernel queued there has run, as it does for FSDP2's own output."""

        def __init__(self, stats: AttentionStats, single_shard: bool = False) -> None:
            self.stats = stats
            self.single_shard = single_shard
            self._input: torch.Tensor | None = None

        def allocate(self, size, *, dtype, device):
            held, self._input = self._input, None
            # references to `held`: this frame's, getrefcount's argument, and FSDP2's input variable
            if (
                held is not None
                and sys.getrefcount(held) > 2
                and held.shape == torch.Size(size)
                and held.dtype == dtype
            ):
                record_on_current_stream(held)
                return held
            buffer = _alloc(size, dtype=dtype, device=device)
            if self.single_shard:
                self._input = buffer
            return buffer

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            _add(self.stats, "zero.reduce_scatter", _nbytes(output_tensor) * (group.size() - 1))
            return reduce_scatter_into(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def count_reduce(stats: AttentionStats, shard: torch.Tensor, shards: int, replicas: int) -> None:
    """Count a gradient reduced into ``shard`` by hand (not through FSDP2): a reduce-scatter
    over ``shards`` ranks and, with ``replicas`` > 1, an all-reduce of the shard (HSDP)."""
    if shards > 1:
        _add(stats, "zero.reduce_scatter", _nbytes(shard) * (shards - 1))
    if replicas > 1:
        _add(stats, "zero.all_reduce", 2 * (replicas - 1) * _nbytes(shard) // replicas)


def _add(stats: AttentionStats, kind: str, moved: int) -> None:
    stats.add(kind, moved)
    stats.add_received(kind, moved)


def record_on_current_stream(t: torch.Tensor) -> None:
    """Tell the caching allocator that ``t`` is used by the current stream of its device (nothing on
    the CPU): its memory is reused only after the work queued there when it is freed has run."""
    if t.device.type != "cpu":
        t.record_stream(torch.accelerator.current_stream(t.device))


def _all_reduce_counter(stats: AttentionStats, replicas: int, single_shard: bool):
    def hook(reduce_output: torch.Tensor) -> None:
        if single_shard:  # the input handed back as the output: the all-reduce stream reads it too
            record_on_current_stream(reduce_output)
        _add(stats, "zero.all_reduce", 2 * (replicas - 1) * _nbytes(reduce_output) // replicas)

    return hook


def count_zero_comm(module, stats: AttentionStats, replicas: int, shards: int) -> bool:
    """Count ``module``'s (an ``FSDPModule``) collectives into ``stats``; ``replicas`` is the
    size of the mesh's replicate dimension (1 without HSDP), ``shards`` of its shard dimension
    (1: the gradients' buffer is not copied, see ``_CountingReduceScatter``). False where this
    torch cannot."""
    if not zero_comm_countable():
        return False
    module.set_custom_all_gather(_CountingAllGather(stats))
    module.set_custom_reduce_scatter(_CountingReduceScatter(stats, single_shard=shards == 1))
    if replicas > 1:
        module.set_all_reduce_hook(_all_reduce_counter(stats, replicas, shards == 1))
    return True
