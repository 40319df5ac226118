"""``loongtrain bench memory``: each rank's peak *tensor* memory, measured by allocation
tracking on the real code, beside the planner's prediction; and the bytes per token that
the memory options save.

Measuring: on an accelerator, the allocator's peak (``max_memory_allocated``); on the CPU,
every allocation and free of torch's CPU allocator recorded by the profiler
(``profile_memory``) during the step, on top of the tensors alive when it starts (found by
a scan of live tensors). Process RSS is never used. Two things a CPU run cannot show and
this table says so: the activation offload's host copies are kept outside torch's
allocator (as pinned host memory is outside a GPU's), so they appear in the ``host``
column, not the device one; and offloaded model states are CPU tensors either way, so
their bytes (counted exactly from the shards) are subtracted from the device column of
the rows that offload them.

Parts:

1. **grid**: a small model on ``--nproc`` processes (hp=2 x cp=2, ring window 2), one
   training step (forward, backward, AdamW) after a warm-up step, for each memory option
   on/off and two sequence lengths: measured device peak vs the planner's prediction for
   the same configuration (fp32 here), and the relative error.
2. **headline**: a model with Llama-3's vocabulary (128256), dim 1024, 4 layers: peak bytes
   per token of sequence per rank (the slope between two lengths, so fixed costs drop
   out) for the old defaults (sc++, whole-shard loss), the new defaults (sc++, chunked
   loss) and every option on; a forward and backward each (optimizer states are fixed).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist

from loongtrain.apply import materialize, parallelize
from loongtrain.data.batch import Microbatch
from loongtrain.launch import launch
from loongtrain.model import build_model, model_config
from loongtrain.model.config import ModelConfig
from loongtrain.options import MemoryOptions
from loongtrain.parallel import ParallelConfig, init_parallel
from loongtrain.tools.bench.trace import PHASE, live_storages, quiet_stderr
from loongtrain.tools.harness import release_memory
from loongtrain.train.step import agree_and_count, shard_microbatch

MiB = 2**20

#: (name, options) of the grid; the loss chunk and tile are small enough to act at the grid's lengths
GRID_OPTIONS: list[tuple[str, dict]] = [
    ("none", dict(activation_checkpoint="none", loss_chunk=0)),
    ("full", dict(activation_checkpoint="full", loss_chunk=0)),
    ("sc++", dict(activation_checkpoint="sc++", loss_chunk=0)),
    ("sc++ +loss chunk", dict(activation_checkpoint="sc++", loss_chunk=128)),
    ("sc++ +mlp tile", dict(activation_checkpoint="sc++", loss_chunk=128, mlp_tile=128)),
    ("full +offload", dict(activation_checkpoint="full", loss_chunk=128, offload_activations=True)),
    ("sc++ +offload", dict(activation_checkpoint="sc++", loss_chunk=128, offload_activations=True)),
    ("all on", dict(activation_checkpoint="sc++", loss_chunk=128, mlp_tile=128, offload_activations=True,
                    offload_states=True)),
    ("none +head groups", dict(activation_checkpoint="none", loss_chunk=128, head_groups=4)),
    ("full +head groups", dict(activation_checkpoint="full", loss_chunk=128, mlp_tile=128, offload_activations=True,
                               head_groups=4)),
]  # fmt: skip

#: the headline's three configurations
HEADLINE_OPTIONS: list[tuple[str, dict]] = [
    ("before (sc++, whole-shard loss)", dict(activation_checkpoint="sc++", loss_chunk=0)),
    ("new defaults (sc++, loss chunk 1024)", dict(activation_checkpoint="sc++", loss_chunk=1024)),
    ("every option on", dict(activation_checkpoint="sc++", loss_chunk=1024, mlp_tile=256, offload_activations=True,
                             offload_states=True)),
]  # fmt: skip


# -- measuring --------------------------------------------------------------------------
def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every live tensor (the CPU's "allocated" figure)."""
    return sum(live_storages().values())


def _mark(name: str) -> None:
    with torch.profiler.record_function(f"{PHASE}{name}"):
        pass


