"""Process groups of one rank, built once: ``init_parallel(config) -> ParallelState``."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import types
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from loongtrain.options import ZERO_SCOPES, check_zero_scope
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.layout import RankCoords, RankLayout
from loongtrain.parallel.stats import AttentionStats
from loongtrain.parallel.zero_grid import zero_mesh_grid
from loongtrain.torch_support import check_torch


@dataclass(frozen=True)
class RingLink:
    """One ring (inner or outer) as seen from one rank: the communicator its key/value
    blocks travel on and the neighbours. (Their gradients go over the state's
    ``dkv_group``, so a KV transfer and a dK/dV transfer can be in flight at once.)
    """

    kv_group: dist.ProcessGroup
    send_to: int  # global rank of the next member
    recv_from: int  # global rank of the previous member
    size: int


@dataclass(frozen=True)
class ParallelState:
    """Everything a rank needs to run 2D attention: layout, coordinates and groups.

    Built by :func:`init_parallel` and passed explicitly to the attention functions.
    Groups of size one are ``None`` (no communication happens on them). ``zero_meshes``
    holds the DeviceMesh of each ZeRO scope that ``init_parallel`` built (read-only).
    """

    config: ParallelConfig
    layout: RankLayout
    rank: int
    coords: RankCoords
    device: torch.device
    sp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    head_group: dist.ProcessGroup | None
    context_group: dist.ProcessGroup | None
    inner_ring: RingLink | None
    outer_ring: RingLink | None
    dkv_group: dist.ProcessGroup | None = None  # the context group again: dK/dV partials (any member to any)
    verify_inputs: bool = True
    stats: AttentionStats = field(default_factory=AttentionStats)
    key: str = field(default_factory=lambda: f"state-{next(_KEYS)}")
    zero_meshes: Mapping[str, DeviceMesh] = field(default_factory=dict, repr=False)
    _world_group: dist.ProcessGroup | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _REGISTRY[self.key] = self

    @functools.cached_property
    def context_ranks(self) -> tuple[int, ...]:
        """Global rank of each context index of this rank's context group."""
        return self.layout.context_group(self.rank)

    @property
    def hp(self) -> int:
        return self.config.hp

    @property
    def cp(self) -> int:
        return self.config.cp

    @property
    def sp(self) -> int:
        return self.config.sp

    @property
    def dp(self) -> int:
        return self.layout.dp

    def with_balance(self, balance: str) -> ParallelState:
        """This state under another ``balance`` (its own key; the same groups, meshes and
        ``stats``): a layout per microbatch places some batches otherwise."""
        config = dataclasses.replace(self.config, balance=balance)
        return dataclasses.replace(self, config=config, key=f"state-{next(_KEYS)}")

    def check_alive(self) -> None:
        """Raise if the default process group this state was built on is gone."""
        if not dist.is_initialized() or dist.group.WORLD is not self._world_group:
            raise RuntimeError(
                "loongtrain: the process group this ParallelState was built on is no longer "
                "initialised; call torch.distributed.init_process_group and init_parallel again"
            )


# Custom ops (the attention) take plain values, not Python objects: each state registers
# under a process-unique key, weakly, so dropping the state frees it. The key is a string:
# torch.compile turns an int argument that changes between compilations (a second model on
# another state) into a symbolic int, which the ops' fake implementations cannot look up.
_KEYS = itertools.count()
_REGISTRY: weakref.WeakValueDictionary[str, ParallelState] = weakref.WeakValueDictionary()


def state_by_key(key: str) -> ParallelState:
    """The live :class:`ParallelState` registered under ``key``."""
    state = _REGISTRY.get(key)
    if state is None:
        raise RuntimeError(f"loongtrain: ParallelState {key} no longer exists (was it garbage-collected?)")
    return state


def default_device() -> torch.device:
    """The device the default process group communicates on (cuda for NCCL, else cpu)."""
    backend = str(dist.get_backend()).lower()
    if "nccl" in backend and torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.current_device() == 0 and 0 < local_rank < torch.cuda.device_count():
            # torchrun's local rank r > 0 still on cuda:0: the caller never chose a device, and
            # every rank of the node would compute on the first GPU
            torch.cuda.set_device(local_rank)
        return torch.device("cuda", torch.cuda.current_device())
    if "xccl" in backend and hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu", torch.xpu.current_device())
    return torch.device("cpu")


