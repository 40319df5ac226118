"""The trainer's guard: no step is applied on numbers that are not finite, loss spikes are
seen (and skipped or rolled back), ranks that should hold the same weights are compared.

Every decision is made from values the step already brings to the host, identically on every
rank: the loss (summed over ranks by the step's one all-reduce, one entry per microbatch) and
the gradient norm that clipping computes. The guard adds no host synchronisation and no
collective to a good step; the collectives below (:func:`first_nonfinite_gradient`,
:func:`check_replicas`) run only on the failure path or every ``guard.replica_check_every``
steps. Skipping selects nothing on the device: the optimizer's step is not called, so the
weights, the moments and its step count stay bit-equal (multiplying an update by 0 would not:
0 x NaN is NaN).

The options are :class:`~loongtrain.options.GuardOptions` (the ``[guard]`` keys).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from loongtrain.options import GuardOptions
from loongtrain.parallel.zero_grid import zero_mesh_grid

#: a spike must also exceed the mean by this fraction of it (a flat loss has a tiny deviation)
SPIKE_MIN_RISE = 0.02
#: elements hashed at a time by :func:`parameter_digest` (bounds its temporaries)
DIGEST_CHUNK = 1 << 22
#: an odd 64-bit multiplier (the golden ratio's): element i is weighted by (i * M) | 1, odd, so
#: any change of one element changes the digest
_DIGEST_MULTIPLIER = 0x9E3779B97F4A7C15 - (1 << 64)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class GuardStop(RuntimeError):
    """The guard ended the run (a non-finite step under ``guard.nonfinite=stop``, too many
    skips or rollbacks, replicas that disagree); the message names the step and what to do."""


# -- the decision (pure) -------------------------------------------------------------------


class SpikeDetector:
    """The recent applied steps' losses and the spike rule of :class:`GuardOptions`."""

    def __init__(self, window: int, sigma: float, min_history: int) -> None:
        self.sigma, self.min_history = sigma, min_history
        self.history: deque[tuple[int, float]] = deque(maxlen=window)  # (step, loss)

    def threshold(self) -> float | None:
        """The loss above which a step is a spike, or None while the history is too short."""
        if len(self.history) < self.min_history:
            return None
        losses = [loss for _, loss in self.history]
        mean = statistics.fmean(losses)
        return mean + max(self.sigma * statistics.pstdev(losses, mean), SPIKE_MIN_RISE * abs(mean))

    def add(self, step: int, loss: float) -> None:
        self.history.append((step, loss))

    def forget_after(self, step: int) -> None:
        """Drop the losses of steps after ``step`` (a rollback to ``step``)."""
        kept = [(s, loss) for s, loss in self.history if s <= step]
        self.history.clear()
        self.history.extend(kept)

    def state(self) -> list[list[float]]:
        """The history as ``[[step, loss], ...]`` (a checkpoint keeps it: a resumed run is judged
        from its first step)."""
        return [[step, loss] for step, loss in self.history]

    def load(self, history: list) -> None:
        self.history.clear()
        self.history.extend((int(step), float(loss)) for step, loss in history)

    def describe(self) -> str:
        losses = [loss for _, loss in self.history]
        mean = statistics.fmean(losses)
        return f"mean {mean:.4f} + {self.sigma:g} sd ({statistics.pstdev(losses, mean):.4f}) over {len(losses)} steps"


#: a loss within this many nats of ln(vocab_size) is the uniform distribution's (nothing learnt)
UNIFORM_LOSS_TOLERANCE = 1e-3


class StallDetector:
    """A run that stopped learning: ``steps`` applied steps in a row whose gradient norm is
    exactly 0 or whose loss is the uniform distribution's, ``uniform_loss`` = ln(vocab_size)
    (the loss is judged only after step ``loss_from``: the warm-up's first steps may sit
    there). :meth:`update` returns the step the stall began, once, when it is reached."""

    def __init__(self, steps: int, uniform_loss: float, loss_from: int = 0) -> None:
        self.steps, self.uniform_loss, self.loss_from = steps, uniform_loss, loss_from
        self.began: int | None = None  # the first step of the current run of stalled steps
        self.count = 0
        self.said = False  # the current stall was reported

    def stalled_step(self, step: int, loss: float, grad_norm: float) -> bool:
        """Whether step ``step`` (1-based) learnt nothing by the rule."""
        uniform = step > self.loss_from and abs(loss - self.uniform_loss) <= UNIFORM_LOSS_TOLERANCE
        return grad_norm == 0.0 or uniform

    def update(self, step: int, loss: float, grad_norm: float) -> int | None:
        if not self.stalled_step(step, loss, grad_norm):
            self.began, self.count, self.said = None, 0, False
            return None
        self.began = step if self.count == 0 else self.began
        self.count += 1
        if self.count >= self.steps and not self.said:
            self.said = True
            return self.began
        return None

    def state(self) -> dict:
        return {"began": self.began, "count": self.count, "said": self.said}

    def load(self, state: dict) -> None:
        self.began, self.count, self.said = state.get("began"), int(state.get("count", 0)), bool(state.get("said"))


