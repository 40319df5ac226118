"""The GPU check's distributed part, run on every rank of a process group (NCCL on GPUs,
gloo on CPU processes):

- 2D head-context attention under the standard layouts of the world (ring, double ring,
  Ulysses, 2D with both placements), causal and with packed documents plus a sliding
  window, forward and backward, against float64 attention of the unsharded tensors;
- training equivalence: a small model parallelised (2D + double ring where the world
  allows, Selective Checkpoint++, ZeRO over all ranks) against the unsharded model in
  the same process: loss and every gradient of the first step, parameters after AdamW.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import loongtrain as lt
from loongtrain.apply import MemoryOptions, materialize, parallelize
from loongtrain.model import ModelConfig, build_model
from loongtrain.parallel import ParallelConfig
from loongtrain.tools.gpucheck.kernels import float64_attention, relative_error, tolerance, visibility
from loongtrain.tools.harness import NamedLayout, make_inputs, standard_layouts
from loongtrain.train.step import forward_backward

MAX_LAYOUTS = 5
SEED = 3
# training in fp32: step-0 gradients agree to rounding (CPU bounds from the parallel
# training tests); CUDA's fp32 attention kernel may use TF32 (an assumption until measured)
TRAIN_TOLERANCE = {
    "cpu": {"loss": 2e-6, "grad": 2e-6, "param": 2e-5},
    "cuda": {"loss": 1e-4, "grad": 1e-3, "param": 1e-3},
}


@dataclass(frozen=True)
class DistSizes:
    """Sizes of the distributed checks (per rank, so the sequence grows with the world)."""

    tokens_per_rank: int
    heads: int
    kv_heads: int
    head_dim: int
    dtypes: tuple[str, ...]
    model: ModelConfig
    train_tokens_per_rank: int
    train_steps: int = 2


def check_layouts(world: int, heads: int, kv_heads: int) -> list[NamedLayout]:
    """The standard layouts of ``world`` ranks, at most :data:`MAX_LAYOUTS` of them."""
    return standard_layouts(world, heads, kv_heads)[:MAX_LAYOUTS]


def training_layout(world: int) -> ParallelConfig:
    """hp=2 when the world is even and >= 4, the rest a ring, double when cp >= 4 is even."""
    hp = 2 if world >= 4 and world % 2 == 0 else 1
    cp = world // hp
    return ParallelConfig(hp=hp, cp=cp, ring_window=2 if cp >= 4 and cp % 2 == 0 else 1)


def documents(seq: int) -> list[int]:
    """Uneven document boundaries of a packed sequence of ``seq`` tokens."""
    return [0, seq // 5 + 1, seq // 2 - 3, seq - seq // 8, seq]


def _max_over_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(values, t.tolist()))


def attention_errors(state, sizes: DistSizes, dtype: str, masked: bool, device: torch.device) -> dict[str, float]:
    """Norm-relative errors of out/dq/dk/dv (max over ranks) against float64 attention."""
    seq = sizes.tokens_per_rank * state.sp
    full = make_inputs(1, seq, sizes.heads, sizes.kv_heads, sizes.head_dim, getattr(torch, dtype), 7, device)
    cu, sliding_window = (documents(seq), seq // 3) if masked else (None, None)
    keep = visibility(seq, seq, True, sliding_window, cu_seqlens=cu, device=device)
    ref = float64_attention(*full, keep, sizes.head_dim**-0.5)
    layout = lt.sequence_layout(seq, state, cu)
    q, k, v, dout = (lt.shard_sequence(x, state, layout=layout) for x in full)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = lt.head_context_attention(q, k, v, state, causal=True, layout=layout, sliding_window=sliding_window)
    out.backward(dout)
    got = [lt.unshard_sequence(t, state, layout=layout) for t in (out, q.grad, k.grad, v.grad)]
    return _max_over_ranks(
        {name: relative_error(g, ref[name]) for name, g in zip(("out", "dq", "dk", "dv"), got)}, device
    )


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def training_errors(sizes: DistSizes, device: torch.device) -> tuple[ParallelConfig, dict[str, float]]:
    """Parallel training vs the unsharded model on this rank: relative errors (max over ranks)."""
    config = training_layout(dist.get_world_size())
    state = lt.init_parallel(config, zero_scopes=("dp_sp",))
    cfg = sizes.model
    ref = build_model(cfg)
    materialize(ref, device, SEED)
    par = parallelize(build_model(cfg), state, memory=MemoryOptions(activation_checkpoint="sc++"), zero="dp_sp")
    materialize(par, device, SEED)
    opt_ref, opt_par = (torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6) for m in (ref, par))
    seq = sizes.train_tokens_per_rank * state.sp
    gen = torch.Generator(device).manual_seed(SEED)
    errors = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(sizes.train_steps):
        data = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=gen, device=device)
        tokens, labels = data[:, :-1], data[:, 1:]
        logits = ref(tokens, torch.arange(seq, device=device))  # the unsharded reference: full logits
        ref_loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / labels.numel()
        ref_loss.backward()
        par_loss = forward_backward(par, state, [(tokens, labels)]).loss
        errors["loss"] = max(errors["loss"], abs(par_loss - ref_loss.item()) / abs(ref_loss.item()))
        if step == 0:
            ref_params = dict(ref.named_parameters())
            for name, p in par.named_parameters():
                errors["grad"] = max(errors["grad"], relative_error(_full(p.grad), ref_params[name].grad))
        for opt in (opt_ref, opt_par):
            opt.step()
            opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        errors["param"] = max(errors["param"], relative_error(_full(p.detach()), ref_params[name].detach()))
    return config, _max_over_ranks(errors, device)


def run_dist_checks(device: torch.device, sizes: DistSizes, out_path: str) -> None:
    """Every distributed check on this rank; rank 0 writes the rows as JSON to ``out_path``."""
    world = dist.get_world_size()
    backend = dist.get_backend()
    rows = []
    for layout in check_layouts(world, sizes.heads, sizes.kv_heads):
        state = lt.init_parallel(layout.config, zero_scopes=())
        for dtype in sizes.dtypes:
            tol, _ = tolerance(device.type, dtype)
            for masked in (False, True):
                errors = attention_errors(state, sizes, dtype, masked, device)
                kind = "causal documents+window" if masked else "causal"
                case = f"world {world} {backend} {layout.name} {dtype} {kind}"
                ok = max(errors.values()) <= tol
                rows.append(
                    {"case": case, "layout": layout.name, "dtype": dtype, "errors": errors, "tolerance": tol, "ok": ok}
                )
    config, errors = training_errors(sizes, device)
    tol = TRAIN_TOLERANCE[device.type]
    name = f"hp={config.hp} cp={config.cp} ring_window={config.ring_window}"
    rows.append(
        {
            "case": f"world {world} {backend} training {name} sc++ zero=dp_sp fp32 vs unsharded",
            "layout": name,
            "dtype": "float32",
            "errors": errors,
            "tolerance": tol,
            "ok": all(errors[k] <= tol[k] for k in tol),
        }
    )
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
