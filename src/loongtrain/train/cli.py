"""``loongtrain train``: config file + overrides -> preflight -> every rank trains under
torchrun's elastic agent, and however the job ends the user reads one line.

Started by an external ``torchrun``, this process is one rank instead (see
:mod:`loongtrain.train.worker`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import tempfile
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

from loongtrain.config import ConfigError, TrainConfig, describe, load_config
from loongtrain.launch import elastic_run, under_torchrun
from loongtrain.local_workers import die_with, launcher_identity
from loongtrain.train.checkpoint import CheckpointManager
from loongtrain.train.faults import (
    DEBUG_ENV,
    REPORT_DIR_ENV,
    ProcessEnd,
    debug_enabled,
    fatal_cause,
    input_error_cause,
    read_reports,
    resume_command,
    resume_hint,
    root_cause,
    say,
)
from loongtrain.train.preflight import preflight
from loongtrain.train.run_folder import discard_new_run, holds_run
from loongtrain.train.run_lock import Holder, RunFolderBusy, acquire, release
from loongtrain.train.spec import RunSpec
from loongtrain.train.trainer import AfterStep
from loongtrain.train.worker import USER_ERRORS, main_under_torchrun, run_worker

#: A check of a config, for this world size, that raises a user error before any process starts.
Check = Callable[[TrainConfig, RunSpec, int], None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML config file (see configs/); keys not given keep their defaults")
    parser.add_argument(
        "--nproc", type=int, default=1, help="processes per node (ignored under torchrun, which sets it)"
    )
    parser.add_argument(
        "--max-restarts", type=int, default=0, metavar="N",
        help="restart all workers up to N times after a failure (torchrun's elastic agent), resuming from the last "
        "complete checkpoint",
    )  # fmt: skip
    parser.add_argument("--nnodes", type=int, default=1, help="nodes; start the same command on each node")
    parser.add_argument("--rdzv-endpoint", default="", help="host:port of one node, for --nnodes > 1 (c10d rendezvous)")
    parser.add_argument("--rdzv-id", default="", help="a job id shared by all nodes, unique per job")
    parser.add_argument(
        "--debug", action="store_true", help=f"show full tracebacks and the agent's logs (or set {DEBUG_ENV}=1)"
    )
    parser.add_argument("--help-config", action="store_true", help="list every config key with its help and exit")
    parser.epilog = "Any config key can be overridden: --section.key value (e.g. --run.steps 50 --parallel.hp 2)."


def split_overrides(extra: list[str]) -> list[str]:
    """``['--run.steps', '5', '--data.seq_len=64']`` -> ``['run.steps=5', 'data.seq_len=64']``."""
    out, i = [], 0
    while i < len(extra):
        item = extra[i]
        if not item.startswith("--") or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument {item!r}; overrides look like --section.key value")
        if "=" in item:
            out.append(item[2:])
            i += 1
        elif i + 1 < len(extra):
            out.append(f"{item[2:]}={extra[i + 1]}")
            i += 2
        else:
            raise ConfigError(f"override {item!r} has no value")
    return out


def check_launch_arguments(args: argparse.Namespace) -> None:
    """Raise ConfigError for launcher flags that cannot work."""
    for name in ("nproc", "nnodes"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must not be negative, got {args.max_restarts}")
    if args.nnodes > 1 and not (args.rdzv_endpoint and args.rdzv_id):
        raise ConfigError(
            "--nnodes > 1 needs --rdzv-endpoint host:port (one node's address, reachable from all) and a --rdzv-id "
            "shared by all nodes and unique per job (e.g. $SLURM_JOB_ID)"
        )


def _latest_step(cfg: TrainConfig) -> int | None:
    latest = CheckpointManager(Path(cfg.run.output_dir) / "checkpoints", cfg.checkpoint.keep).latest()
    return latest[0] if latest else None


def supervise(
    cfg: TrainConfig, spec: RunSpec, args: argparse.Namespace, argv: list[str], after_step: AfterStep | None = None
) -> int:
    """Run every local rank under the elastic agent; print one line for however it ends.
    Returns the exit code: 0 done, 1 a worker failed, 2 a user-facing error, 128+n a signal.

    A run that fails on bad input (config, model folder, token file: no resume can fix it)
    gets no resume hint, and leaves nothing behind in a run folder that held no run before."""
    run_dir = Path(cfg.run.output_dir)
    existed, held_run = run_dir.exists(), holds_run(run_dir)
    job = args.rdzv_id if args.nnodes > 1 else uuid.uuid4().hex  # the nodes of one launch share the folder
    holder = Holder.this_process(job, command=resume_command(argv))
    try:
        taken = acquire(run_dir, holder)
    except RunFolderBusy as e:
        say(str(e))
        return 2
    except OSError as e:
        say(f"cannot take the run folder {run_dir} ({e}); fix its permissions or choose another run.output_dir")
        return 2
    if taken.notice:
        say(f"notice: {taken.notice}")
    try:
        return _supervise(cfg, spec, args, argv, after_step, run_dir, existed, held_run, job)
    finally:
        release(run_dir, holder)


def _supervise(
    cfg: TrainConfig, spec: RunSpec, args: argparse.Namespace, argv: list[str], after_step: AfterStep | None,
    run_dir: Path, existed: bool, held_run: bool, job: str,
) -> int:  # fmt: skip
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    def failed_on_input(message: str) -> int:
        if not held_run:
            discard_new_run(run_dir, existed)
        say(message)
        return 2

    report_dir = None
    try:
        report_dir = tempfile.mkdtemp(prefix="loongtrain-reports-")
        os.environ[REPORT_DIR_ENV] = report_dir
        results = elastic_run(
            run_worker, cfg, spec, after_step, job, nproc=args.nproc, nnodes=args.nnodes,
            rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id, max_restarts=args.max_restarts,
            quiet=not debug_enabled(),
        )  # fmt: skip
    except (SignalException, KeyboardInterrupt) as e:
        sig = signal.Signals(e.sigval) if isinstance(e, SignalException) else signal.SIGINT
        say(
            f"stopped by {sig.name}: every worker was ended at once (the step in progress is not saved); "
            f"{resume_hint(_latest_step(cfg), argv)}"
        )
        return 128 + int(sig)
    except ChildFailedError as e:
        if debug_enabled():
            traceback.print_exc()
        ends = [
            ProcessEnd(rank, f.exitcode, f.signal_name() if f.exitcode < 0 else None) for rank, f in e.failures.items()
        ]
        reports = read_reports(Path(report_dir))
        cause = root_cause(reports, ends, attempt=args.max_restarts)
        if input_error_cause(reports, attempt=args.max_restarts):
            return failed_on_input(cause)
        restarts = f" (after {args.max_restarts} restart(s))" if args.max_restarts else ""
        say(f"{cause}{restarts}; {resume_hint(_latest_step(cfg), argv)}")
        # a user-facing error one rank met alone (rank 0's full disk while writing metrics): exit 2 as for all
        return 2 if fatal_cause(reports, attempt=args.max_restarts) else 1
    finally:
        if report_dir is not None:
            shutil.rmtree(report_dir, ignore_errors=True)
        os.environ.pop(REPORT_DIR_ENV, None)
    fatal = [r for r in results.values() if isinstance(r, dict) and "fatal" in r]
    if fatal:
        if fatal[0].get("input_error"):
            return failed_on_input(fatal[0]["fatal"])
        resume = f"; resume with: {resume_command(argv)}" if fatal[0].get("resumable") else ""
        say(fatal[0]["fatal"] + resume)
        return 2
    return 0


def main(
    args: argparse.Namespace, extra: list[str], after_step: AfterStep | None = None, check: Check | None = None
) -> None:
    """``loongtrain train``; ``after_step`` (picklable: a module-level function) runs in every
    worker as :func:`~loongtrain.train.trainer.train` says, ``check`` before any process starts."""
    if args.help_config:
        print(describe())
        return
    if args.debug:
        os.environ[DEBUG_ENV] = "1"
    try:
        cfg = load_config(args.config, split_overrides(extra))
        if under_torchrun():
            world = int(os.environ["WORLD_SIZE"])
            local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        else:
            check_launch_arguments(args)
            world, local = args.nproc * args.nnodes, args.nproc
        spec = preflight(cfg, world, local)
        if check is not None:
            check(cfg, spec, world)
    except USER_ERRORS as e:
        say(str(e))
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        say("interrupted before training started")
        raise SystemExit(130) from None
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank runs preflight: one says it
        for notice in spec.notices:
            say(f"notice: {notice}")
    if under_torchrun():
        # the ranks of one torchrun job share the folder; its holder is the agent (their parent). torchrun's
        # default run id is "none" for every job: then the job is this node's agent
        job = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        job = f"torchrun-{socket.gethostname()}-{os.getppid()}" if job == "none" else job
        die_with(launcher_identity(os.getppid()))  # the agent killed hard: its ranks end too
        try:
            taken = acquire(cfg.run.output_dir, Holder.this_process(job, pid=os.getppid(), command="torchrun"))
        except (RunFolderBusy, OSError) as e:
            say(str(e))
            raise SystemExit(2) from None
        if taken.notice:
            say(f"notice: {taken.notice}")
        main_under_torchrun(cfg, spec, after_step, job)
        return
    try:
        code = supervise(cfg, spec, args, sys.argv[1:], after_step)
    except KeyboardInterrupt:  # before the agent took over Ctrl-C (it handles it from then on)
        say("interrupted before training started")
        code = 130
    raise SystemExit(code)
