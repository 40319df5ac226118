"""The model an evaluation runs: built and sharded as training builds it (same layout, ZeRO
scope and compute dtype) but for forward only (no activation checkpointing, no optimizer),
with its weights from a training checkpoint (model states only, verified like a resume),
a Hugging Face folder, or the run's random initial values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from loongtrain.apply import materialize, parallelize
from loongtrain.config import TrainConfig
from loongtrain.model import build_model
from loongtrain.model.config import ModelConfig
from loongtrain.parallel import ParallelState
from loongtrain.train.checkpoint import CheckpointError, CheckpointManager, read_state, structure_problem
from loongtrain.train.spec import RunSpec

#: The fields of a ModelConfig that decide the weights' shapes (RoPE, window and context
#: length do not: a checkpoint may be evaluated with another RoPE scaling).
WEIGHT_FIELDS = (
    "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "tie_embeddings", "head_dim_override",
    "qkv_bias", "qk_norm", "qk_norm_scope", "norm_placement", "norm_offset", "activation", "embed_scale",
)  # fmt: skip


@dataclass(frozen=True)
class Weights:
    """Where the evaluated weights come from: ``kind`` "checkpoint" (``steps``: the candidate
    step folders of ``folder``, newest first; the first intact one is used), "hf" (``folder``)
    or "random" (the run's initial values, ``seed``)."""

    kind: str
    folder: str = ""
    steps: tuple[int, ...] = ()
    seed: int = 0

    def describe(self) -> str:
        if self.kind == "checkpoint":
            return f"checkpoint {self.folder}/step-{self.steps[0]}"
        if self.kind == "hf":
            return f"Hugging Face folder {self.folder}"
        return f"random initial weights (seed {self.seed})"


def check_weight_shape(path: Path, saved: dict, model: ModelConfig) -> None:
    """Raise CheckpointError if the checkpoint's model (its ``model_shape``) has weights of
    another shape than ``model``."""
    mine = dataclasses.asdict(model)
    defaults = dataclasses.asdict(ModelConfig())
    diff = {k: (saved.get(k, defaults[k]), mine[k]) for k in WEIGHT_FIELDS if saved.get(k, defaults[k]) != mine[k]}
    if diff:
        raise CheckpointError(
            f"checkpoint {path} holds a model of another shape than the one configured for evaluation (saved vs "
            f"configured: {diff}); evaluate it with the run's own [model] settings (its config.toml)"
        )


def checkpoint_candidates(folder: Path, step: int | None, model: ModelConfig) -> tuple[int, ...]:
    """The step folders of ``folder`` (``<run>/checkpoints``) to try, newest first: ``step``
    alone when given. Checks, without reading weights, that the folder has complete
    checkpoints, that ``step`` exists, and the model shape; raises CheckpointError."""
    manager = CheckpointManager(folder, keep=1)
    steps = manager.steps()
    if not steps:
        raise CheckpointError(
            f"{folder.parent} has no checkpoints ({folder} holds no step-N folder); train it first, or evaluate a "
            "Hugging Face folder"
        )
    if step is not None:
        found = [p for s, p in steps if s == step]
        if not found:
            have = ", ".join(str(s) for s, _ in steps)
            raise CheckpointError(f"--step {step}: {folder} has no step-{step}; it has step(s) {have}")
        problem = structure_problem(found[0])
        if problem is not None:
            raise CheckpointError(f"checkpoint {found[0]} cannot be evaluated: {problem}")
        candidates = [(step, found[0])]
    else:
        candidates = [(s, p) for s, p in reversed(steps) if structure_problem(p) is None]
        if not candidates:
            raise CheckpointError(f"{folder}: no complete checkpoint (every step-N folder is damaged or incomplete)")
    for _, path in candidates[:1]:
        check_weight_shape(path, (read_state(path) or {}).get("model_shape") or {}, model)
    return tuple(s for s, _ in candidates)


def build_eval_model(device: torch.device, cfg: TrainConfig, spec: RunSpec, state: ParallelState) -> torch.nn.Module:
    """Collective: the run's model on ``state`` for forward only: training's memory options
    without activation checkpointing or its offload, the run's ZeRO scope and compute dtype.
    Its parameters are allocated, not initialised (:func:`load_eval_weights` fills them)."""
    memory = dataclasses.replace(spec.memory, activation_checkpoint="none", offload_activations=False)
    model = build_model(spec.model)
    parallelize(
        model, state, memory=memory, zero=cfg.parallel.zero,
        param_dtype=None if spec.param_dtype == torch.float32 else spec.param_dtype,
        reshard_after_forward=cfg.parallel.reshard_after_forward,
    )  # fmt: skip
    model.eval()
    return model


def _refuse_nonfinite(model: torch.nn.Module, device: torch.device, what: str, error: type, fix: str) -> None:
    """Collective: raise ``error`` naming the first parameter of the loaded ``model`` that holds
    a NaN or an infinity (every output computed from it would be NaN), as a resume refuses one."""
    from loongtrain.train.guard import first_nonfinite_parameter

    name = first_nonfinite_parameter(model, device)
    if name is not None:
        raise error(
            f"{what} holds non-finite weights (NaN or infinity) in {name}: every result computed from it would be "
            f"NaN; {fix}"
        )


def load_eval_weights(model: torch.nn.Module, device: torch.device, weights: Weights, say=print) -> str:
    """Collective: fill ``model`` from ``weights``; returns what was loaded (one line).

    A checkpoint is verified first (every file's size and checksum, shared by the ranks, as a
    resume does); a damaged newest checkpoint is reported and the next older one tried (the
    run folder is left as it is), a damaged ``--step`` is an error. Weights holding a NaN or
    an infinity are refused, naming the parameter."""
    if weights.kind == "random":
        materialize(model, device, seed=weights.seed)
        return weights.describe()
    if weights.kind == "hf":
        from loongtrain.apply.init import states_device
        from loongtrain.hf.folder import HFFormatError
        from loongtrain.hf.load import load_weights, read_folder

        model.to_empty(device=states_device(model, device))
        load_weights(model, read_folder(weights.folder))
        _refuse_nonfinite(model, device, weights.describe(), HFFormatError, "use an intact copy of the model")
        return weights.describe()
    manager = CheckpointManager(Path(weights.folder), keep=1, say=say)
    for step in weights.steps:
        path = Path(weights.folder) / f"step-{step}"
        problem = manager.problem(path)
        if problem is None:
            from loongtrain.apply.init import states_device

            model.to_empty(device=states_device(model, device))
            manager.load_model(path, model)
            fix = "evaluate an older checkpoint of the run (--step N)"
            _refuse_nonfinite(model, device, f"checkpoint {path}", CheckpointError, fix)
            return f"checkpoint {path}"
        if len(weights.steps) == 1:
            raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
        say(f"checkpoint {path} is damaged ({problem}); trying an older one")
    raise CheckpointError(f"{weights.folder}: every checkpoint is damaged")
