"""``loongtrain bench memory``: peak memory per rank of a training step on CPU processes,
by sequence-parallel degree, activation checkpoint mode and ZeRO scope.

Per rank it reports the model states (parameters, gradients and AdamW moments of the
local shards, fp32, counted exactly) and the step peak: the process's peak resident
memory during forward+backward above what was resident before it (activations,
gradients, communication buffers). On CUDA the step peak is the allocator's peak above
what was allocated before the step. On CPU, resident memory tracks tensors closely because
large allocations are mmapped (``MALLOC_MMAP_THRESHOLD_``) and freed memory is trimmed
before measuring; the peak is reset through ``/proc/self/clear_refs`` (Linux).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from loongtrain.apply import MemoryOptions, materialize, parallelize
from loongtrain.harness import release_memory
from loongtrain.launch import launch
from loongtrain.model import build_model, model_config
from loongtrain.parallel import ParallelConfig, init_parallel
from loongtrain.train.metrics import current_memory_bytes, peak_memory_bytes, reset_peak_memory
from loongtrain.train.step import forward_backward

MiB = 2**20


def measure_step(layout: ParallelConfig, mode: str, zero: str, args: argparse.Namespace, device) -> dict:
    """One forward+backward of the scaled-up debug model; memory numbers of this rank."""
    state = init_parallel(layout, verify_inputs=False)
    mcfg = model_config(
        "debug",
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_dim=args.ffn_dim,
        vocab_size=args.vocab,
    )
    model = parallelize(build_model(mcfg), state, memory=MemoryOptions(activation_checkpoint=mode), zero=zero)
    materialize(model, device, seed=0)
    local_params = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(state.coords.dp)
    data = torch.randint(0, mcfg.vocab_size, (1, args.seq + 1), generator=gen).to(device)
    release_memory(device)
    before = current_memory_bytes(device)
    reset_peak_memory(device)
    forward_backward(model, state, [(data[:, :-1], data[:, 1:])])
    peak_bytes = peak_memory_bytes(device) - before
    del model
    release_memory(device)
    return {
        "states_mib": local_params * 4 * 4 / MiB,  # fp32 param + grad + 2 AdamW moments
        "step_peak_mib": peak_bytes / MiB,
        "tokens_per_rank": args.seq // layout.sp,
    }


def _configs(world: int) -> list[tuple[str, ParallelConfig, str, str]]:
    layouts = [("sp=1", ParallelConfig())]
    if world % 2 == 0:
        layouts.append(("sp=2 (cp=2)", ParallelConfig(cp=2)))
    if world % 4 == 0:
        layouts.append(("sp=4 (hp=2, cp=2)", ParallelConfig(hp=2, cp=2)))
    out = [(name, cfg, mode, "dp_sp") for name, cfg in layouts for mode in ("none", "full", "sc++")]
    if world % 4 == 0:
        out += [("sp=2 (cp=2)", ParallelConfig(cp=2), "full", scope) for scope in ("none", "dp", "sp")]
    return out


def _bench_rank(device: torch.device, args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        d = args.dim // args.heads
        attn_out = args.seq * args.heads * d * 4 / MiB
        print(
            f"memory per rank, {world} CPU processes: debug model scaled to dim={args.dim}, layers={args.layers}, "
            f"heads={args.heads}/{args.kv_heads}, ffn={args.ffn_dim}, vocab={args.vocab}; one sequence of "
            f"{args.seq} tokens per replica, fp32\n"
            f"(one attention output per layer = {attn_out:.1f} MiB / sp; states = params+grads+AdamW, fp32)"
        )
        print(f"{'layout':18s} {'ckpt':5s} {'zero':6s} {'tokens/rank':>11s} {'states MiB':>10s} {'step peak MiB':>13s}")
    for name, layout, mode, zero in _configs(world):
        r = measure_step(layout, mode, zero, args, device)
        values = torch.tensor([r["states_mib"], r["step_peak_mib"]], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(
                f"{name:18s} {mode:5s} {zero:6s} {r['tokens_per_rank']:11d} {values[0].item():10.1f} "
                f"{values[1].item():13.1f}",
                flush=True,
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence (one per replica)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn-dim", type=int, default=704)
    parser.add_argument("--vocab", type=int, default=1024)


def main(args: argparse.Namespace) -> None:
    # keep large tensors mmapped so freeing them returns memory (resident size tracks tensors)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    launch(_bench_rank, args.nproc, args)
