"""Stalled-rank detection: heartbeats through the job's key-value store.

Every rank runs a daemon thread that publishes a heartbeat (a counter, the step and the
phase its main thread is in) to the TCPStore the ranks rendezvoused through, every few
seconds and whenever the main thread moves on (the main thread never waits for the
store). When a rank's own main thread has made no progress for ``run.timeout_s``, its
thread takes the job's single "report" ticket from the store, reads every rank's
heartbeat twice, names the rank(s) whose heartbeat stopped (a frozen or dead process), or
else the rank(s) left behind at an earlier step or phase, reports that in one line and
ends its process (after a SIGKILL to a frozen rank on its own node), which makes the
launcher stop the job. The process group's own, longer timeout is only the backstop.

Heartbeats are compared by counter, never by clock, so nodes need not agree on the time.
:func:`describe_stall` is pure and tested without processes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from loongtrain.train.faults import rank_list

EXIT_STALLED = 75  # the exit code of the process that reported a stall


@dataclass(frozen=True)
class Beat:
    """One heartbeat: a counter that grows while the rank's process runs, and what its
    main thread last reported."""

    count: int
    step: int
    phase: str
    host: str = ""
    pid: int = 0


def silentrank_list(before: dict[int, Beat | None], after: dict[int, Beat | None]) -> list[int]:
    """Ranks whose heartbeat did not move between the two snapshots (or never came)."""
    return sorted(r for r in after if after[r] is None or before.get(r) is None or after[r].count == before[r].count)


def describe_stall(before: dict[int, Beat | None], after: dict[int, Beat | None], timeout_s: float) -> str:
    """Name the rank(s) that hold the job up, from two heartbeat snapshots taken a few
    beat intervals apart (None: that rank never published one)."""
    silent = silentrank_list(before, after)
    if silent:
        last = after[silent[0]] or before.get(silent[0])
        where = f"; its last heartbeat was at step {last.step} ({last.phase})" if last else ""
        return (
            f"rank {rank_list(silent)} stopped answering: no heartbeat and no progress for over {timeout_s:g} s "
            f"(the process is frozen, or its node is unreachable){where}"
        )
    beats = {r: b for r, b in after.items() if b is not None}
    exited = sorted(r for r, b in beats.items() if b.phase == "exited")
    if exited:
        return f"rank {rank_list(exited)} left the job while the others waited for it for {timeout_s:g} s"
    lowest = min(b.step for b in beats.values())
    behind = sorted(r for r, b in beats.items() if b.step == lowest)
    if len(behind) < len(beats):
        phase = beats[behind[0]].phase
        return (
            f"rank {rank_list(behind)} stopped making progress at step {lowest} ({phase}) for over {timeout_s:g} s "
            f"while the others reached step {max(b.step for b in beats.values())}"
        )
    phases = {b.phase for b in beats.values()}
    if len(phases) > 1:
        common = max(phases, key=lambda p: sum(b.phase == p for b in beats.values()))
        odd = sorted(r for r, b in beats.items() if b.phase != common)
        return (
            f"rank {rank_list(odd)} stopped making progress at step {lowest} ({beats[odd[0]].phase}) for over "
            f"{timeout_s:g} s while the others waited in {common}"
        )
    return (
        f"no rank made progress for over {timeout_s:g} s, all at step {lowest} ({phases.pop()}): a collective or "
        "the filesystem is stuck"
    )


def connect_store(timeout_s: float) -> dist.Store:
    """A client of the job's TCPStore (``MASTER_ADDR:MASTER_PORT``), keys under a prefix
    of their own for this attempt of the job."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
    )  # fmt: skip
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"loongtrain/watchdog/{attempt}/", store)


