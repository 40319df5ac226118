"""Check that the groups a plan describes are the groups ``init_parallel`` builds, at any
scale, on PyTorch's fake process-group backend (one process plays one rank of N)."""

from __future__ import annotations

import torch.distributed as dist

from loongtrain.parallel.layout import RankLayout
from loongtrain.parallel.state import init_parallel
from loongtrain.planner.cost import Candidate
from loongtrain.planner.topology import Topology, analyze


def _ranks(group) -> tuple[int, ...] | None:
    return None if group is None else tuple(dist.get_process_group_ranks(group))


def _sample_ranks(world: int) -> list[int]:
    return sorted({0, world // 3, world // 2 + 1, world - 1} & set(range(world)))


def check_groups(layout: Candidate, devices_per_node: int, ranks: list[int] | None = None) -> list[str]:
    """Build ``layout``'s groups as ``ranks`` (default: four spread ranks) and compare them with
    ``RankLayout`` and with the planner's node-locality claims; raise ``AssertionError`` on a mismatch."""
    if dist.is_initialized():
        raise RuntimeError("check_groups needs a process without an initialised default process group")
    config = layout.parallel
    world = layout.devices
    ref = RankLayout.build(config, world)
    topo: Topology = analyze(config, devices_per_node)
    lines = []
    for rank in ranks if ranks is not None else _sample_ranks(world):
        dist.init_process_group("fake", rank=rank, world_size=world)
        try:
            state = init_parallel(config)
            expect = {
                "head": ref.head_group(rank),
                "context": tuple(sorted(ref.context_group(rank))),
                "dp": ref.dp_group(rank),
            }
            got = {
                "head": _ranks(state.head_group),
                "context": _ranks(state.context_group),
                "dp": _ranks(state.dp_group),
            }
            for name, members in expect.items():
                want = members if len(members) > 1 else None
                assert got[name] == want, f"rank {rank}: {name} group {got[name]} != layout {want}"
            node = rank // devices_per_node
            head = got["head"] or (rank,)
            head_nodes = sorted({r // devices_per_node for r in head})
            off_peers = sum(1 for r in head if r // devices_per_node != node)
            assert off_peers <= topo.head.off_peers, (
                f"rank {rank}: {off_peers} head peers on other nodes, the plan says at most {topo.head.off_peers}"
            )
            hops = []
            for link, members, traffic in (
                (state.inner_ring, ref.inner_ring(rank), topo.inner),
                (state.outer_ring, ref.outer_ring(rank), topo.outer),
            ):
                if len(members) < 2:
                    assert link is None, f"rank {rank}: a ring of one member has a process group"
                    continue
                pos = members.index(rank)
                assert (link.send_to, link.recv_from) == (members[(pos + 1) % len(members)], members[pos - 1])
                assert _ranks(link.kv_group) == tuple(sorted(members))
                off = link.send_to // devices_per_node != node
                assert traffic.crosses or not off, f"rank {rank}: a ring hop leaves the node but the plan says not"
                hops.append(f"-> {link.send_to} ({'other node' if off else 'same node'})")
            shown = ", ".join(map(str, head if len(head) <= 4 else head[:3])) + (", ..." if len(head) > 4 else "")
            lines.append(
                f"rank {rank} (node {node}): head group [{shown}] ({len(head)} ranks on {len(head_nodes)} node(s)); "
                f"ring hops {' '.join(hops) or 'none'}"
            )
        finally:
            dist.destroy_process_group()
    return lines
