"""One training rank, as the elastic agent (``loongtrain train``) or an external torchrun
starts it: process group with ``run.timeout_s``, the stalled-rank watchdog, the training,
and every way it can end turned into one report (no traceback unless ``--debug``)."""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch.distributed as dist

from loongtrain.config import ConfigError, TrainConfig
from loongtrain.data.tokens import TokenFileError
from loongtrain.launch import allow_ctrl_c, init_distributed
from loongtrain.train.checkpoint import CheckpointError
from loongtrain.train.faults import (
    COMM,
    ERROR,
    FATAL,
    RUNNING,
    STALL,
    WorkerReport,
    current_attempt,
    debug_enabled,
    exception_line,
    is_comm_failure,
    say,
    write_report,
)
from loongtrain.train.guard import GuardStop
from loongtrain.train.run_lock import RunFolderBusy, register_worker
from loongtrain.train.spec import RunSpec
from loongtrain.train.trainer import AfterStep, train
from loongtrain.train.watchdog import Watchdog, connect_store

# errors every rank raises alike, whose message names the fix: reported once, never restarted
USER_ERRORS = (ConfigError, TokenFileError, CheckpointError, GuardStop, RunFolderBusy)
# the bad-input ones among them (config, model folder, token file): no resume can fix them
INPUT_ERRORS = (ConfigError, TokenFileError)
# the agent polls its workers every 0.2 s; a rank that only lost a connection exits after this
VICTIM_EXIT_DELAY_S = 1.0


def _report(rank: int, kind: str, message: str, input_error: bool = False) -> None:
    """Leave the report for the launcher, or print it (an external torchrun has no report folder)."""
    report = WorkerReport(rank, kind, message, current_attempt(), input_error)
    if not write_report(report) and (kind != FATAL or rank == 0):
        say(message if kind in (FATAL, STALL) else f"rank {rank}: {message}")


def _start_watchdog(cfg: TrainConfig, rank: int, world: int) -> Watchdog | None:
    if world == 1:
        return None
    store = connect_store(min(30.0, cfg.run.timeout_s / 2))

    def report(message: str | None) -> None:
        if message is not None:
            _report(rank, STALL, message)

    return Watchdog(store, rank, world, cfg.run.timeout_s, report).start()


def run_worker(cfg: TrainConfig, spec: RunSpec, after_step: AfterStep | None = None, job: str | None = None) -> dict:
    """Train on this rank (``after_step``: see :func:`~loongtrain.train.trainer.train`); with
    ``job`` (the id of the job that holds the run folder's lock) this process first registers
    in the lock as one of the job's workers, so that no other job takes the folder over while
    it runs. Returns ``{"final_step": n}``, or ``{"fatal": message}`` for an
    error every rank agrees on (the process then exits cleanly, so the agent does not
    restart a run that would fail again); any other failure is reported and the process
    exits with code 1 at once."""
    # Ctrl-C reaches every process of the terminal: a worker ends at once, quietly; the
    # launcher says what happened
    allow_ctrl_c()
    rank = int(os.environ.get("RANK", "0"))
    write_report(WorkerReport(rank, RUNNING, "", current_attempt()))
    watchdog = None
    try:
        if job is not None:
            register_worker(cfg.run.output_dir, job)
        # the process group's timeout is the backstop behind the watchdog's diagnosis
        device = init_distributed(timeout_s=cfg.run.timeout_s + max(cfg.run.timeout_s, 30.0), device=cfg.run.device)
        watchdog = _start_watchdog(cfg, rank, dist.get_world_size())
        beat = watchdog.progress if watchdog is not None else None
        result = train(device, cfg, spec, beat=beat, after_step=after_step)
        outcome = {"final_step": result.final_step}
    except USER_ERRORS as e:
        if debug_enabled():
            traceback.print_exc()
        _report(rank, FATAL, str(e), isinstance(e, INPUT_ERRORS))
        outcome = {"fatal": str(e), "input_error": isinstance(e, INPUT_ERRORS), "resumable": isinstance(e, GuardStop)}
    except Exception as e:
        if debug_enabled():
            traceback.print_exc()
        if is_comm_failure(e):  # a victim: the gloo/NCCL text only repeats that a peer is gone
            _report(rank, COMM, "lost the connection to another rank (it died, or its node is unreachable)")
            time.sleep(VICTIM_EXIT_DELAY_S)  # let the agent see the rank that died first, and name it
        else:
            _report(rank, ERROR, exception_line(e))
        if watchdog is not None:
            watchdog.stop("failed")
        # exit now: at interpreter exit the process group would wait for peers that may be frozen
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if watchdog is not None:
        watchdog.stop()
    if dist.is_initialized():
        dist.destroy_process_group()
    return outcome


def main_under_torchrun(
    cfg: TrainConfig, spec: RunSpec, after_step: AfterStep | None = None, job: str | None = None
) -> None:
    """``loongtrain train`` started by an external torchrun: this process is one rank (of ``job``)."""
    if "fatal" in run_worker(cfg, spec, after_step, job):
        sys.exit(2)
