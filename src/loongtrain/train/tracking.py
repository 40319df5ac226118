"""Experiment trackers beside ``metrics.jsonl``: Weights & Biases and MLflow (the ``[metrics]``
section), behind one small interface as torchtitan keeps its W&B and TensorBoard loggers.

Rank 0 only (the :class:`~loongtrain.train.report.Reporter` owns them). Each tracker runs on a
thread of its own: the connection at start-up is waited for at most ``metrics.connect_timeout_s``
(all trackers at once), and a service that does not answer by then, or fails, is left out with
one warning; afterwards every record, image and table is queued to that thread, so a slow or
vanished service never slows a step (a full queue drops records, with one warning). The names
are ``metrics.jsonl``'s: a record ``{"kind": K, "step": S, KEY: value}`` becomes ``K/KEY`` at step
``S`` (``train/loss``, ``eval/loss/code``, ``long_context/needle_accuracy``), as in TensorBoard.

The tracked runs' ids are kept in ``<run>/tracking.json``: a resumed run continues the same
tracked runs, and a new stage (``checkpoint.init_from``) records the runs it started from.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from loongtrain.train.faults import exception_line

TRACKING_FILE = "tracking.json"
QUEUE_SIZE = 10_000  # records waiting for a tracker; past it they are dropped (one warning)
CLOSE_TIMEOUT_S = 30.0  # the longest wait at the end for a tracker to send what is queued


class Tracker(Protocol):
    """One experiment tracker: started once (may block: it runs on its own thread), then fed."""

    name: str

    def start(self) -> dict:
        """Connect and open the tracked run; returns what ``tracking.json`` keeps of it (its id)."""

    def log(self, step: int, numbers: dict[str, float], texts: dict[str, str]) -> None:
        """Scalars (and, where the tracker takes them, text values) at ``step``."""

    def image(self, key: str, path: Path, step: int) -> None:
        """A PNG file under ``key``."""

    def table(self, key: str, columns: list[str], rows: list[list]) -> None:
        """A table of rows."""

    def finish(self, failed: bool) -> None:
        """Close the tracked run (marked failed when the training run ended with an error)."""


# -- what a record becomes ---------------------------------------------------------------


def tracked_values(record: dict) -> tuple[int, dict[str, float], dict[str, str]]:
    """A ``metrics.jsonl`` record as ``(step, numbers, texts)`` under ``KIND/KEY`` names:
    finite numbers (booleans as 0/1) and non-empty strings; ``null`` and NaN are left out.
    A guard mark (``"skipped: non-finite loss"``, ``"spike"``, ``"stalled since step N"``) also
    counts as a number, ``KIND/guard/skipped``, ``/spike`` or ``/stalled`` = 1, for trackers that
    take numbers only."""
    kind, step = record.get("kind", "train"), int(record["step"])
    numbers: dict[str, float] = {}
    texts: dict[str, str] = {}
    for key, value in record.items():
        if key in ("kind", "step"):
            continue
        name = f"{kind}/{key}"
        if isinstance(value, bool):
            numbers[name] = float(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            numbers[name] = float(value)
        elif isinstance(value, str) and value:
            texts[name] = value
        elif isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
            texts[name] = json.dumps(value)
    guard = record.get("guard")
    if isinstance(guard, str) and guard:
        mark = next((m for m in ("skipped", "stalled") if guard.startswith(m)), "spike")
        numbers[f"{kind}/guard/{mark}"] = 1.0
    return step, numbers, texts


def config_params(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as flat ``section.key`` -> text (MLflow's parameters)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(config_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


def read_tracking(run_dir: Path) -> dict:
    """``<run>/tracking.json`` (the tracked runs' ids), or {} when there is none."""
    try:
        data = json.loads((run_dir / TRACKING_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_tracking(run_dir: Path, data: dict) -> None:
    tmp = run_dir / (TRACKING_FILE + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(run_dir / TRACKING_FILE)


# -- the trackers --------------------------------------------------------------------------


class WandbTracker:
    """Weights & Biases: project, entity, mode and key from its own settings and environment
    (``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_MODE=offline``, ``WANDB_API_KEY``); offline
    runs are written under ``<run>/wandb/``. ``step`` is the x axis of every chart (so a resumed
    run's re-trained steps and a rollback's do not break W&B's increasing internal step)."""

    name = "W&B"

    def __init__(self, *, run_dir: Path, project: str, run_name: str, tags: list[str], config: dict,
                 resume_id: str | None, stage_of: dict | None, timeout_s: float) -> None:  # fmt: skip
        self.run_dir, self.project, self.run_name, self.tags = run_dir, project, run_name, tags
        self.config, self.resume_id, self.stage_of, self.timeout_s = config, resume_id, stage_of, timeout_s
        self._run: Any = None

    def start(self) -> dict:
        import wandb

        config = dict(self.config)
        if self.stage_of:
            config["stage_of"] = self.stage_of  # the run folder and tracked runs this stage started from
        self._run = wandb.init(
            project=self.project or os.environ.get("WANDB_PROJECT") or "loongtrain",
            name=self.run_name, tags=self.tags or None, config=config, dir=str(self.run_dir),
            id=self.resume_id, resume="allow" if self.resume_id else None,
            settings=wandb.Settings(init_timeout=self.timeout_s, console="off", quiet=True),
        )  # fmt: skip
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        url = getattr(self._run, "url", None)
        return {"id": self._run.id, "project": self._run.project, "entity": self._run.entity, "url": url}

    def log(self, step: int, numbers: dict[str, float], texts: dict[str, str]) -> None:
        self._run.log({"step": step, **numbers, **texts})

    def image(self, key: str, path: Path, step: int) -> None:
        import wandb

        self._run.log({"step": step, key: wandb.Image(str(path))})

    def table(self, key: str, columns: list[str], rows: list[list]) -> None:
        import wandb

        self._run.log({key: wandb.Table(columns=columns, data=rows)})

    def finish(self, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)


def default_mlflow_uri(run_dir: Path) -> str:
    """The MLflow store when neither ``metrics.mlflow_tracking_uri`` nor ``MLFLOW_TRACKING_URI``
    names one: a SQLite file in the run folder."""
    return f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


class MlflowTracker:
    """MLflow through its client (``MlflowClient``): a server (``http://...``; ``MLFLOW_TRACKING_TOKEN``
    and the other ``MLFLOW_*`` variables apply) or a local ``sqlite:///`` store. Metrics by
    ``log_batch``, the config as parameters and ``config.toml``, images and tables as artifacts."""

    name = "MLflow"

    def __init__(self, *, run_dir: Path, uri: str, experiment: str, run_name: str, tags: list[str],
                 config: dict, config_toml: str, resume_id: str | None, stage_of: dict | None) -> None:  # fmt: skip
        self.run_dir, self.uri, self.experiment, self.run_name = run_dir, uri, experiment, run_name
        self.tags, self.config, self.config_toml = tags, config, config_toml
        self.resume_id, self.stage_of = resume_id, stage_of
        self._client: Any = None
        self.run_id = ""

    def start(self) -> dict:
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "loongtrain"
        found = client.get_experiment_by_name(name)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            location = None  # a server's (or a file store's) own
            if self.uri.startswith("sqlite:///"):  # beside the database (MLflow's default is the working directory)
                location = (Path(self.uri[len("sqlite:///") :]).parent / "mlflow-artifacts").resolve().as_uri()
            experiment_id = client.create_experiment(name, artifact_location=location)
        if self.resume_id:
            client.update_run(self.resume_id, status="RUNNING")
            self.run_id = self.resume_id
        else:
            tags = {f"tag.{t}": "" for t in self.tags} | {"loongtrain.run_folder": str(self.run_dir.resolve())}
            if self.stage_of:
                tags |= {f"loongtrain.stage_of.{k}": str(v) for k, v in self.stage_of.items() if v}
            run = client.create_run(experiment_id, run_name=self.run_name, tags=tags)
            self.run_id = run.info.run_id
            params = [Param(k, v[:6000]) for k, v in config_params(self.config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
                client.log_batch(self.run_id, params=params[i : i + 100])
            if self.tags:
                client.log_batch(self.run_id, tags=[RunTag(t, "") for t in self.tags])
        self._client = client
        client.log_text(self.run_id, self.config_toml, "config.toml")
        return {"run_id": self.run_id, "experiment_id": experiment_id, "tracking_uri": self.uri}

    def log(self, step: int, numbers: dict[str, float], texts: dict[str, str]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in numbers.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a call
            self._client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def image(self, key: str, path: Path, step: int) -> None:
        self._client.log_artifact(self.run_id, str(path), artifact_path=f"{key}/step-{step}")

    def table(self, key: str, columns: list[str], rows: list[list]) -> None:
        self._client.log_dict(self.run_id, {"columns": columns, "data": rows}, f"{key}.json")

    def finish(self, failed: bool) -> None:
        self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


# -- running them off the training thread ----------------------------------------------------


class _Worker:
    """A tracker on its own daemon thread: :meth:`Tracker.start`, then the queued calls."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.started = threading.Event()
        self.info: dict | None = None
        self.error: str | None = None
        self.dropped = False
        self.abandoned = False
        self._lock = threading.Lock()  # start's end and the decision to wait no longer
        self._queue: queue.Queue = queue.Queue(QUEUE_SIZE)
        self._thread = threading.Thread(target=self._main, name=f"loongtrain-{tracker.name}", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        info = error = None
        try:
            info = self.tracker.start()
        except Exception as e:  # noqa: BLE001 - a tracker must never stop training
            error = exception_line(e)[:300]
        with self._lock:
            late = self.abandoned
            self.info, self.error = (None, error) if late else (info, error)
            self.started.set()
        if late and info is not None:  # answered after the wait: close the tracked run it opened
            try:
                self.tracker.finish(True)
            except Exception:  # noqa: BLE001
                pass
        if self.info is None:
            return
        while True:
            call = self._queue.get()
            if call is None:
                break
            try:
                call()
            except Exception as e:  # noqa: BLE001
                if self.error is None:
                    self.error = exception_line(e)[:300]
                    warnings.warn(f"{self.tracker.name}: {self.error}; the metrics are still in metrics.jsonl",
                                  stacklevel=1)  # fmt: skip

    def give_up_unless_started(self) -> bool:
        """After the wait: True if started; otherwise it is abandoned (a late start is closed)."""
        with self._lock:
            if self.info is None:
                self.abandoned = True
            return self.info is not None

    @property
    def live(self) -> bool:
        return self.info is not None  # an abandoned start never sets it

    def submit(self, call: Callable[[], None]) -> None:
        if not self.live:
            return
        try:
            self._queue.put_nowait(call)
        except queue.Full:
            self.dropped = True

    def close(self, failed: bool, timeout_s: float) -> bool:
        """Send what is queued and close the tracked run, waiting at most ``timeout_s``; True if done."""
        if not self.live:
            return True
        for call in (lambda: self.tracker.finish(failed), None):  # never blocks: a full queue drops its oldest
            while True:
                try:
                    self._queue.put_nowait(call)
                    break
                except queue.Full:
                    try:
                        self._queue.get_nowait()
                        self.dropped = True
                    except queue.Empty:
                        pass
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


class Trackers:
    """The run's trackers (none, W&B, MLflow or both), started at once and fed from the loop."""

    def __init__(self, run_dir: Path, trackers: list[Tracker], timeout_s: float,
                 say: Callable[[str], None] = print) -> None:  # fmt: skip
        self.run_dir, self._say = run_dir, say
        self._workers = [_Worker(t) for t in trackers]
        deadline = time.monotonic() + timeout_s
        for w in self._workers:
            w.started.wait(max(0.0, deadline - time.monotonic()))
        self.lines = []
        kept = read_tracking(run_dir)
        for w in self._workers:
            if w.give_up_unless_started():
                kept[_key(w.tracker)] = w.info
                where = w.info.get("url") or w.info.get("tracking_uri") or ""
                ident = w.info.get("id") or w.info.get("run_id")
                self.lines.append(f"{w.tracker.name} run {ident}" + (f" ({where})" if where else ""))
                continue
            why = w.error or f"no answer within metrics.connect_timeout_s={timeout_s:g} s"
            self._say(
                f"warning: {w.tracker.name} is left out of this run ({why}); training goes on and the metrics are "
                f"still in {run_dir / 'metrics.jsonl'}"
            )
        if any(w.live for w in self._workers):
            _write_tracking(run_dir, kept)

    @property
    def status(self) -> str:
        """The start-up line's part: which tracked runs receive the metrics."""
        return "; ".join(self.lines)

    def log(self, record: dict) -> None:
        step, numbers, texts = tracked_values(record)
        for w in self._workers:
            w.submit(lambda t=w.tracker: t.log(step, numbers, texts))

    def image(self, key: str, path: Path, step: int) -> None:
        for w in self._workers:
            w.submit(lambda t=w.tracker: t.image(key, path, step))

    def table_from(self, key: str, make: Callable[[], tuple[list[str], list[list]]]) -> None:
        """A table that ``make`` builds, on the trackers' threads (once; it may take a while)."""
        made: list = []
        lock = threading.Lock()

        def send(tracker: Tracker) -> None:
            with lock:
                if not made:
                    made.append(make())
            tracker.table(key, *made[0])

        for w in self._workers:
            w.submit(lambda t=w.tracker: send(t))

    def close(self, failed: bool = False) -> None:
        for w in self._workers:
            done = w.close(failed, CLOSE_TIMEOUT_S)
            if w.dropped:
                self._say(f"warning: {w.tracker.name} fell behind and some records were not sent to it; "
                          f"metrics.jsonl holds them all")  # fmt: skip
            if not done:
                self._say(f"warning: {w.tracker.name} did not finish sending within {CLOSE_TIMEOUT_S:g} s; "
                          f"metrics.jsonl holds every record")  # fmt: skip
        self._workers = []


def _key(tracker: Tracker) -> str:
    return "wandb" if isinstance(tracker, WandbTracker) else "mlflow"


def open_trackers(options: Any, run_dir: Path, config: dict, config_toml: str, stage_from: Path | None = None,
                  say: Callable[[str], None] = print) -> Trackers:  # fmt: skip
    """The trackers that ``options`` (the ``[metrics]`` section) turns on, started (at most
    ``options.connect_timeout_s``). A run folder with ``tracking.json`` continues its tracked
    runs; ``stage_from`` (a checkpoint of another run) names the tracked runs it started from."""
    kept = read_tracking(run_dir)
    stage_of = None
    if stage_from is not None:
        source_run = stage_from.parent.parent  # <run>/checkpoints/step-N
        before = read_tracking(source_run)
        stage_of = {"run_folder": str(source_run.resolve()), "checkpoint": str(stage_from),
                    "wandb_id": before.get("wandb", {}).get("id"),
                    "mlflow_run_id": before.get("mlflow", {}).get("run_id")}  # fmt: skip
    name = options.run_name or run_dir.resolve().name
    tags = [t.strip() for t in options.tags.split(",") if t.strip()]
    trackers: list[Tracker] = []
    if options.wandb:
        trackers.append(WandbTracker(
            run_dir=run_dir, project=options.wandb_project, run_name=name, tags=tags, config=config,
            resume_id=kept.get("wandb", {}).get("id"), stage_of=stage_of, timeout_s=options.connect_timeout_s,
        ))  # fmt: skip
    if options.mlflow:
        uri = options.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_mlflow_uri(run_dir)
        previous = kept.get("mlflow", {})
        resume = previous.get("run_id") if previous.get("tracking_uri") == uri else None
        trackers.append(MlflowTracker(
            run_dir=run_dir, uri=uri, experiment=options.mlflow_experiment, run_name=name, tags=tags,
            config=config, config_toml=config_toml, resume_id=resume, stage_of=stage_of,
        ))  # fmt: skip
    return Trackers(run_dir, trackers, options.connect_timeout_s, say)


def missing_packages(options: Any) -> str | None:
    """What the ``[metrics]`` section turns on but is not installed (one line), or None."""
    import importlib.util

    if options.wandb and importlib.util.find_spec("wandb") is None:
        return "metrics.wandb=true needs the wandb package: pip install 'loongtrain[wandb]' (or metrics.wandb=false)"
    if options.mlflow and importlib.util.find_spec("mlflow") is None:
        return "metrics.mlflow=true needs MLflow: pip install 'loongtrain[mlflow]' (or metrics.mlflow=false)"
    uri = options.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:"
    if options.mlflow and uri.startswith("sqlite:") and importlib.util.find_spec("sqlalchemy") is None:
        return (
            f"metrics.mlflow=true with the store {uri!r} needs sqlalchemy and alembic: pip install "
            f"'loongtrain[mlflow]', or set metrics.mlflow_tracking_uri to a server (http://...)"
        )
    return None