def phase_hooks(model: torch.nn.Module, mark: Callable[[str], None]) -> list:
    """Hooks on ``model`` that call ``mark(phase)`` as a step enters each phase: the embedding,
    each layer's forward, the loss (after the last layer's forward), each layer's backward (its
    recompute included: a checkpoint's forward run again in backward marks nothing). Returns
    the handles."""
    in_backward = False
    last = len(model.layers) - 1

    def at(phase: str) -> None:
        nonlocal in_backward
        if phase == "embedding":  # a new step
            in_backward = False
        elif phase.startswith("backward"):
            in_backward = True
        elif in_backward:  # a recompute
            return
        mark(phase)

    hooks = [model.register_forward_pre_hook(lambda m, a: at("embedding"))]
    for i, layer in enumerate(model.layers):

        def start(m, args, i=i):
            at(f"forward {i}")

        def done(m, args, out, i=i):
            if out.requires_grad:
                out.register_hook(lambda g, i=i: at(f"backward {i}"))
            if i == last:
                at("loss")

        hooks += [layer.register_forward_pre_hook(start), layer.register_forward_hook(done)]
    return hooks


class TensorPeak:
    """``with TensorPeak(device, model) as peak: ...`` then ``peak.bytes``: the most tensor
    bytes allocated at once during the block (allocation tracking, see the module docstring),
    and on the CPU ``peak.phases``: the peak of each phase of the step (the embedding, each
    layer's forward, the loss, each layer's backward), marked by hooks on ``model``."""

    def __init__(self, device: torch.device, model: torch.nn.Module | None = None) -> None:
        self.device, self.model = device, model
        self.bytes = 0
        self.phases: dict[str, int] = {}
        self._hooks: list = []

    def __enter__(self) -> TensorPeak:
        gc.collect()
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
            torch.accelerator.reset_peak_memory_stats(self.device)
            return self
        if self.model is not None:
            self._hooks = phase_hooks(self.model, _mark)
        self.base = live_tensor_bytes()
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        with quiet_stderr():
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
            self.bytes = torch.accelerator.max_memory_allocated(self.device)
            return
        with quiet_stderr():
            self._prof.__exit__(*exc)
        events = [e for e in self._prof.profiler.kineto_results.events() if e.name() == "[memory]"
                  or e.name().startswith(PHASE)]  # fmt: skip
        running = peak = 0
        phase = "start"
        for e in sorted(events, key=lambda e: e.start_ns()):
            if e.name().startswith(PHASE):
                phase = e.name()[len(PHASE) :]
                self.phases[phase] = max(self.phases.get(phase, 0), self.base + running)
                continue
            if e.device_type() == torch.profiler.DeviceType.CPU:
                running += e.nbytes()
                peak = max(peak, running)
                self.phases[phase] = max(self.phases.get(phase, 0), self.base + running)
        self.bytes = self.base + peak


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Exact bytes of this rank's parameter and gradient shards and optimizer states."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            total += g.numel() * g.element_size()
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    local = v.to_local() if hasattr(v, "to_local") else v
                    total += local.numel() * local.element_size()
    return total


def _batch(seq: int, vocab: int, seed: int) -> Microbatch:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (1, seq + 1), generator=gen)
    return Microbatch(data[:, :-1], data[:, 1:])


def measure(
    mcfg: ModelConfig,
    state,
    options: MemoryOptions,
    seq: int,
    device: torch.device,
    train_step: bool,
    zero: str = "dp_sp",
    param_dtype: torch.dtype | None = None,
) -> dict:
    """One forward+backward (and, with ``train_step``, an AdamW step after a warm-up step) of
    ``mcfg`` on this rank; its peak tensor bytes (whole step and per phase), host-store bytes
    and state bytes. The model is freed before this returns."""
    result = _measure(mcfg, state, options, seq, device, train_step, zero, param_dtype)
    release_memory(device)
    return result


def _forward_backward(model: torch.nn.Module, batch: Microbatch, state) -> int:
    """One forward and backward of ``batch`` on this rank's shard; returns the bytes the
    activation offload held on the host between the two."""
    shard = shard_microbatch(batch, state)
    total = agree_and_count([batch], [shard], state)
    loss, _ = model(shard.tokens, shard.positions, shard.layout, labels=shard.labels)
    host = model.activation_offload.host_bytes() if model.activation_offload is not None else 0
    (loss / total).backward()
    return host


