"""The activation-checkpoint policy that fills a device: of no checkpointing, and ``sc++`` or
``full`` on the first ``k`` layers, the one that recomputes the least while its predicted peak
(:func:`~loongtrain.planner.memory.memory_bytes`) fits a budget. Pure.

Memory falls and recompute grows with ``k``, so for each mode the fewest layers that fit is
its best; the modes are then compared by the FLOPs their recompute adds (``sc++``: a layer's
matmuls; ``full``: also its attention forward).
Checkpointed layers are the first ones (:func:`~loongtrain.apply.checkpointed_layers` says why).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from loongtrain.options import AUTO_CHECKPOINT, MemoryOptions, checkpoint_label, checkpointed_count
from loongtrain.parallel.config import ParallelConfig
from loongtrain.planner.cost import Candidate, Workload, linear_flops_fwd, model_flops_per_microbatch, ring_step_flops
from loongtrain.planner.memory import memory_bytes
from loongtrain.planner.specs import PlanError

GiB = 2**30
#: the modes the policy chooses among, least memory last
RECOMPUTE_MODES = ("sc++", "full")


@dataclass(frozen=True)
class CheckpointPolicy:
    """The chosen checkpointing: ``candidate`` carries it in its memory options."""

    candidate: Candidate
    n_layers: int
    peak_bytes: float  # predicted device peak
    budget_bytes: float
    recompute_flops: float  # per micro-batch and rank
    step_flops: float  # the step's model FLOPs per micro-batch and rank (forward and backward)
    fits: bool

    @property
    def mode(self) -> str:
        return self.candidate.memory.activation_checkpoint

    @property
    def layers(self) -> int:
        """How many layers are checkpointed (0: none)."""
        return checkpointed_count(self.candidate.memory, self.n_layers)

    def describe(self) -> str:
        """One line: ``sc++ on the first 6 of 16 layers (predicted peak 60.1 GiB of 126.0 GiB; ...)``."""
        if self.layers == 0:
            what = "no activation checkpointing"
        elif self.layers == self.n_layers:
            what = f"{self.mode} on every layer"
        else:
            what = checkpoint_label(self.candidate.memory, self.n_layers)
        share = self.recompute_flops / self.step_flops if self.step_flops else 0.0
        fits = "" if self.fits else "; does NOT fit: the leanest policy"
        return (
            f"{what} (predicted peak {_size(self.peak_bytes)} of a {_size(self.budget_bytes)} budget; "
            f"recompute {share:.1%} of the step's FLOPs{fits})"
        )


def _size(nbytes: float) -> str:
    """``121.4 GiB``, or under a GiB ``2.4 MiB``."""
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.1f} MiB"


def recompute_flops(w: Workload, candidate: Candidate) -> float:
    """FLOPs one rank's recompute adds per micro-batch: each checkpointed layer's matmuls, and
    under ``full`` its attention forward (``cp`` causal ring steps)."""
    p = candidate.parallel
    layer = linear_flops_fwd(w, p.sp)
    if candidate.checkpoint == "full":
        layer += p.cp * ring_step_flops(w, p.hp, p.cp)
    return checkpointed_count(candidate.memory, w.model.n_layers) * layer


def policy_options(layout: Candidate, n_layers: int) -> list[Candidate]:
    """``layout`` without checkpointing, then with each mode on the first 1..n_layers layers
    (``activation_checkpoint_layers = 0`` for all of them)."""
    every = dict(activation_checkpoint_every=1, activation_checkpoint_span=1)
    out = []
    if not layout.memory.offload_activations:  # offload moves what checkpointing keeps: it needs some
        out.append(layout.with_(**every, activation_checkpoint="none", activation_checkpoint_layers=0))
    for mode in RECOMPUTE_MODES:
        for k in range(1, n_layers + 1):
            out.append(layout.with_(**every, activation_checkpoint=mode, activation_checkpoint_layers=k % n_layers))
    return out


def choose_checkpoint_policy(w: Workload, layout: Candidate, budget_bytes: float, gpu: bool = True) -> CheckpointPolicy:
    """The checkpointing of ``layout`` (its other memory options kept) that fits ``budget_bytes``
    and recomputes the least; where none fits, the leanest, marked ``fits=False``. ``gpu``: the
    GPU kernels' workspace is priced."""
    if not budget_bytes > 0:
        raise PlanError(f"choose_checkpoint_policy: budget_bytes={budget_bytes} must be positive")
    n_layers = w.model.n_layers
    priced = [(option, memory_bytes(w, option, gpu=gpu).total) for option in policy_options(layout, n_layers)]
    fitting = [(option, peak) for option, peak in priced if peak <= budget_bytes]
    fits = bool(fitting)
    if fits:
        option, peak = min(fitting, key=lambda x: (recompute_flops(w, x[0]), x[1]))
    else:
        option, peak = min(priced, key=lambda x: x[1])
    step = model_flops_per_microbatch(w, option)
    return CheckpointPolicy(option, n_layers, peak, budget_bytes, recompute_flops(w, option), step, fits)


def auto_policy(
    w: Workload, parallel: ParallelConfig, zero: str, memory: MemoryOptions, budget_bytes: float, gpu: bool = True
) -> CheckpointPolicy:
    """:func:`choose_checkpoint_policy` for ``memory`` with ``activation_checkpoint = 'auto'``
    (its other options kept): what the trainer resolves ``auto`` to."""
    if memory.activation_checkpoint != AUTO_CHECKPOINT:
        raise PlanError(f"auto_policy: memory.activation_checkpoint is {memory.activation_checkpoint!r}, not 'auto'")
    base = replace(memory, activation_checkpoint="sc++", device_memory_gib=0.0)  # each option replaces the mode
    return choose_checkpoint_policy(w, Candidate(parallel, zero, base), budget_bytes, gpu)