@dataclass(frozen=True)
class Verdict:
    """What happens to one step: ``apply`` it, ``skip`` it, ``stop`` the job or ``rollback``."""

    action: str
    reason: str = ""  # "", "loss", "gradients" (non-finite), "spike", "skips" (too many in a row)
    threshold: float | None = None  # a spike's threshold

    @property
    def applied(self) -> bool:
        return self.action == "apply"


class StepGuard:
    """Judges each step from its loss and gradient norm (:meth:`judge`), then remembers what
    was applied (:meth:`record`). The same inputs give the same verdict on every rank."""

    def __init__(self, options: GuardOptions, uniform_loss: float = math.inf, loss_from: int = 0) -> None:
        self.options = options
        self.spikes = SpikeDetector(options.spike_window, options.spike_sigma, options.spike_min_history)
        self.stall = StallDetector(options.stalled_steps, uniform_loss, loss_from)
        self.skipped_in_a_row = 0

    def weights_step(self, step: int) -> int:
        """The step whose weights step ``step`` (1-based) trained from: the skipped steps before
        it changed nothing."""
        return step - 1 - self.skipped_in_a_row

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the guard: the spike history, the skips in a row and the
        stall count (small), so a resumed run is judged from its first step."""
        return {"spike_history": self.spikes.state(), "skipped_in_a_row": self.skipped_in_a_row,
                "stall": self.stall.state()}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.spikes.load(state.get("spike_history", []))
        self.skipped_in_a_row = int(state.get("skipped_in_a_row", 0))
        self.stall.load(state.get("stall", {}))

    def judge(self, loss: float, grad_norm: float) -> Verdict:
        o = self.options
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            reason = "loss" if not math.isfinite(loss) else "gradients"
            return self._skip_or_stop(o.nonfinite, reason)
        threshold = self.spikes.threshold() if o.spike != "off" else None
        if threshold is None or loss <= threshold:
            return Verdict("apply")
        if o.spike == "warn":
            return Verdict("apply", "spike", threshold)
        if o.spike == "rollback":
            return Verdict("rollback", "spike", threshold)
        return self._skip_or_stop("skip", "spike", threshold)

    def _skip_or_stop(self, policy: str, reason: str, threshold: float | None = None) -> Verdict:
        if policy == "stop":
            return Verdict("stop", reason, threshold)
        if self.skipped_in_a_row + 1 > self.options.max_skips:
            return Verdict("stop", reason, threshold)
        return Verdict("skip", reason, threshold)

    def record(self, step: int, loss: float, verdict: Verdict) -> None:
        """After step ``step`` (1-based) ended with ``verdict``: applied losses join the history."""
        if verdict.action == "skip":
            self.skipped_in_a_row += 1
        elif verdict.applied:
            self.skipped_in_a_row = 0
            self.spikes.add(step, loss)


def microbatch_samples(first_index: int, microbatch: int, dp: int, rows: int) -> range:
    """The global sample indices of microbatch ``microbatch`` of the step whose first sample
    index is ``first_index`` (over every replica: ``dp`` replicas of ``rows`` sequences each)."""
    start = first_index + microbatch * dp * rows
    return range(start, start + dp * rows)


def format_samples(samples: range) -> str:
    return f"sample {samples.start}" if len(samples) == 1 else f"samples {samples.start}..{samples.stop - 1}"


def replica_groups(world: int, dp: int, scope: str) -> tuple[tuple[int, ...], ...]:
    """The sets of ranks that hold identical model-state shards under ZeRO ``scope`` (the
    columns of its mesh grid); groups of one rank (nothing to compare) are left out."""
    grid, _ = zero_mesh_grid(world, dp, scope)
    return tuple(group for group in zip(*grid) if len(group) > 1)


# -- the collectives of the failure path and the replica check -------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def display_name(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (compile, checkpointing)."""
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


