"""A run that starts where another ended: a new stage (``checkpoint.init_from``).

Long-context recipes train in stages (ProLong: 64K, then 512K with a larger RoPE base; Llama 3:
8K to 128K in steps). A stage is a new run whose initial weights (and, with
``checkpoint.init_optimizer``, optimizer state) are another run's checkpoint, read through DCP so
that the layout, world size and ZeRO scope may differ, with no export round trip. Everything else
starts afresh: the step count, the learning-rate schedule, the data (another length, mixture,
upsampling). The model's shape must be the same; what a stage may change of the model is its
RoPE (base, scaling, positions) and its sliding window (:data:`STAGE_FIELDS`).

:func:`stage_checkpoint` and :func:`check_stage_shape` need no process group (preflight runs them
before any process starts); :func:`load_stage` is the collective load ``build_run`` calls.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from loongtrain.train.checkpoint import (
    _SHAPE_DEFAULTS,
    STATE_FILE,
    CheckpointError,
    CheckpointManager,
    read_state,
    structure_problem,
)
from loongtrain.train.model_setup import SOURCE_DIR

#: model settings a stage may change (the weights do not depend on them)
STAGE_FIELDS = ("rope_theta", "rope_scaling", "max_positions", "sliding_window", "layer_kinds")


def stage_checkpoint(init_from: str | Path) -> Path:
    """The checkpoint folder ``init_from`` names: a run folder's newest complete checkpoint, or a
    ``step-N`` folder itself. Raises CheckpointError naming what is missing (files are checked by
    their sizes here; their checksums when the stage loads them)."""
    path = Path(init_from)
    if (path / STATE_FILE).is_file():
        found = path
    elif (path / "checkpoints").is_dir():
        complete = CheckpointManager(path / "checkpoints", keep=1).complete()
        if not complete:
            raise CheckpointError(
                f"checkpoint.init_from={str(init_from)!r}: the run folder has no complete checkpoint; train that "
                f"stage to its end (or set checkpoint.every) first"
            )
        found = complete[-1][1]
    else:
        kinds = f"a run folder (with checkpoints/) {{}} a checkpoint folder (step-N with {STATE_FILE})"
        what = (
            "does not exist" if not path.exists()
            else f"is a file, not {kinds.format('or')}" if not path.is_dir()
            else f"is neither {kinds.format('nor')}"
        )  # fmt: skip
        raise CheckpointError(
            f"checkpoint.init_from={str(init_from)!r} {what}; give the previous stage's run.output_dir"
        )
    trouble = structure_problem(found)
    if trouble is not None:
        raise CheckpointError(f"checkpoint.init_from: checkpoint {found} is damaged: {trouble}; use an intact one")
    return found


def check_stage_shape(path: Path, model_shape: dict) -> None:
    """Raise CheckpointError if the checkpoint at ``path`` holds a model of another shape than
    ``model_shape`` (the fields of :data:`STAGE_FIELDS` may differ)."""
    saved = {**_SHAPE_DEFAULTS, **((read_state(path) or {}).get("model_shape") or {})}
    diff = {k: (saved.get(k), v) for k, v in model_shape.items() if k not in STAGE_FIELDS and saved.get(k) != v}
    if diff:
        raise CheckpointError(
            f"checkpoint.init_from: checkpoint {path} holds a model of another shape (saved vs this stage: {diff}); "
            f"a stage keeps the model's shape and may change only {', '.join(STAGE_FIELDS)}: use the previous "
            f"stage's [model] settings"
        )


def load_stage(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, with_optimizer: bool) -> None:
    """Collective: verify the checkpoint ``path`` (checksums, shared by the ranks) and load its
    weights into ``model``, and its optimizer state when ``with_optimizer``."""
    manager = CheckpointManager(path.parent, keep=1)
    trouble = manager.problem(path)
    if trouble is not None:
        raise CheckpointError(f"checkpoint.init_from: checkpoint {path} is damaged: {trouble}; use an intact one")
    if with_optimizer:
        manager.load(path, model, optimizer, None)
    else:
        manager.load_model(path, model)


def keep_stage_source(checkpoint: Path, run_dir: str | Path) -> None:
    """Copy the previous stage's ``hf-source`` (an imported model's config and tokenizer files)
    into this run's folder, so that ``loongtrain export`` and ``eval`` find them here too."""
    source = Path(checkpoint).parent.parent / SOURCE_DIR
    dest = Path(run_dir) / SOURCE_DIR
    if source.is_dir() and not dest.exists():
        shutil.copytree(source, dest)
