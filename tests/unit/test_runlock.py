"""The run lock: one process per run directory; a dead holder's lock is taken over."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from turbotrain.base.runlock import LOCK_FILE, RunInUseError, RunLock

HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_EX)
os.pwrite(fd, f"{os.getpid()}\\n".encode(), 0)
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_second_process_is_refused_with_the_holder_named(tmp_path: Path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / LOCK_FILE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunInUseError, match=f"in use by process {holder.pid}.*kill -TERM {holder.pid}"):
            RunLock(tmp_path).acquire()
    finally:
        holder.communicate("")
    with RunLock(tmp_path) as lock:  # the holder ended: its lock went with it
        assert lock.held


def test_a_dead_holders_lock_is_taken_over_and_the_lock_is_reentrant(tmp_path: Path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(f"{dead.pid}\n")  # what a kill -9 leaves
    caplog.set_level(logging.INFO)
    outer = RunLock(tmp_path).acquire()
    assert f"taking over the lock of process {dead.pid}" in caplog.text
    with RunLock(tmp_path):  # train() inside the CLI's hold
        assert outer.held
    assert outer.held
    outer.release()
    assert not outer.held and (tmp_path / LOCK_FILE).read_text() == ""  # released cleanly: no PID left
