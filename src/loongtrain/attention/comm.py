"""Communication primitives of the attention: ring exchange and head all-to-all.

All transfers are asynchronous: a function starts them and returns a handle whose
``wait()`` yields the received tensor, so callers overlap them with compute. Sends and
receives of one exchange are posted together (``batch_isend_irecv``): a blocking send
before the receive deadlocks gloo around a ring.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loongtrain.parallel.state import ParallelState, RingLink
from loongtrain.parallel.stats import AttentionStats

#: Profiler label of the time spent waiting for an attention transfer.
WAIT_LABEL = "loongtrain::comm_wait"


class Pending:
    """An in-flight transfer; ``wait()`` returns the received tensor (through ``finish``).

    Several handles may share one ``works`` list (the receives of one batch): the first
    ``wait()`` waits and empties it, so each work is waited once (gloo blocks when a
    finished point-to-point work is waited again).
    """

    def __init__(self, works: list, result: torch.Tensor, finish=None) -> None:
        self._works = works
        self._result = result
        self._finish = finish

    def wait(self) -> torch.Tensor:
        if self._works:
            # what `loongtrain bench train` counts as waiting on a CPU run (gloo's wait blocks the host);
            # NCCL's wait only makes the current stream wait, so on a GPU the step profile reads the
            # device timeline instead, where NCCL's own kernels are the communication
            with torch.profiler.record_function(WAIT_LABEL):
                for work in self._works:
                    work.wait()
            self._works.clear()
        if self._finish is not None:
            self._result, self._finish = self._finish(self._result), None
        return self._result


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def ring_exchange(
    send: torch.Tensor | None,
    link: RingLink,
    stats: AttentionStats,
    kind: str,
    *,
    recv: bool = True,
    like: torch.Tensor | None = None,
) -> Pending:
    """Send ``send`` to the next ring member and/or receive the previous member's block.

    Either side may be absent (a trimmed route, :mod:`loongtrain.attention.routes`): ``send``
    None sends nothing, ``recv=False`` receives nothing (``wait()`` then returns None). The
    receive buffer is shaped like ``like`` (default: ``send``). ``kind`` is the label
    counted in ``stats``.
    """
    sends = [] if send is None else [(send, link.send_to)]
    works, buffers = post_p2p(sends, [link.recv_from] if recv else [], like, link.kv_group, stats, kind)
    return Pending(works, buffers[0] if recv else None)


def post_p2p(
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[int],
    like: torch.Tensor | None,
    group: dist.ProcessGroup,
    stats: AttentionStats,
    kind: str,
    shapes: list[tuple[int, ...]] | None = None,
) -> tuple[list, list[torch.Tensor]]:
    """Post ``sends`` (tensor, global peer) and receives from the global ranks ``recvs`` into
    new buffers shaped like ``like`` (default: the first send; ``shapes``: one shape per
    receive, ``like``'s dtype) together, as one batch; returns its works and the receive
    buffers (valid once the works are waited). Sends and receives are counted in ``stats``
    under ``kind``."""
    ops = []
    for tensor, peer in sends:
        tensor = tensor.contiguous()
        ops.append(dist.P2POp(dist.isend, tensor, peer=peer, group=group))
        stats.add(kind, _nbytes(tensor))
    buffers = []
    for i, peer in enumerate(recvs):
        if shapes is not None:
            buffer = like.new_empty(shapes[i])
        else:
            buffer = torch.empty_like(sends[0][0] if like is None else like)
        ops.append(dist.P2POp(dist.irecv, buffer, peer=peer, group=group))
        stats.add_received(kind, _nbytes(buffer))
        buffers.append(buffer)
    return (dist.batch_isend_irecv(ops) if ops else []), buffers


def all_to_all_start(
    packed: torch.Tensor, group: dist.ProcessGroup | None, stats: AttentionStats, kind: str, finish=None
) -> Pending:
    """All-to-all of ``packed`` ([world, ...], chunk ``r`` goes to group rank ``r``);
    ``finish`` is applied to the received tensor on ``wait()``."""
    if group is None:
        return Pending([], packed, finish)
    packed = packed.contiguous()
    out = torch.empty_like(packed)
    stats.add(kind, _nbytes(packed))
    stats.add_received(kind, _nbytes(out))
    work = dist.all_to_all_single(out, packed, group=group, async_op=True)
    return Pending([work], out, finish)


def seq_to_head(x: torch.Tensor, state: ParallelState, kind: str) -> Pending:
    """Start the head all-to-all scattering heads and gathering sequence:
    [*b, S, H, d] -> (on ``wait()``) [*b, hp*S, H/hp, d]."""
    hp = state.hp
    return all_to_all_start(pack_seq_to_head(x, hp), state.head_group, state.stats, kind, unpack_seq_to_head)


def head_to_seq(x: torch.Tensor, state: ParallelState, kind: str) -> Pending:
    """Start the inverse all-to-all: [*b, hp*S, Hh, d] -> (on ``wait()``) [*b, S, hp*Hh, d]."""
    hp = state.hp
    return all_to_all_start(pack_head_to_seq(x, hp), state.head_group, state.stats, kind, unpack_head_to_seq)


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """All-gather ``inp`` of every group rank into ``out`` = [world * inp.shape[0], ...]."""
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (old name warns).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def pack_seq_to_head(x: torch.Tensor, hp: int) -> torch.Tensor:
    """[*b, S, H, d] -> [hp, *b, S, H/hp, d]: head chunk ``r`` first, ready for all-to-all."""
    *batch, s, h, d = x.shape
    x = x.reshape(*batch, s, hp, h // hp, d)
    return x.movedim(-3, 0).contiguous()


def unpack_seq_to_head(y: torch.Tensor) -> torch.Tensor:
    """[hp, *b, S, Hh, d] (chunk ``r`` from head rank ``r``) -> [*b, hp*S, Hh, d]."""
    hp, *batch, s, hh, d = y.shape
    return y.movedim(0, -4).reshape(*batch, hp * s, hh, d)


def pack_head_to_seq(x: torch.Tensor, hp: int) -> torch.Tensor:
    """[*b, hp*S, Hh, d] -> [hp, *b, S, Hh, d]: sequence piece ``r`` goes to head rank ``r``."""
    *batch, s_total, hh, d = x.shape
    x = x.reshape(*batch, hp, s_total // hp, hh, d)
    return x.movedim(-4, 0).contiguous()


def unpack_head_to_seq(y: torch.Tensor) -> torch.Tensor:
    """[hp, *b, S, Hh, d] (head chunk ``r`` from rank ``r``) -> [*b, S, hp*Hh, d]."""
    hp, *batch, s, hh, d = y.shape
    return y.movedim(0, -3).reshape(*batch, s, hp * hh, d)
