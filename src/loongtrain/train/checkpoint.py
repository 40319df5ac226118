"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): sharded, resharded on load,
checksummed, never half-written.

Layout: ``<run>/checkpoints/step-N/`` holds the DCP shards of the model and optimizer,
``trainer_state.json`` (step, data position, model shape, run id) and ``checksums.json``
(size and SHA-256 of every other file). A save is written into ``step-N.partial``; the
checksums are written last, and only then is the folder renamed to ``step-N``, so a
folder named ``step-N`` was complete when it was written, and an interrupted or failed
save never touches the previous checkpoint (its ``.partial`` folder is removed, at the
latest by the next run). Before writing, the free space is compared with the size of the
model and optimizer states, so a full disk stops the run with one line instead of a
half-written folder. Older checkpoints beyond ``keep`` are deleted after a new one is
complete, and only checkpoints of the same run (same ``run_id``).

Loading verifies a checkpoint first (every listed file present with its size and
checksum; the ranks share the hashing), newest first: a damaged or incomplete one is
reported in one line and renamed ``step-N.damaged``, and the next older one is tried
(``checkpoint.on_damaged = "fallback"``), or the run stops (``"stop"``).

Loading works across layouts: DCP reshards the FSDP-sharded parameters and optimizer
states to whatever dp/hp/cp/ZeRO scope and world size the resumed run uses. The run
folder must be on a filesystem all ranks see.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import re
import shutil
from collections.abc import Callable
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

from loongtrain.data.identity import identity_changes
from loongtrain.model.config import ModelConfig
from loongtrain.train.collectives import broadcast_object, first_error, gather_objects

