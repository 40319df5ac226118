"""One job per run folder (:mod:`loongtrain.train.run_lock`): the lock names its holder, a
second job is refused, the processes of one job share it, and a lock whose holder is provably
gone (a killed job, a reused process id) is taken over. Pure file operations, real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from loongtrain.train.run_lock import LOCK_FILE, Holder, RunFolderBusy, acquire, read_holder, release

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process start times come from /proc")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_job_is_refused_naming_the_holder(tmp_path):
    first = Holder.this_process("job-a", command="loongtrain train --config a.toml")
    assert acquire(tmp_path / "run", first) == "taken"
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
    assert acquire(tmp_path, Holder.this_process("job-a", pid=os.getppid())) == "shared"  # another node, a rank
    release(tmp_path, replace(holder, pid=os.getppid()))  # not the holder: kept
    assert (tmp_path / LOCK_FILE).exists()
    release(tmp_path, holder)
    assert not (tmp_path / LOCK_FILE).exists()
    assert acquire(tmp_path, Holder.this_process("job-b")) == "taken"


def test_a_lock_whose_holder_is_gone_is_taken_over(tmp_path):
    dead = Holder.this_process("killed", pid=_dead_pid())
    (tmp_path / LOCK_FILE).write_text(json.dumps(dead.__dict__))
    assert acquire(tmp_path, Holder.this_process("new")) == "taken over"
    assert read_holder(tmp_path).job == "new"
    # a live process id with another start time is a later process that reuses the id
    reused = replace(Holder.this_process("old"), start_time=Holder.this_process("x").start_time - 1)
    (tmp_path / LOCK_FILE).write_text(json.dumps(reused.__dict__))
    assert acquire(tmp_path, Holder.this_process("new")) == "taken over"
    (tmp_path / LOCK_FILE).write_text("{torn")  # a torn write names nobody
    assert acquire(tmp_path, Holder.this_process("new")) == "taken over"


def test_a_holder_on_another_host_is_never_taken_over(tmp_path):
    elsewhere = replace(Holder.this_process("job-a", pid=_dead_pid()), host="node-17")
    (tmp_path / LOCK_FILE).write_text(json.dumps(elsewhere.__dict__))
    with pytest.raises(RunFolderBusy, match=rf"its host node-17 cannot be checked from here\), delete {tmp_path}"):
        acquire(tmp_path, Holder.this_process("job-b"))
