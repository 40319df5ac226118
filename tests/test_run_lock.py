"""One job per run folder (:mod:`loongtrain.train.run_lock`): the lock names its holder, a
second job is refused, the processes of one job share it, and a lock whose holder is provably
gone (a killed job, a reused process id) is taken over, but only once the workers registered
in it are gone too; workers end with their launcher (:func:`loongtrain.local_workers.die_with`).
Pure file operations, real processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from fault_tools import alive
from loongtrain.local_workers import launcher_identity, process_start_time
from loongtrain.train.run_lock import (
    LOCK_FILE,
    Holder,
    RunFolderBusy,
    Worker,
    acquire,
    read_holder,
    register_worker,
    release,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process start times come from /proc")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_job_is_refused_naming_the_holder(tmp_path):
    first = Holder.this_process("job-a", command="loongtrain train --config a.toml")
    assert acquire(tmp_path / "run", first).how == "taken"
    assert read_holder(tmp_path / "run") == first
    with pytest.raises(RunFolderBusy) as e:
        acquire(tmp_path / "run", Holder.this_process("job-b"))
    text = str(e.value)
    assert f"is in use by job job-a (process {os.getpid()} on {first.host}, since {first.since})" in text
    assert "loongtrain train --config a.toml" in text and "choose another run.output_dir" in text
    assert "delete" not in text  # the holder is on this host and alive: nothing to clear by hand
    assert read_holder(tmp_path / "run") == first  # the refused job changed nothing


def test_the_processes_of_one_job_share_it_and_only_the_holder_releases_it(tmp_path):
    holder = Holder.this_process("job-a")
    acquire(tmp_path, holder)
    assert acquire(tmp_path, Holder.this_process("job-a", pid=os.getppid())).how == "shared"  # another node, a rank
    release(tmp_path, replace(holder, pid=os.getppid()))  # not the holder: kept
    assert (tmp_path / LOCK_FILE).exists()
    release(tmp_path, holder)
    assert not (tmp_path / LOCK_FILE).exists()
    assert acquire(tmp_path, Holder.this_process("job-b")).how == "taken"


def test_a_lock_whose_holder_is_gone_is_taken_over(tmp_path):
    dead = Holder.this_process("killed", pid=_dead_pid())
    (tmp_path / LOCK_FILE).write_text(json.dumps(dead.__dict__))
    taken = acquire(tmp_path, Holder.this_process("new"))
    assert taken.how == "taken over"
    assert taken.notice == (
        f"took over {tmp_path / LOCK_FILE} from a job that is gone (job killed, process {dead.pid} on {dead.host}, "
        f"since {dead.since})"
    )
    assert read_holder(tmp_path).job == "new"
    # a live process id with another start time is a later process that reuses the id
    reused = replace(Holder.this_process("old"), start_time=Holder.this_process("x").start_time - 1)
    (tmp_path / LOCK_FILE).write_text(json.dumps(reused.__dict__))
    assert acquire(tmp_path, Holder.this_process("new")).how == "taken over"
    (tmp_path / LOCK_FILE).write_text("{torn")  # a torn write names nobody
    taken = acquire(tmp_path, Holder.this_process("new"))
    assert (taken.how, taken.notice) == ("taken over", f"took over {tmp_path / LOCK_FILE}, which names no job: "
                                         "not a JSON record (a torn write?)")  # fmt: skip


def test_a_holder_on_another_host_is_never_taken_over(tmp_path):
    elsewhere = replace(Holder.this_process("job-a", pid=_dead_pid()), host="node-17")
    (tmp_path / LOCK_FILE).write_text(json.dumps(elsewhere.__dict__))
    with pytest.raises(RunFolderBusy, match=rf"its host node-17 cannot be checked from here\), delete {tmp_path}"):
        acquire(tmp_path, Holder.this_process("job-b"))


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def test_workers_register_in_the_lock_of_their_job(tmp_path):
    holder = Holder.this_process("job-a")
    acquire(tmp_path, holder)
    sleeper = _sleeper()
    try:
        live = Worker(socket.gethostname(), sleeper.pid, process_start_time(sleeper.pid))
        dead = Worker(socket.gethostname(), _dead_pid(), None)
        remote = Worker("node-17", _dead_pid(), 5)  # cannot be checked from here: kept
        for worker in (dead, remote, live):
            register_worker(tmp_path, "job-a", worker)
        register_worker(tmp_path, "job-a")  # this process, after a restart: the dead worker of this host is dropped
        assert read_holder(tmp_path) == replace(holder, workers=(remote, live, Worker.this_process()))
        with pytest.raises(RunFolderBusy, match=r"no longer held by this job \(job-b\)"):
            register_worker(tmp_path, "job-b")  # the lock names another job: never written beside it
        release(tmp_path, holder)
        with pytest.raises(RunFolderBusy, match="was removed or replaced while the job started"):
            register_worker(tmp_path, "job-a")
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_lock_is_taken_over_only_when_the_holder_and_its_workers_here_are_gone(tmp_path):
    """The holder killed alone (``kill -9`` of the launcher): a worker that still runs keeps the
    folder, and the refusal names it; a worker on another host is not waited for."""
    sleeper = _sleeper()
    try:
        worker = Worker(socket.gethostname(), sleeper.pid, process_start_time(sleeper.pid))
        gone = replace(
            Holder.this_process("killed", pid=_dead_pid()), workers=(Worker("node-17", 4242, 5), worker)
        )  # fmt: skip
        (tmp_path / LOCK_FILE).write_text(json.dumps({**gone.__dict__, "workers": [w.__dict__ for w in gone.workers]}))
        assert read_holder(tmp_path) == gone
        with pytest.raises(RunFolderBusy) as e:
            acquire(tmp_path, Holder.this_process("new"))
        text = str(e.value)
        print(f"\n{text}")
        assert f"is in use by worker process(es) {sleeper.pid} of job killed" in text
        assert f"stop them (kill {sleeper.pid})" in text
        assert read_holder(tmp_path) == gone  # refused: nothing changed
    finally:
        sleeper.kill()
        sleeper.wait()
    assert acquire(tmp_path, Holder.this_process("new")).how == "taken over"


# a worker: bound to the launcher named by argv[1], then it waits to be ended
_WORKER = (
    "import sys, time\n"
    "from loongtrain.local_workers import die_with\n"
    "die_with(sys.argv[1])\n"
    "print('armed', flush=True)\n"
    "time.sleep(60)\n"
)
# a fork server: starts a worker bound to argv[1] as its own child, says its pid, then waits
_SERVER = (
    "import subprocess, sys, time\n"
    "w = subprocess.Popen([sys.executable, '-c', sys.argv[2], sys.argv[1]], stdout=subprocess.PIPE, text=True)\n"
    "w.stdout.readline()\n"
    "print(w.pid, flush=True)\n"
    "time.sleep(60)\n"
)


def _gone_within(pid: int, seconds: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if not alive(pid):
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


def test_a_worker_ends_when_its_launcher_is_killed(tmp_path):
    """The watchdog (the worker's parent, this test, lives on) and the parent-death signal (its
    parent, a fork server, is killed; the launcher, this test, lives on): each alone ends it."""
    launcher = _sleeper()
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, launcher_identity(launcher.pid)], stdout=subprocess.PIPE)
    try:
        assert worker.stdout.readline().strip() == b"armed"
        launcher.kill()
        launcher.wait()
        worker.wait(timeout=5)
        assert worker.returncode == -signal.SIGKILL  # ended by its watchdog, within one poll
    finally:
        worker.kill()
        launcher.kill()
        launcher.wait()
    # a launcher already gone when the worker starts: it ends at once
    late = subprocess.run([sys.executable, "-c", _WORKER, launcher_identity(launcher.pid)], capture_output=True)
    assert late.returncode == -signal.SIGKILL and late.stdout == b""

    server = subprocess.Popen([sys.executable, "-c", _SERVER, launcher_identity(), _WORKER], stdout=subprocess.PIPE)
    try:
        worker_pid = int(server.stdout.readline())
        server.kill()
        server.wait()
        seconds = _gone_within(worker_pid, 5)
        print(f"\nworker gone {seconds} s after its parent was killed")
        assert seconds is not None, "the worker outlived its parent"
    finally:
        server.kill()
        server.wait()
        if alive(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("record", "problem"),
    [
        ({"pid": "abc"}, 'the record\'s pid "abc" is a string, not an integer'),
        ({"pid": True}, "the record's pid true is a boolean, not an integer"),
        ({"pid": 12.0}, "the record's pid 12.0 is a number, not an integer"),
        ({"pid": 2**63}, f"the record's pid {2**63} is no process id (1 to {2**22})"),
        ({"pid": 2**31}, f"the record's pid {2**31} is no process id (1 to {2**22})"),
        ({"pid": 2**22 + 1}, f"the record's pid {2**22 + 1} is no process id (1 to {2**22})"),
        ({"pid": -5}, f"the record's pid -5 is no process id (1 to {2**22})"),
        ({"start_time": "x"}, 'the record\'s start_time "x" is a string, not an integer or null'),
        ({"start_time": 2**64}, f"the record's start_time {2**64} is out of range"),
        ({"host": ["vm"]}, 'the record\'s host ["vm"] is an array, not a string'),
        ({"job": None}, "the record's job null is null, not a string"),
        ({"command": 7}, "the record's command 7 is an integer, not a string"),
        ({"workers": {"pid": 1}}, 'the record\'s workers {"pid": 1} is an object, not an array'),
        (
            {"workers": [{"host": "vm", "pid": "1", "start_time": None}]},
            'worker 0\'s pid "1" is a string, not an integer',
        ),
        ({"workers": [{"host": "vm"}]}, "worker 0 has no pid, start_time"),
        ({"workers": [3]}, "worker 0 is an integer, not an object"),
    ],
)
def test_a_malformed_lock_is_taken_over_with_a_notice_saying_what_is_wrong(tmp_path, record, problem):
    """A hand-edited ``run.lock``: each malformed form names nobody (no traceback); it is taken
    over, and the notice says what was wrong with it."""
    good = {**Holder.this_process("edited").__dict__, "workers": []}
    (tmp_path / LOCK_FILE).write_text(json.dumps({**good, **record}))
    assert read_holder(tmp_path) is None
    release(tmp_path, Holder.this_process("edited"))  # names nobody: nothing released, nothing raised
    taken = acquire(tmp_path, Holder.this_process("new"))
    assert (taken.how, taken.notice) == (
        "taken over",
        f"took over {tmp_path / LOCK_FILE}, which names no job: {problem}",
    )
    assert read_holder(tmp_path).job == "new"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[1, 2]", "the record is an array, not an object"),
        ("null", "the record is null, not an object"),
        ('{"pid": 5}', "the record has no host, start_time, since, job"),
        ("", "not a JSON record (a torn write?)"),
        ("\xff\xfe", "cannot be read: 'utf-8' codec can't decode byte 0xff in position 0: invalid start byte"),
    ],
)
def test_a_lock_that_is_no_record_is_taken_over_with_a_notice(tmp_path, text, problem):
    (tmp_path / LOCK_FILE).write_bytes(text.encode("latin-1"))
    taken = acquire(tmp_path, Holder.this_process("new"))
    assert (taken.how, taken.notice) == (
        "taken over",
        f"took over {tmp_path / LOCK_FILE}, which names no job: {problem}",
    )