def _build_family(groups: list[tuple[int, ...]], rank: int) -> dist.ProcessGroup | None:
    """Create every group of one family (all ranks, same order); return ``rank``'s group."""
    mine = None
    for members in groups:
        if len(members) < 2:
            continue
        pg = dist.new_group(list(members))
        if rank in members:
            mine = pg
    return mine


def _build_ring(groups: list[tuple[int, ...]], rank: int, ring_of) -> RingLink | None:
    members = ring_of(rank)
    if len(members) < 2:
        return None
    kv_group = _build_family(groups, rank)
    pos = members.index(rank)
    return RingLink(
        kv_group=kv_group,
        send_to=members[(pos + 1) % len(members)],
        recv_from=members[(pos - 1) % len(members)],
        size=len(members),
    )


def _open_p2p_groups(groups: Iterable[dist.ProcessGroup | None], device: torch.device) -> None:
    """One tiny collective on each point-to-point group under NCCL: PyTorch requires a group's
    first ``batch_isend_irecv`` to involve all its ranks, and trimmed ring routes
    (:mod:`loongtrain.attention.routes`) post transfers on some ranks only."""
    if "nccl" not in str(dist.get_backend()).lower():
        return
    token = torch.zeros(1, device=device)
    for group in groups:
        if group is not None:
            dist.all_reduce(token, group=group)


def zero_mesh_ranks(world: int, dp: int, scope: str) -> tuple[torch.Tensor, tuple[str, ...]]:
    """The rank tensor and dim names of ``scope``'s ZeRO mesh (:func:`zero_mesh_grid` as a tensor)."""
    grid, names = zero_mesh_grid(world, dp, scope)
    ranks = torch.tensor(grid)
    return (ranks.flatten() if len(names) == 1 else ranks), names


def _build_zero_meshes(layout: RankLayout, device: torch.device, scopes: Iterable[str]) -> Mapping[str, DeviceMesh]:
    meshes = {}
    for scope in dict.fromkeys(scopes):  # every rank builds them in the same order
        ranks, names = zero_mesh_ranks(layout.world_size, layout.dp, scope)
        meshes[scope] = DeviceMesh(device.type, ranks, mesh_dim_names=names)
    return types.MappingProxyType(meshes)


def init_parallel(
    config: ParallelConfig,
    *,
    device: torch.device | str | None = None,
    verify_inputs: bool = True,
    zero_scopes: Iterable[str] = ZERO_SCOPES,
) -> ParallelState:
    """Build every process group of ``config`` once and return this rank's state.

    Call after ``torch.distributed.init_process_group`` on every rank, in the same order.
    ``device`` defaults to the backend's device (cuda for NCCL, cpu for gloo).
    ``verify_inputs`` makes the attention check, with one tiny all-gather per call, that
    every rank of the sp group passes the same shapes: a mismatch then raises a clear
    error on every rank instead of crashing inside a transfer. Turn it off once the
    shapes are known good to save that collective. ``zero_scopes`` are the ZeRO scopes
    whose DeviceMesh is built (``parallelize`` can use only those); ``()`` builds none.
    """
    check_torch()
    zero_scopes = tuple(zero_scopes)
    for scope in zero_scopes:
        check_zero_scope(scope)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "loongtrain.init_parallel: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group(backend=...) on every rank first "
            "(world size 1 works too)"
        )
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    layout = RankLayout.build(config, world_size)
    # Family order is fixed so that every rank calls new_group in the same sequence.
    sp_group = _build_family(layout.all_sp_groups(), rank)
    dp_group = _build_family(layout.all_dp_groups(), rank)
    head_group = _build_family(layout.all_head_groups(), rank)
    context_group = _build_family(layout.all_context_groups(), rank)
    inner = _build_ring(layout.all_inner_rings(), rank, layout.inner_ring)
    outer = _build_ring(layout.all_outer_rings(), rank, layout.outer_ring)
    dkv_group = _build_family(layout.all_context_groups(), rank)
    device = torch.device(device) if device is not None else default_device()
    _open_p2p_groups([link.kv_group for link in (inner, outer) if link is not None] + [dkv_group], device)
    return ParallelState(
        config=config,
        layout=layout,
        rank=rank,
        coords=layout.coords(rank),
        device=device,
        sp_group=sp_group,
        dp_group=dp_group,
        head_group=head_group,
        context_group=context_group,
        inner_ring=inner,
        outer_ring=outer,
        dkv_group=dkv_group,
        verify_inputs=verify_inputs,
        zero_meshes=_build_zero_meshes(layout, device, zero_scopes),
        _world_group=dist.group.WORLD,
    )
