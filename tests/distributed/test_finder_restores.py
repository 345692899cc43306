"""The batch finder's trials train (forward, backward, optimizer step at each size); afterwards the
model must be as before the search. Under expert parallelism the state dict holds gathered copies
of the experts, so copying into it restored nothing: the expert weights kept the trials' updates,
and the router-bias loads the trials counted stayed pending for the first training forward (in
one process too). One process and 2 gloo ranks with the experts sharded (finder_ep_worker.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import inprocess
import pytest
from conftest import HANG_S

WORKER = Path(__file__).with_name("finder_ep_worker.py")
SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.parametrize("mode, nproc", [("single", 1), ("ep", 2)])
def test_the_search_leaves_experts_router_bias_and_loads_as_they_were(tmp_path, mode, nproc):
    out = tmp_path / mode
    if nproc == 1:  # in this process
        inprocess.worker(WORKER, mode, str(out))
    else:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        }
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            str(WORKER),
            mode,
            str(out),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_S)
        assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in range(nproc):
        r = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        # each rank still holds its slice of the 4 experts
        assert r["w1_shape"][0] == (2 if mode == "ep" else 4)
        assert r["changed"] == [] and r["pending"] == [] and r["tallied"] == [] and r["optimizer_state"] == 0
