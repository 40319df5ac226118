"""A command that runs a trained model on the ranks of training (``loongtrain eval``,
``loongtrain generate``, the lm-evaluation-harness model): its target resolved and checked in
the launching process, then every rank runs the job, started as training starts its workers.

- :func:`resolve_target`: a run folder (its ``config.toml`` and checkpoints) or a Hugging Face
  model folder -> the config, the spec and where the weights come from, every check done
  before any process starts;
- :func:`run_job`: under torchrun this process is one rank; one process runs in place; more
  run under torchrun's elastic agent, and however they end the user reads one line.

A job is a picklable object with ``cfg`` and a ``run(device) -> dict`` method (collective).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from loongtrain.config import ConfigError, TrainConfig, load_config
from loongtrain.data.tokens import TokenFileError
from loongtrain.eval.model import Weights, checkpoint_candidates
from loongtrain.launch import check_device, single_process_env, under_torchrun
from loongtrain.train.checkpoint import CheckpointError
from loongtrain.train.spec import RunSpec

USER_ERRORS = (ConfigError, TokenFileError, CheckpointError)


class Job(Protocol):
    cfg: TrainConfig

    def run(self, device) -> dict: ...


@dataclass(frozen=True)
class Target:
    """A model to run, resolved: its config (the run's, or defaults for a Hugging Face folder
    with ``model.init_from`` set), spec, weights, and whether it is a Hugging Face folder."""

    path: Path
    cfg: TrainConfig
    spec: RunSpec
    weights: Weights
    hf: bool

    @property
    def run_dir(self) -> Path | None:
        return None if self.hf else self.path

    @property
    def name(self) -> str:
        """``step-N`` of a run's checkpoint, the folder's name of a Hugging Face folder."""
        if self.weights.kind == "checkpoint":
            return f"step-{self.weights.steps[0]}"
        return "random-init" if self.weights.kind == "random" else self.path.name


def model_spec_for(cfg: TrainConfig, world: int, local: int) -> RunSpec:
    """What ``preflight`` resolves for training, less what only training needs (data, run
    folder, optimizer, resume)."""
    from loongtrain.apply import check_model_fits
    from loongtrain.train.spec import model_spec

    try:
        spec = model_spec(cfg)
        spec.parallel.resolve_dp(world)
        check_model_fits(spec.model, spec.parallel.hp)
        check_device(cfg.run.device, local)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return spec


def resolve_target(
    target: str | Path, overrides: list[str], world: int, local: int, *, config: str | None = None,
    step: int | None = None, random_weights: bool = False,
) -> Target:  # fmt: skip
    """Resolve and check a run folder or a Hugging Face folder (no process group); raises a
    user error in one line. ``config``: a TOML config for a Hugging Face folder; ``step``: a
    run's checkpoint (default: the newest intact)."""
    path = Path(target)
    if (path / "config.toml").is_file():
        if config:
            raise ConfigError(f"{path} is a run folder with its own config.toml; --config is for HF folders")
        cfg, hf = load_config(path / "config.toml", overrides), False
    elif (path / "config.json").is_file():
        if step is not None:
            raise ConfigError(f"--step {step}: {path} is a Hugging Face folder, not a run with checkpoints")
        cfg, hf = load_config(config, [*overrides, f"model.init_from={path}"]), True
    else:
        raise ConfigError(
            f"{path} is neither a run folder (no config.toml) nor a Hugging Face model folder (no config.json)"
        )
    spec = model_spec_for(cfg, world, local)
    if random_weights:
        weights = Weights("random", seed=cfg.run.seed)
    elif hf:
        weights = Weights("hf", str(path))
    else:
        steps = checkpoint_candidates(path / "checkpoints", step, spec.model)
        weights = Weights("checkpoint", str(path / "checkpoints"), steps)
    return Target(path, cfg, spec, weights, hf)


def world_sizes(nproc: int) -> tuple[int, int]:
    """(world, local world) of this command: torchrun's, or ``nproc`` local processes."""
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        return world, int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {nproc}")
    return nproc, nproc


def job_worker(job: Job, prefix: str) -> dict:
    """One rank of a job (the elastic agent's entry, or the process itself)."""
    import torch.distributed as dist

    from loongtrain.launch import allow_ctrl_c, init_distributed
    from loongtrain.train.faults import ERROR, FATAL, WorkerReport, debug_enabled, exception_line, write_report

    allow_ctrl_c()
    rank = int(os.environ.get("RANK", "0"))
    try:
        device = init_distributed(timeout_s=max(600.0, job.cfg.run.timeout_s * 2), device=job.cfg.run.device)
        result = job.run(device)
    except USER_ERRORS as e:
        if not write_report(WorkerReport(rank, FATAL, str(e))) and rank == 0:
            print(prefix + str(e), file=sys.stderr, flush=True)
        result = {"fatal": str(e)}
    except Exception as e:
        if debug_enabled():
            traceback.print_exc()
        if not write_report(WorkerReport(rank, ERROR, exception_line(e))):
            print(f"{prefix}rank {rank} failed: {exception_line(e)}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


def _supervise(job: Job, nproc: int, prefix: str, interrupted: str) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from loongtrain.launch import elastic_run
    from loongtrain.train.faults import REPORT_DIR_ENV, ProcessEnd, debug_enabled, read_reports, root_cause

    def say(message: str) -> None:
        print(prefix + message, file=sys.stderr, flush=True)

    report_dir = tempfile.mkdtemp(prefix="loongtrain-job-reports-")
    os.environ[REPORT_DIR_ENV] = report_dir
    try:
        results = elastic_run(job_worker, job, prefix, nproc=nproc, quiet=not debug_enabled())
    except (SignalException, KeyboardInterrupt):  # Ctrl-C (the agent turns it into a SignalException)
        say(interrupted)
        return 130
    except ChildFailedError as e:
        ends = [ProcessEnd(r, f.exitcode, f.signal_name() if f.exitcode < 0 else None) for r, f in e.failures.items()]
        say(root_cause(read_reports(Path(report_dir)), ends))
        return 1
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)
        os.environ.pop(REPORT_DIR_ENV, None)
    fatal = [r["fatal"] for r in results.values() if isinstance(r, dict) and "fatal" in r]
    if fatal:
        say(fatal[0])
        return 2
    return 0


def run_job(job: Job, world: int, prefix: str, interrupted: str = "interrupted; nothing was written") -> int:
    """Run ``job`` on ``world`` ranks; returns the exit code (0 done, 1 a rank failed, 2 a
    user error, 130 Ctrl-C). ``prefix`` starts every line said to the user."""
    if under_torchrun():
        return 2 if "fatal" in job_worker(job, prefix) else 0
    if world == 1:  # in this process: no launcher start-up
        single_process_env()
        try:
            return 2 if "fatal" in job_worker(job, prefix) else 0
        except KeyboardInterrupt:
            print(prefix + interrupted, file=sys.stderr, flush=True)
            return 130
    return _supervise(job, world, prefix, interrupted)