STATE_FILE = "trainer_state.json"
CHECKSUM_FILE = "checksums.json"
PARTIAL_SUFFIX = ".partial"
DAMAGED_SUFFIX = ".damaged"
DELETING_SUFFIX = ".deleting"
_STEP_DIR = re.compile(r"^step-(\d+)(.*)$")
_MIB = 2**20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run; the message says why."""


class CheckpointSaveError(CheckpointError):
    """A checkpoint that could not be written (e.g. the disk is full); the previous one is intact."""


class DiskFullError(CheckpointSaveError):
    """The run folder's disk filled up while the run wrote to it (metrics, logs, evaluation
    files); the message names the last intact checkpoint."""


def disk_full_message(run_dir: Path, e: OSError | None, checkpoints: CheckpointManager) -> str:
    """One line for a full disk met outside a checkpoint save (``e``: the error, where this rank
    met it): what was being written, and the last intact checkpoint to resume from."""
    latest = checkpoints.latest()
    where = f"the last intact checkpoint is {latest[1].name}" if latest else "no checkpoint was saved yet"
    target = f" ({e.filename})" if e is not None and getattr(e, "filename", None) else ""
    return (
        f"no space left on device while writing to the run folder {run_dir}{target}: training stopped; {where}. "
        f"Free some space (or move run.output_dir), then resume with the same command"
    )


#: ModelConfig's defaults, for settings an older checkpoint does not record.
_SHAPE_DEFAULTS = json.loads(json.dumps(dataclasses.asdict(ModelConfig())))  # as a saved shape reads


def check_model_shape(path: Path, trainer_state: dict, model_shape: dict) -> None:
    """Raise CheckpointError if the checkpoint at ``path`` holds another model shape.

    A setting the checkpoint does not record (written before the setting existed) counts
    as its default value.
    """
    saved = {**_SHAPE_DEFAULTS, **(trainer_state.get("model_shape") or {})}
    diff = {k: (saved.get(k), v) for k, v in model_shape.items() if saved.get(k) != v}
    if diff:
        raise CheckpointError(
            f"checkpoint {path} was written for a different model shape (saved vs this run: {diff}); use the "
            f"same model settings, or set checkpoint.resume=false to start a new run here (the old one is moved "
            f"to {path.parent.parent}/previous/), or choose another run.output_dir"
        )


def check_data_fingerprint(
    path: Path, trainer_state: dict, fingerprint: str | None, allow_change: bool, identity: dict | None = None
) -> str | None:
    """Raise CheckpointError if the checkpoint at ``path`` was written on other data than the
    source whose fingerprint is ``fingerprint`` (the samples from the resumed step on would not
    be the ones the run would have seen); nothing to compare when either is unknown. With
    ``allow_change``, returns one line saying what changed (from the ``identity`` the
    checkpoint recorded and this source's), or None when nothing did."""
    data = trainer_state.get("data") or {}
    saved = data.get("fingerprint")
    if saved is None or fingerprint is None or saved == fingerprint:
        return None
    saved_identity = data.get("identity")
    what = (
        identity_changes(saved_identity, identity)
        if isinstance(saved_identity, dict) and identity is not None
        else "the token files, the mixture, seq_len or data.seed (this checkpoint records no details)"
    )
    if allow_change:
        return (
            f"the data changed since {path.name} ({what}); checkpoint.allow_data_change=true, so training goes on "
            f"with the new data from its position {data.get('next_index', 0)}, judged by the guard against the loss "
            f"history before the change"
        )
    raise CheckpointError(
        f"checkpoint {path} was written on other data (fingerprint {saved}, now {fingerprint}: {what}); restore "
        f"them, set checkpoint.allow_data_change=true to go on with the new data, or start a new stage from it "
        f"(checkpoint.init_from in another run.output_dir)"
    )


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_state(path: Path) -> dict | None:
    """The trainer state of the checkpoint folder ``path``, or None if missing or unreadable."""
    return _read_json(Path(path) / STATE_FILE)


def structure_problem(path: Path) -> str | None:
    """What makes ``path`` unusable without reading its data (missing or truncated files, an
    unreadable state or checksum list), or None if every listed file is there with its size."""
    path = Path(path)
    listed = _read_json(path / CHECKSUM_FILE)
    if listed is None:
        return f"{CHECKSUM_FILE} is missing or unreadable (an incomplete save, or not written by this version)"
    for name, entry in sorted(listed.items()):
        file = path / name
        if not file.is_file():
            return f"file {name} is missing"
        size = file.stat().st_size
        if size != entry.get("size"):
            return f"file {name} has {size} bytes, {entry.get('size')} were written (truncated or overwritten)"
    if read_state(path) is None:
        return f"{STATE_FILE} is unreadable"
    return None


def listed_files(path: Path) -> list[str]:
    """The files ``checksums.json`` of the checkpoint ``path`` lists, sorted (none if unreadable)."""
    return sorted((_read_json(Path(path) / CHECKSUM_FILE) or {}).keys())


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint ``path`` cannot be trusted (a missing, truncated or corrupted file
    against its ``checksums.json``), or None if it is intact: one process checks every file
    (:meth:`CheckpointManager.problem` is the same check with the checksums split over ranks)."""
    trouble = structure_problem(path)
    if trouble is not None:
        return trouble
    problems = checksum_problems(path, listed_files(path))
    return problems[0] if problems else None


def checksum_problems(path: Path, names: list[str]) -> list[str]:
    """The files among ``names`` whose SHA-256 differs from ``checksums.json``."""
    listed = _read_json(Path(path) / CHECKSUM_FILE) or {}
    bad = []
    for name in names:
        try:
            if file_sha256(Path(path) / name) != listed[name]["sha256"]:
                bad.append(f"file {name} does not match its checksum (corrupted)")
        except (OSError, KeyError) as e:
            bad.append(f"file {name} cannot be read ({e})")
    return bad


def _local_bytes(state: dict) -> int:
    total = 0
    for value in state.values():
        if isinstance(value, dict):
            total += _local_bytes(value)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total


def _describe_failure(e: BaseException) -> str:
    """One line for an exception raised by a save (DCP wraps each rank's error)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = next(iter(sorted(failures.items())))
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {type(inner).__name__}: {str(inner).strip().splitlines()[0] if str(inner) else ''}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e`` (or one rank's failure inside a DCP error) is "no space left" or a quota."""
    failures = getattr(e, "failures", None)
    inner = [f[0] if isinstance(f, tuple) else f for f in failures.values()] if isinstance(failures, dict) else [e]
    return any(isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT) for x in inner)


def _delete(folder: Path) -> None:
    """Rename, then delete: a crash mid-way leaves ``*.deleting`` (removed at the next start),
    never a half-deleted ``step-N`` that looks complete."""
    doomed = folder.with_name(folder.name + DELETING_SUFFIX)
    shutil.rmtree(doomed, ignore_errors=True)
    folder.replace(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


class CheckpointManager:
    """The ``step-N`` folders of one run folder's ``checkpoints/``.

    ``run_id`` identifies the run that owns new checkpoints; keep-k deletes only
    checkpoints carrying the same id. ``say`` prints a one-line notice (rank 0).
    """

    def __init__(self, folder: Path, keep: int, run_id: str = "", say: Callable[[str], None] = print) -> None:
        self.folder = Path(folder)
        self.keep = keep
        self.run_id = run_id
        self.say = say

    def steps(self, suffix: str = "") -> list[tuple[int, Path]]:
        """Every ``step-N`` folder (complete when written), oldest first; with ``suffix``, the
        folders set aside as ``step-N<suffix>`` (:meth:`set_aside`) instead."""
        if not self.folder.is_dir():
            return []
        found = []
        for path in self.folder.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and match.group(2) == suffix and path.is_dir():
                found.append((int(match.group(1)), path))
        return sorted(found)

    @staticmethod
    def set_aside(path: Path, suffix: str) -> Path:
        """Rename the checkpoint folder ``path`` to ``<name><suffix>`` (replacing an older folder of
        that name): kept for a person to look at, never resumed from. One rank renames; the caller
        holds the barrier."""
        aside = path.with_name(path.name + suffix)
        shutil.rmtree(aside, ignore_errors=True)
        path.replace(aside)
        return aside

    def complete(self) -> list[tuple[int, Path]]:
        """Step folders that hold a trainer state, oldest first."""
        return [(s, p) for s, p in self.steps() if (p / STATE_FILE).is_file()]

    def latest(self) -> tuple[int, Path] | None:
        done = self.complete()
        return done[-1] if done else None

    def newest_readable(self) -> tuple[int, Path, dict] | None:
        """The newest step folder whose trainer state can be read (for start-up checks)."""
        for step, path in reversed(self.steps()):
            state = read_state(path)
            if state is not None:
                return step, path, state
        return None

    def remove_leftovers(self) -> list[Path]:
        """Delete what interrupted saves and deletions left behind (``*.partial``, ``*.deleting``)."""
        removed = []
        if self.folder.is_dir():
            for path in self.folder.iterdir():
                if path.name.endswith((PARTIAL_SUFFIX, DELETING_SUFFIX)):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
        return removed

    # -- saving --------------------------------------------------------------------------

    def save(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict,
        prune: bool = True,
    ) -> Path:  # fmt: skip
        """Collective: write checkpoint ``step``; returns the final folder. ``prune=False`` leaves
        the older checkpoints for the caller to :meth:`prune` later (the trainer does once a step
        trained from this one's weights was applied: a checkpoint is trusted before older ones go).

        Raises :class:`CheckpointSaveError` on every rank (after removing the partial
        folder) if it cannot be written; the previous checkpoints are untouched.
        """
        final = self.folder / f"step-{step}"
        partial = self.folder / f"step-{step}{PARTIAL_SUFFIX}"
        rank, world = dist.get_rank(), dist.get_world_size()
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        need = sum(gather_objects(_local_bytes(state)))
        error = None
        if rank == 0:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(partial, ignore_errors=True)  # a save interrupted earlier
                free = shutil.disk_usage(self.folder).free
                if free < need:
                    error = self._disk_full_message(step, need, free)
                else:
                    partial.mkdir()
                    self._write_json(partial / STATE_FILE, {**trainer_state, "step": step, "run_id": self.run_id})
            except OSError as e:
                error = self._save_failed_message(step, e, need)
        error = broadcast_object(error)
        if error is None:
            try:
                dcp.save(state, checkpoint_id=str(partial))
            except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException (a BaseException)
                if isinstance(e, KeyboardInterrupt):
                    raise
                error = self._save_failed_message(step, e, need)
                del e  # the traceback holds DCP's writers; keeping it aborts the process at exit
            error = first_error(error)
        if error is None:
            error = self._seal(step, partial, rank, world, need)
        if error is not None:
            if rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            dist.barrier()
            raise CheckpointSaveError(error)
        if rank == 0:
            if final.exists():  # a checkpoint of this step from before a fallback: replaced
                _delete(final)
            partial.replace(final)
            if prune:
                self.prune(step)
        dist.barrier()
        return final

    def _seal(self, step: int, partial: Path, rank: int, world: int, need: int) -> str | None:
        """Collective: checksum every file of ``partial`` (ranks share the files), then
        rank 0 writes ``checksums.json``. Returns the first error, or None."""
        names = broadcast_object(sorted(p.name for p in partial.iterdir()) if rank == 0 else None)
        error, digests = None, {}
        try:
            for name in names[rank::world]:
                file = partial / name
                digests[name] = {"size": file.stat().st_size, "sha256": file_sha256(file)}
        except OSError as e:
            error = f"cannot read back {partial}: {e}"
        gathered = gather_objects((error, digests))
        error = next((err for err, _ in gathered if err), None)
        if error is None and rank == 0:
            listed = {name: entry for _, part in gathered for name, entry in part.items()}
            try:
                self._write_json(partial / CHECKSUM_FILE, listed)
            except OSError as e:
                error = self._save_failed_message(step, e, need)
        return broadcast_object(error)

    @staticmethod
    def _write_json(path: Path, data: dict) -> None:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps(data, indent=1))
        tmp.replace(path)

    def _previous_text(self) -> str:
        done = self.complete()
        return f"the previous checkpoint {done[-1][1].name} is intact" if done else "no earlier checkpoint exists"

    def _disk_full_message(self, step: int, need: int, free: int) -> str:
        return (
            f"checkpoint step-{step} not saved: no space left on device for {self.folder} (it needs about "
            f"{need / _MIB:.1f} MiB, {free / _MIB:.1f} MiB free); {self._previous_text()}. Free some space, "
            f"lower checkpoint.keep or move run.output_dir, then resume with the same command"
        )

    def _save_failed_message(self, step: int, e: BaseException, need: int) -> str:
        free = shutil.disk_usage(self.folder).free if self.folder.is_dir() else 0
        if is_disk_full(e) or (need and free < max(need // 10, _MIB)):
            return self._disk_full_message(step, need, free)
        return (
            f"checkpoint step-{step} not saved in {self.folder}: {_describe_failure(e)}; {self._previous_text()}. "
            f"Fix the cause, then resume with the same command"
        )

    def prune(self, newest: int) -> None:
        """Keep-k over this run's complete checkpoints up to ``newest``; others are never touched."""
        ours = [
            (s, p) for s, p in self.complete() if s <= newest and (read_state(p) or {}).get("run_id") == self.run_id
        ]
        for _, old in ours[: -self.keep]:
            _delete(old)

    # -- loading -------------------------------------------------------------------------

    def problem(self, path: Path) -> str | None:
        """Collective: why ``path`` cannot be trusted (structure on rank 0, checksums shared
        by all ranks), or None if it is intact."""
        rank, world = dist.get_rank(), dist.get_world_size()
        names = None
        if rank == 0:
            trouble = structure_problem(path)
            names = trouble if trouble is not None else listed_files(path)
        names = broadcast_object(names)
        if isinstance(names, str):
            return names
        local = checksum_problems(path, names[rank::world])
        return first_error(local[0] if local else None)

    def find_resumable(self, on_damaged: str = "fallback", at_most: int | None = None) -> tuple[int, Path] | None:
        """Collective: the newest intact checkpoint (of a step at most ``at_most``, when given), or None.

        A damaged newest checkpoint is reported in one line and, with ``on_damaged="fallback"``,
        renamed ``step-N.damaged`` so the next older one is tried; with ``"stop"`` it raises
        :class:`CheckpointError`.
        """
        rank = dist.get_rank()
        candidates = broadcast_object(
            [s for s, _ in self.steps() if at_most is None or s <= at_most] if rank == 0 else None
        )
        for step in reversed(candidates):
            path = self.folder / f"step-{step}"
            trouble = self.problem(path)
            if trouble is None:
                return step, path
            older = [s for s in candidates if s < step]
            if on_damaged == "stop":
                fallback = f"step-{older[-1]}" if older else "the start"
                raise CheckpointError(
                    f"checkpoint {path} is damaged: {trouble}; checkpoint.on_damaged=stop, so nothing was "
                    f"loaded. Set checkpoint.on_damaged=fallback to resume from {fallback} (the damaged folder is "
                    f"kept as step-{step}{DAMAGED_SUFFIX}), or restore the folder"
                )
            if rank == 0:
                aside = self.set_aside(path, DAMAGED_SUFFIX)
                then = f"trying step-{older[-1]}" if older else "no older checkpoint: starting from step 0"
                self.say(f"checkpoint {path} is damaged ({trouble}); kept it as {aside.name}, {then}")
            dist.barrier()
        return None

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_shape: dict) -> dict:
        """Load ``path`` into ``model``/``optimizer``; returns the trainer state.

        Raises :class:`CheckpointError` before touching the model if the checkpoint was
        written for a different model shape or cannot be read.
        """
        trainer_state = self._checked_state(path, model_shape)
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        self._read(path, state)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        return trainer_state

    def load_model(self, path: Path, model: torch.nn.Module) -> dict:
        """Collective: load only the model weights of ``path`` into ``model`` (evaluation: the
        optimizer states are never read; the caller compared the shapes); returns the trainer
        state. Verify the checkpoint first with :meth:`problem`, as a resume does."""
        trainer_state = self._checked_state(path, None)
        state = {"model": get_model_state_dict(model)}
        self._read(path, state)
        set_model_state_dict(model, state["model"])
        return trainer_state

    @staticmethod
    def _checked_state(path: Path, model_shape: dict | None) -> dict:
        trainer_state = read_state(path)
        if trainer_state is None:
            raise CheckpointError(f"checkpoint {path}: {STATE_FILE} is missing or unreadable")
        if model_shape is not None:
            check_model_shape(path, trainer_state, model_shape)
        return trainer_state

    @staticmethod
    def _read(path: Path, state: dict) -> None:
        try:
            dcp.load(state, checkpoint_id=str(path))
        except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException (a BaseException)
            if isinstance(e, KeyboardInterrupt):
                raise
            message = f"checkpoint {path} cannot be loaded: {_describe_failure(e)}"
            del e
            raise CheckpointError(message) from None