def store_host_text() -> str:
    """Who serves the store: torchrun's agent, or the process of rank 0."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return "the launcher's key-value store stopped answering (its node is down or unreachable)"
    return "rank 0 stopped answering (it also serves the job's key-value store, which does not respond)"


def _bounded(fn: Callable, timeout_s: float):
    """``fn()``, or TimeoutError after ``timeout_s``: a TCPStore client waits forever for a
    frozen server (measured with torch 2.13), so every store call of the watchdog runs in
    a daemon thread of its own that may be left behind."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, name="loongtrain-store-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"the job's key-value store did not answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Watchdog:
    """Publish this rank's heartbeat; end the job with a report when it stops progressing.

    ``report(message)`` is called with the diagnosis by the one rank that reports
    (``None`` on the others) just before the process exits with :data:`EXIT_STALLED`.
    """

    def __init__(
        self, store: dist.Store, rank: int, world: int, timeout_s: float, report: Callable[[str | None], None],
        interval_s: float | None = None,
    ) -> None:  # fmt: skip
        self.store, self.rank, self.world = store, rank, world
        self.timeout_s = timeout_s
        self.interval_s = interval_s or min(5.0, max(0.2, timeout_s / 10))
        self.store_timeout_s = min(30.0, max(2.0, timeout_s / 2))
        self.report = report
        self._step, self._phase, self._count = 0, "start", 0
        self._last_progress = time.monotonic()
        self._stop = threading.Event()
        self._moved = threading.Event()  # set by the main thread: publish now
        self._thread = threading.Thread(target=self._run, name="loongtrain-watchdog", daemon=True)
        self._store_host: Beat | None = None  # rank 0's heartbeat when rank 0 serves the store

    def progress(self, step: int, phase: str) -> None:
        """Called by the main thread whenever it moves on (cheap: no communication). A new
        phase is published at once; steps within a phase with the next regular beat (a
        store write per training step would cost a thread and a round trip each)."""
        if phase != self._phase:
            self._moved.set()
        self._step, self._phase = step, phase
        self._last_progress = time.monotonic()

    def start(self) -> Watchdog:
        self._publish()
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            try:
                self._store_host = _bounded(lambda: self._read_beat(0, wait=True), self.store_timeout_s)
            except Exception:  # noqa: BLE001 - only used to end a frozen rank 0 faster
                self._store_host = None
        self._thread.start()
        return self

    def stop(self, phase: str = "exited") -> None:
        """Stop beating; the last heartbeat says ``phase`` (so waiting ranks know this one left)."""
        self._stop.set()
        self._moved.set()
        self._phase = phase
        try:
            self._publish()
        except Exception:  # noqa: BLE001 - the store may already be gone at shutdown
            pass

    def _publish(self) -> None:
        self._count += 1
        beat = json.dumps([self._count, self._step, self._phase, socket.gethostname(), os.getpid()])
        _bounded(lambda: self.store.set(f"beat/{self.rank}", beat), self.store_timeout_s)

    def _read_beat(self, rank: int, wait: bool = False) -> Beat | None:
        key = f"beat/{rank}"
        return Beat(*json.loads(self.store.get(key))) if wait or self.store.check([key]) else None

    def _read(self) -> dict[int, Beat | None]:
        return _bounded(lambda: {r: self._read_beat(r) for r in range(self.world)}, 2 * self.store_timeout_s)

    def _run(self) -> None:
        while True:
            self._moved.wait(self.interval_s)
            self._moved.clear()
            if self._stop.is_set():
                return
            try:
                self._publish()
            except Exception:  # noqa: BLE001 - a store that does not answer is diagnosed below
                pass
            if time.monotonic() - self._last_progress > self.timeout_s and not self._stop.is_set():
                self._stalled()
                return

    def _stalled(self) -> None:
        message, frozen, beats = None, [], {}
        try:
            if _bounded(lambda: self.store.add("report-ticket", 1), self.store_timeout_s) != 1:
                time.sleep(max(30.0, 6 * self.interval_s))  # another rank reports; the launcher ends this one
            else:
                before = self._read()
                time.sleep(3 * self.interval_s)
                self._publish()  # this thread is the one that beats for this rank
                beats = self._read()
                message = describe_stall(before, beats, self.timeout_s)
                frozen = silentrank_list(before, beats)
        except Exception:  # noqa: BLE001 - the store itself does not answer
            message = store_host_text()
            frozen, beats = [0], {0: self._store_host}
        if message is not None:
            message += (
                f". The job was stopped; raise run.timeout_s (now {self.timeout_s:g} s) if a step or checkpoint "
                "legitimately takes longer"
            )
        self.report(message)
        self._end_frozen(frozen, beats)
        os._exit(EXIT_STALLED)

    @staticmethod
    def _end_frozen(ranks: list[int], beats: dict[int, Beat | None]) -> None:
        """SIGKILL the frozen ranks on this host: a stopped process ignores the agent's SIGTERM,
        which would hold the job for the agent's 30 s grace period."""
        here = socket.gethostname()
        for r in ranks:
            beat = beats.get(r)
            if beat is not None and beat.host == here and beat.pid and beat.pid != os.getpid():
                try:
                    os.kill(beat.pid, signal.SIGKILL)
                except OSError:
                    pass
