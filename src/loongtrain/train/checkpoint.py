"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): sharded, resharded on load.

Layout: ``<run>/checkpoints/step-N/`` holds the DCP shards of the model and optimizer
and ``trainer_state.json`` (step, data position, model shape). A save is written into
``step-N.partial`` and renamed to ``step-N`` only after every rank finished and the
trainer state is on disk, so a folder named ``step-N`` is always complete and an
interrupted save never touches the previous checkpoint. Older complete checkpoints
beyond ``keep`` are deleted after a new one is complete. The run folder must be on a
filesystem all ranks see.

Loading works across layouts: DCP reshards the FSDP-sharded parameters and optimizer
states to whatever dp/hp/cp/ZeRO scope and world size the resumed run uses.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run; the message says why."""


def check_model_shape(path: Path, trainer_state: dict, model_shape: dict) -> None:
    """Raise CheckpointError if the checkpoint at ``path`` holds another model shape."""
    saved = trainer_state.get("model_shape") or {}
    if saved != model_shape:
        diff = {k: (saved.get(k), v) for k, v in model_shape.items() if saved.get(k) != v}
        raise CheckpointError(
            f"checkpoint {path} was written for a different model shape (saved vs this run: {diff}); use the "
            f"same model settings, set checkpoint.resume=false, or choose another run.output_dir"
        )


class CheckpointManager:
    def __init__(self, folder: Path, keep: int) -> None:
        self.folder = Path(folder)
        self.keep = keep

    def complete(self) -> list[tuple[int, Path]]:
        """Complete checkpoints, oldest first."""
        if not self.folder.is_dir():
            return []
        found = []
        for path in self.folder.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and path.is_dir() and (path / STATE_FILE).is_file():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def latest(self) -> tuple[int, Path] | None:
        done = self.complete()
        return done[-1] if done else None

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict) -> Path:
        """Collective: every rank writes its shards; returns the final folder."""
        final = self.folder / f"step-{step}"
        partial = self.folder / f"step-{step}.partial"
        rank = dist.get_rank()
        if rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # a save interrupted earlier
        dist.barrier()
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.save(state, checkpoint_id=str(partial))
        dist.barrier()
        if rank == 0:
            tmp = partial / (STATE_FILE + ".tmp")
            tmp.write_text(json.dumps({**trainer_state, "step": step}, indent=1))
            tmp.replace(partial / STATE_FILE)
            shutil.rmtree(final, ignore_errors=True)
            partial.replace(final)
            for _, old in self.complete()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    @staticmethod
    def read_state(path: Path) -> dict:
        return json.loads((Path(path) / STATE_FILE).read_text())

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_shape: dict) -> dict:
        """Load ``path`` into ``model``/``optimizer``; returns the trainer state.

        Raises :class:`CheckpointError` before touching the model if the checkpoint was
        written for a different model shape.
        """
        trainer_state = self.read_state(path)
        check_model_shape(path, trainer_state, model_shape)
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        return trainer_state
