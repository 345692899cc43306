"""A user's own 2-process DDP script through the Engine exits with status 0: the Engine leaves the
gloo process group at interpreter exit, before the interpreter is torn down. Without it a rank
sometimes ended with "terminate called without an active exception" (SIGABRT) after its last
line, reported by torchrun as that rank's failure (6 of 10 launches of this worker)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import HANG_S

WORKER = Path(__file__).with_name("exit_worker.py")
SRC = Path(__file__).resolve().parents[2] / "src"


def test_an_own_ddp_loop_exits_cleanly_with_its_group_left_at_exit():
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER)],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    assert proc.stdout.count("group left at exit: True") == 2, proc.stdout