@torch.no_grad()
def _first_nonfinite(named: Iterable[tuple[str, torch.Tensor | None]], device: torch.device) -> str | None:
    """Collective: the first name whose tensor (this rank's shard; None: nothing to check) holds
    a NaN or an infinity on any rank, or None. One flag per tensor is made on its device, then
    one all-reduce and one host read for all of them (same order on every rank)."""
    names, flags = [], []
    for name, t in named:
        names.append(name)
        local = None if t is None else _local(t)
        checked = local is not None and local.numel() > 0
        flags.append((~torch.isfinite(local)).any().to(device=device, dtype=torch.float32) if checked else
                     torch.zeros((), dtype=torch.float32, device=device))  # fmt: skip
    tensor = torch.stack(flags) if flags else torch.zeros(1, dtype=torch.float32, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    hit = [i for i, flag in enumerate(tensor.tolist()[: len(names)]) if flag]
    return names[hit[0]] if hit else None


def _parameters(model: torch.nn.Module, of) -> Iterable[tuple[str, torch.Tensor | None]]:
    return ((display_name(name), of(p)) for name, p in model.named_parameters())


def first_nonfinite_gradient(model: torch.nn.Module, device: torch.device) -> str | None:
    """Collective: the first parameter whose gradient holds a NaN or an infinity on any rank, or None."""
    return _first_nonfinite(_parameters(model, lambda p: p.grad), device)


def first_nonfinite_parameter(model: torch.nn.Module, device: torch.device) -> str | None:
    """Collective: the first parameter whose weights hold a NaN or an infinity on any rank, or None."""
    return _first_nonfinite(_parameters(model, lambda p: p), device)


def _state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
    """(name, tensor) of every parameter and, with ``optimizer``, every floating state tensor
    of it (``optimizer state exp_avg_sq of NAME``), in the model's order."""
    for name, p in model.named_parameters():
        yield display_name(name), p
        if optimizer is not None:
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and key != "step":
                    yield f"optimizer state {key} of {display_name(name)}", value


def first_nonfinite_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device
) -> str | None:
    """Collective: the first parameter or optimizer state tensor (AdamW's moments) holding a
    NaN or an infinity on any rank, or None (one reduction and one host read: what a save adds;
    steps that do not save have no such check)."""
    return _first_nonfinite(_state_tensors(model, optimizer), device)


@torch.no_grad()
def parameter_digest(t: torch.Tensor) -> int:
    """A 64-bit digest of the bits of ``t`` (its local shard), computed on its device: the sum of
    each element's bits times an odd weight of its position, modulo 2**64; any change of one
    element changes it."""
    flat = _local(t).detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return 0
    bits = flat.view(_INT_OF_SIZE[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), DIGEST_CHUNK):
        part = bits[start : start + DIGEST_CHUNK].to(torch.int64)
        weight = torch.arange(start, start + part.numel(), dtype=torch.int64, device=flat.device)
        total += (part * (weight.mul_(_DIGEST_MULTIPLIER).bitwise_or_(1))).sum()
    return int(total)


def check_replicas(model: torch.nn.Module, world: int, dp: int, scope: str, device: torch.device) -> str | None:
    """Collective: compare each parameter's digest between the ranks that should hold the same
    shard (:func:`replica_groups`); returns a sentence naming the first parameter and the ranks
    that disagree, or None. One all-gather of one int64 per parameter and rank."""
    names = [display_name(name) for name, _ in model.named_parameters()]
    local = torch.tensor([parameter_digest(p) for _, p in model.named_parameters()], dtype=torch.int64, device=device)
    gathered = local.new_empty((world * len(names),))  # gloo wants the flat [world * n] form
    dist.all_gather_into_tensor(gathered, local)
    rows = gathered.view(world, len(names)).tolist()
    for group in replica_groups(world, dp, scope):
        for i, name in enumerate(names):
            values = {rows[r][i] for r in group}
            if len(values) > 1:
                split = sorted(([r for r in group if rows[r][i] == v] for v in values), key=len)
                if len(split[-1]) > len(group) // 2:  # a majority: name the others
                    who = f"rank(s) {sorted(r for ranks in split[:-1] for r in ranks)} disagree with the others"
                else:
                    who = "no majority: " + " vs ".join(str(ranks) for ranks in sorted(split))
                return (
                    f"parameter {name} differs between ranks that should hold the same copy {list(group)}: {who} "
                    f"(silent data corruption, or a rank that missed an update)"
                )
    return None
