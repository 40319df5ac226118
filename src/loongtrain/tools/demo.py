"""``loongtrain demo``: run 2D head-context attention on several processes under every
standard layout and show that it matches full attention, with timings."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from loongtrain.attention import unshard_sequence
from loongtrain.attention.kernels import block_backward, block_forward
from loongtrain.launch import launch
from loongtrain.parallel import init_parallel
from loongtrain.tools.harness import make_inputs, run_sharded_attention, standard_layouts

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _reference(full: tuple[torch.Tensor, ...], causal: bool) -> list[torch.Tensor]:
    """Full attention of the unsharded tensors in float64, one fused call."""
    q, k, v, dout = (x.double() for x in full)
    scale = q.shape[-1] ** -0.5
    out, lse = block_forward(q, k, v, causal=causal, scale=scale)
    return [out, *block_backward(dout, q, k, v, out, lse, causal=causal, scale=scale)]


def _max_rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def _demo_rank(device: torch.device, args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    full = make_inputs(args.batch, args.seq, args.heads, args.kv_heads, args.head_dim, dtype)
    layouts = standard_layouts(world, args.heads, args.kv_heads)
    causal = not args.no_causal
    if rank == 0:
        print(
            f"loongtrain demo: 2D head-context attention on {world} process(es), backend "
            f"{dist.get_backend()}, device {device.type}\n"
            f"q [{args.batch}, {args.seq}, {args.heads}, {args.head_dim}], k/v [{args.batch}, {args.seq}, "
            f"{args.kv_heads}, {args.head_dim}], {'causal' if causal else 'non-causal'}, {args.dtype}; "
            f"reference: float64 full attention of the unsharded tensors",
            flush=True,
        )
        ref = _reference(full, causal)
        print(f"{'layout':34s} {'hp':>3s} {'cp':>3s} {'w':>3s}  {'fwd ms':>8s} {'bwd ms':>8s}  max rel error")
    worst = 0.0
    for layout in layouts:
        state = init_parallel(layout.config, verify_inputs=False)
        run = run_sharded_attention(state, full, device, causal=causal, reps=args.reps)
        results = [unshard_sequence(t, state).cpu() for t in (run.out, run.dq, run.dk, run.dv)]
        if rank == 0:
            errors = [_max_rel(g, r) for g, r in zip(results, ref)]
            worst = max(worst, *errors)
            cfg = layout.config
            print(
                f"{layout.name:34s} {cfg.hp:3d} {cfg.cp:3d} {cfg.ring_window:3d}  {run.fwd_s * 1e3:8.1f} "
                f"{run.bwd_s * 1e3:8.1f}  "
                + "  ".join(f"{n}={e:.1e}" for n, e in zip(("out", "dq", "dk", "dv"), errors)),
                flush=True,
            )
    if rank == 0:
        tol = TOLERANCE[dtype]
        verdict = "match" if worst <= tol else "DO NOT match"
        print(
            f"All {len(layouts)} layouts {verdict} full attention "
            f"(worst max relative error {worst:.1e}, tolerance {tol:.0e})."
        )
        if worst > tol:
            raise SystemExit(1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=4, help="processes to spawn (ignored under torchrun)")
    parser.add_argument("--seq", type=int, default=4096, help="global sequence length")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8, help="query heads H")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads G (GQA when G < H)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--no-causal", action="store_true", help="full (non-causal) attention")
    parser.add_argument("--reps", type=int, default=1, help="timed repetitions after one warm-up")


def main(args: argparse.Namespace) -> None:
    launch(_demo_rank, args.nproc, args)