def _measure(mcfg, state, options: MemoryOptions, seq: int, device, train: bool, zero: str, param_dtype) -> dict:
    model = parallelize(build_model(mcfg), state, memory=options, zero=zero, param_dtype=param_dtype)
    materialize(model, device, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if train else None
    batch = _batch(seq, mcfg.vocab_size, seed=state.coords.dp).to(device)

    def step() -> int:
        host = _forward_backward(model, batch, state)
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return host

    if train:
        step()  # warm-up: optimizer states exist, lazy initialisation done
    release_memory(device)
    resident = state_bytes(model, optimizer)  # parameters and moments (no gradients between steps)
    with TensorPeak(device, model) as peak:
        host = step()
    states = state_bytes(model, optimizer)
    host_bytes = host + (states if options.offload_states else 0)
    if not (options.offload_states and device.type == "cpu"):
        return {"device": peak.bytes, "host": host_bytes, "states": states, "phases": peak.phases}
    # offloaded states share the CPU's allocator with the compute tensors: left out of each phase's
    # peak, the gradients only from the backward on (before it they do not exist yet)
    phases = {
        name: value - (resident if name in ("start", "embedding", "loss") or name.startswith("forward") else states)
        for name, value in peak.phases.items()
    }
    return {"device": max(phases.values()), "host": host_bytes, "states": states, "phases": phases}


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# -- the planner's side -------------------------------------------------------------------
def predicted_bytes(mcfg: ModelConfig, seq: int, config: ParallelConfig, options: MemoryOptions, train: bool) -> float:
    """The planner's device peak for the same step (fp32 compute, one sequence per replica)."""
    from loongtrain.planner.cost import Candidate
    from loongtrain.planner.memory import predict_peak_memory

    candidate = Candidate(parallel=config, zero="dp_sp", memory=options)
    # fp32 compute: never the flash kernel whose backward workspace gpu=True prices
    return predict_peak_memory(mcfg, seq, 1, 4, candidate, optimizer=train, gpu=False).total


# -- the two parts ----------------------------------------------------------------------
def _state():
    """hp=2 x cp=2 with ring window 2 on 4 ranks (a plain ring of the world otherwise)."""
    world = dist.get_world_size()
    config = ParallelConfig(hp=2, cp=2, ring_window=2) if world % 4 == 0 else ParallelConfig(cp=world)
    return init_parallel(config, verify_inputs=False)


def _grid(device: torch.device, args: argparse.Namespace, rows: list) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    state = _state()
    config = state.config
    mcfg = model_config("debug", vocab_size=args.grid_vocab, dim=256, n_layers=4, n_heads=8, n_kv_heads=4,
                        ffn_dim=704)  # fmt: skip
    if rank == 0:
        print(f"[1] grid: dim 256, 4 layers, vocab {args.grid_vocab}, fp32, {world} processes "
              f"(hp={config.hp} cp={config.cp} ring_window={config.ring_window}); one AdamW step after a warm-up; "
              "MiB per rank (max over ranks)")  # fmt: skip
        print(f"{'options':18s} {'S':>6s} {'device':>9s} {'predicted':>9s} {'error':>7s} {'host':>8s}")
    for name, opts in GRID_OPTIONS:
        options = MemoryOptions(**opts)
        for seq in args.grid_seqs:
            r = measure(mcfg, state, options, seq, device, train_step=True)
            device_b, host_b = _max_over_ranks([r["device"], r["host"]], device)
            predicted = predicted_bytes(mcfg, seq, replace(state.config, dp=state.dp), options, train=True)
            error = (predicted - device_b) / device_b
            if rank == 0:
                print(f"{name:18s} {seq:6d} {device_b / MiB:9.1f} {predicted / MiB:9.1f} {error:7.1%} "
                      f"{host_b / MiB:8.1f}", flush=True)  # fmt: skip
                rows.append({"part": "grid", "options": name, "seq": seq, "device": device_b,
                             "predicted": predicted, "host": host_b, "error": error})  # fmt: skip
    if rank == 0:
        errors = sorted(abs(r["error"]) for r in rows if r["part"] == "grid")
        print(f"|predicted - measured| / measured: median {statistics.median(errors):.1%}, worst {errors[-1]:.1%}")


def _per_token(short: dict, long: dict, tokens: int) -> tuple[float, str]:
    """Bytes per token of the worst phase: the largest growth of a phase's peak between the
    two lengths, over the tokens added (fixed costs, the same at both lengths, drop out)."""
    slopes = {name: (long["phases"][name] - short["phases"][name]) / tokens for name in short["phases"]}
    worst = max(slopes, key=slopes.get)
    return slopes[worst], worst


def _headline(device: torch.device, args: argparse.Namespace, rows: list) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    state = _state()
    mcfg = model_config("debug", vocab_size=args.headline_vocab, dim=1024, n_layers=4, n_heads=16, n_kv_heads=8,
                        ffn_dim=3584)  # fmt: skip
    short, long = args.headline_seqs
    if rank == 0:
        print(f"\n[2] bytes per token of sequence per rank: vocabulary {mcfg.vocab_size}, dim 1024, 4 layers, fp32, "
              f"{world} processes, forward+backward at S={short} and S={long}: per phase of the step (each "
              f"layer's forward and backward, the loss), the growth of its peak over the {long - short} tokens "
              "added; the worst phase's (fixed costs, the same at both lengths, drop out)")  # fmt: skip
        print(f"{'options':40s} {'peak S1 MiB':>11s} {'peak S2 MiB':>11s} {'bytes/token':>11s} {'vs before':>9s} "
              "worst phase")  # fmt: skip
    base = None
    for name, opts in HEADLINE_OPTIONS:
        options = MemoryOptions(**opts)
        runs = [measure(mcfg, state, options, s, device, False) for s in (short, long)]
        slope, phase = _per_token(runs[0], runs[1], long - short)
        slope, peak1, peak2 = _max_over_ranks([slope, runs[0]["device"], runs[1]["device"]], device)
        base = base or slope
        if rank == 0:
            print(f"{name:40s} {peak1 / MiB:11.1f} {peak2 / MiB:11.1f} {slope:11.0f} {base / slope:8.1f}x {phase}",
                  flush=True)  # fmt: skip
            rows.append({"part": "headline", "options": name, "peaks": [peak1, peak2], "seqs": [short, long],
                         "bytes_per_token": slope, "worst_phase": phase, "reduction": base / slope})  # fmt: skip


#: the trace's memory options: the long-sequence ones the one-device plans choose
TRACE_OPTIONS = dict(activation_checkpoint="full", loss_chunk=1024, mlp_tile=2048, offload_activations=True)


def _trace(device: torch.device, args: argparse.Namespace, rows: list) -> None:
    """What the allocator holds at the peak of one bf16 forward+backward (hp = cp = 1, the
    long-sequence options), every byte by the line of code that made it, beside the planner's
    terms."""
    from loongtrain.planner.cost import Candidate
    from loongtrain.planner.memory import predict_peak_memory
    from loongtrain.tools.bench.trace import AllocatorPeak, by_line

    rank, world = dist.get_rank(), dist.get_world_size()
    state = init_parallel(ParallelConfig(dp=world), verify_inputs=False)
    # the model of the planner-memory test's tracked peaks (tests/test_planner_memory.py)
    mcfg = model_config("debug", vocab_size=1024, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=704)
    options, seq = MemoryOptions(**TRACE_OPTIONS), args.trace_seq
    model = parallelize(build_model(mcfg), state, memory=options, param_dtype=torch.bfloat16)
    materialize(model, device, seed=0)
    batch = _batch(seq, mcfg.vocab_size, seed=state.coords.dp).to(device)
    tokens = batch.tokens.numel() // state.sp
    hooks = phase_hooks(model, _mark)
    with AllocatorPeak(device, within=args.trace_phase) as top:
        _forward_backward(model, batch, state)
    for hook in hooks:
        hook.remove()
    del model
    release_memory(device)
    candidate = Candidate.of(dp=world, zero="dp_sp", **TRACE_OPTIONS)
    predicted = predict_peak_memory(mcfg, seq, 1, 2, candidate, optimizer=False, gpu=False)
    if rank != 0:
        return
    print(f"\n[3] trace: what the allocator holds at the peak of one bf16 forward+backward, vocabulary "
          f"{mcfg.vocab_size}, dim 256, 4 layers, S={seq} on {world} process(es) (hp=1 cp=1), "
          f"{', '.join(f'{k}={v}' for k, v in TRACE_OPTIONS.items())}; every allocation made during the "
          f"step and held then, by the line that made it (bytes per token of the rank's {tokens}); on this CPU "
          f"the offload's host copies are in the same allocator")  # fmt: skip
    print(f"the allocator's peak during the step: {top.bytes / MiB:.1f} MiB above its start, in '{top.phase}', "
          f"reached by {top.op or '?'} at {top.where or '?'}; the planner's peak phase '{predicted.phase}', "
          "its terms in bytes per token: "
          + ", ".join(f"{k} {v / tokens:.0f}" for k, v in predicted.terms if v / tokens >= 1))  # fmt: skip
    if not top.python_frames:
        print("(this platform's profiler recorded no Python calls: lines are '?', backward ops named by their node)")
    print(f"{'bytes/token':>11s} {'count':>5s}  {'op':40s} made at")
    for where, op, count, nbytes in by_line(top.held):
        if nbytes / tokens >= 1:
            print(f"{nbytes / tokens:11.0f} {count:5d}  {op:40s} {where}")
        rows.append({"part": "trace", "where": where, "op": op, "count": count, "bytes": nbytes, "tokens": tokens})
    small = sum(b for *_, b in by_line(top.held) if b / tokens < 1)
    print(f"{small / tokens:11.2f}        (lines under 1 byte per token, together)")
    held = sum(h.nbytes for h in top.held)
    print(f"{held / tokens:11.0f}        total = the peak ({top.bytes / tokens:.0f})")


def _bench_rank(device: torch.device, args: argparse.Namespace) -> None:
    rows: list = []
    if "grid" in args.parts:
        _grid(device, args, rows)
    if "headline" in args.parts:
        _headline(device, args, rows)
    if "trace" in args.parts:
        _trace(device, args, rows)
    if dist.get_rank() == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def _lengths(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--parts", nargs="+", default=["grid", "headline"], choices=["grid", "headline", "trace"],
                        help="grid, headline (the default: both); trace: what is alive at a bf16 peak")  # fmt: skip
    parser.add_argument("--trace-seq", type=int, default=16384, help="the trace's sequence length (16384)")
    parser.add_argument("--trace-phase", default=None,
                        help="the trace at one phase's peak: embedding, 'forward N', loss, 'backward N'")  # fmt: skip
    parser.add_argument("--grid-seqs", type=_lengths, default=[2048, 4096], help="grid sequence lengths (2048,4096)")
    parser.add_argument("--grid-vocab", type=int, default=8192, help="grid vocabulary (8192)")
    parser.add_argument("--headline-seqs", type=_lengths, default=[4096, 8192], help="the two lengths (4096,8192)")
    parser.add_argument("--headline-vocab", type=int, default=128256, help="headline vocabulary (Llama-3's 128256)")
    parser.add_argument("--json", default=None, help="also write the rows to this file")


def main(args: argparse.Namespace) -> None:
    if len(args.headline_seqs) != 2 or args.headline_seqs[0] >= args.headline_seqs[1]:
        raise SystemExit("loongtrain bench memory: --headline-seqs takes two increasing lengths, e.g. 1024,2048")
    phases = ["start", "embedding", "loss"] + [f"{kind} {i}" for kind in ("forward", "backward") for i in range(4)]
    if args.trace_phase is not None and args.trace_phase not in phases:
        raise SystemExit(f"loongtrain bench memory: --trace-phase {args.trace_phase!r} is no phase of the trace's "
                         f"step; one of {', '.join(phases)}")  # fmt: skip
    if "trace" in args.parts and (args.trace_seq < 2 or args.trace_seq % 2):
        raise SystemExit(f"loongtrain bench memory: --trace-seq {args.trace_seq} must be a positive even length "
                         "(one sequence of hp=1 x cp=1 cut into two zigzag chunks), e.g. 16384")  # fmt: skip
    launch(_bench_rank, args.nproc, args)
