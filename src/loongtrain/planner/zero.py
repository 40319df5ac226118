"""Hybrid-ZeRO communication time by scope (FSDP2 as ``parallelize.zero`` applies it). Pure.

Groups come from :func:`loongtrain.parallel.zero_grid.zero_mesh_grid`, the grid ``init_parallel``
builds its meshes from.

Per micro-batch, each layer's parameters are all-gathered (bf16) in forward and again in
backward (``reshard_after_forward=True``), its gradients reduce-scattered (fp32) over
the shard group and all-reduced over the replicate group. Scope ``none`` only
all-reduces gradients over every rank. Collectives are ring algorithms: an all-gather
or reduce-scatter of ``M`` bytes over ``n`` ranks moves ``(n-1)/n * M`` per rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from loongtrain.model.config import ModelConfig
from loongtrain.parallel.zero_grid import zero_mesh_grid
from loongtrain.planner.cost import Candidate
from loongtrain.planner.specs import ClusterSpec
from loongtrain.planner.topology import group_span


def shard_degree(candidate: Candidate) -> int:
    """Ranks one copy of the model states is sharded over, by ZeRO scope."""
    return _shard_degree(candidate.devices, candidate.parallel.dp, candidate.zero)


@functools.lru_cache(maxsize=1024)
def _shard_degree(devices: int, dp: int, zero: str) -> int:
    grid, _ = zero_mesh_grid(devices, dp, zero)
    return len(grid[0])


GroupShape = tuple[int, int, int]  # (members, nodes spanned, members on the fullest node)


def group_shape(members: tuple[int, ...], devices_per_node: int) -> GroupShape:
    """(members, nodes spanned, members on the fullest node) of a group of global ranks."""
    return (len(members), *group_span(members, devices_per_node))


@functools.lru_cache(maxsize=1024)
def _groups(dp: int, hp: int, cp: int, zero: str, devices_per_node: int) -> tuple[GroupShape, GroupShape]:
    """Shapes of rank 0's (shard group, replicate group) in the mesh ``init_parallel`` builds."""
    grid, _ = zero_mesh_grid(dp * hp * cp, dp, zero)  # [replicate][shard]
    shard, replicate = grid[0], tuple(row[0] for row in grid)
    return group_shape(shard, devices_per_node), group_shape(replicate, devices_per_node)


def collective_seconds(c: ClusterSpec, group: GroupShape, nbytes: float, kind: str) -> float:
    """Ring all-gather / reduce-scatter (``kind="ag"``/``"rs"``) or all-reduce (``"ar"``) of
    ``nbytes`` (the full buffer) over a group of shape ``group``, every such group at once."""
    n, nodes, per_node = group
    if n < 2 or nbytes <= 0:
        return 0.0
    if nodes == 1:
        bw, latency = c.intra_bw_gbs, c.intra_latency_us
    else:
        groups_sharing_nics = max(1, c.devices_per_node // per_node)
        bw = min(c.intra_bw_gbs, c.nic_bw_gbs * c.nics_per_node / groups_sharing_nics)
        latency = c.inter_latency_us
    one = (n - 1) / n * nbytes / (bw * 1e9) + (n - 1) * latency * 1e-6
    return 2 * one if kind == "ar" else one


@dataclass(frozen=True)
class ZeroTimes:
    """Per micro-batch and layer: gather (one pass) and gradient reduction; the root
    (embeddings, output layer, final norm) once."""

    gather_layer: float
    reduce_layer: float
    gather_root: float
    reduce_root: float


def zero_seconds(
    c: ClusterSpec, m: ModelConfig, candidate: Candidate, dtype_bytes: int = 2, float8_all_gather: bool = False
) -> ZeroTimes:
    """Collective times of ``candidate.zero`` for one layer and for the root parameters
    (``float8_all_gather``: a layer's linear weights gathered in one byte each)."""
    p = candidate.parallel
    return _zero_seconds(c, m, p.dp, p.hp, p.cp, candidate.zero, dtype_bytes, float8_all_gather)


@functools.lru_cache(maxsize=4096)
def _zero_seconds(
    c: ClusterSpec, m: ModelConfig, dp: int, hp: int, cp: int, zero: str, dtype_bytes: int, float8_all_gather: bool
) -> ZeroTimes:
    shard, replicate = _groups(dp, hp, cp, zero, c.devices_per_node)
    p_layer = m.layer_params()
    p_root = m.num_params() - m.n_layers * p_layer
    fp8 = m.layer_matmul_params() if float8_all_gather else 0  # a layer's weights gathered in 1 byte

    def times(params: int, fp8: int = 0) -> tuple[float, float]:
        gather = collective_seconds(c, shard, (params - fp8) * dtype_bytes + fp8, "ag")
        reduce = collective_seconds(c, shard, params * 4, "rs")
        reduce += collective_seconds(c, replicate, params * 4 / shard[0], "ar")
        return gather, reduce

    g_layer, r_layer = times(p_layer, fp8)
    g_root, r_root = times(p_root)
    return ZeroTimes(g_layer, r_layer, g_root, r_root)


def exposed_zero_seconds(z: ZeroTimes, n_layers: int, layer_fwd: float, layer_bwd: float) -> float:
    """ZeRO time not hidden behind compute, per micro-batch: the first gather of forward
    and of backward and the last reductions are exposed; the others overlap the
    neighbouring layer's compute."""
    fwd = z.gather_root + z.gather_layer + (n_layers - 1) * max(0.0, z.gather_layer - layer_fwd)
    bwd = z.gather_layer + (n_layers - 1) * max(0.0, z.gather_layer + z.reduce_layer - layer_bwd)
    return fwd + bwd + z.reduce_layer + z.reduce_root
