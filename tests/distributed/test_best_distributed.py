"""Early stopping and the best checkpoint under ``turbotrain train`` on 2 gloo processes (ddp): both
ranks stop at the same validation pass (rank 0's summary says why), and the best checkpoint is a
sharded folder every rank wrote, kept beside keep_last=1 and read back in one plain process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_torchrun_train import _forked

from turbotrain.loop.best_checkpoint import load_best_weights
from turbotrain.loop.checkpoint import is_verified, list_checkpoints

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = f"{ROOT / 'tests' / 'integration' / 'best_workload.py'}:make"

pytestmark = pytest.mark.slow


def test_two_ddp_ranks_stop_at_the_same_pass_and_keep_a_sharded_best_checkpoint(tmp_path: Path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "turbotrain", "train", "--model", WORKLOAD, "--distributed.strategy=ddp"]
    cmd += ["--run.device=cpu", "--run.out_dir", str(tmp_path), "--run.name=ddp", "--no-progress"]
    cmd += ["--train.max_steps=12", "--train.eval_every=1", "--train.eval_batches=1"]
    cmd += [
        "--train.checkpoint_every=1",
        "--train.keep_last=1",
        "--monitor.log_every=1",
        "--data.num_workers=0",
    ]
    cmd += ["--best.metric=val_score", "--best.mode=max", "--best.min_delta=0.05", "--best.patience=2"]
    cmd += ["--best.checkpoint=true"]
    proc = _forked(cmd, tmp_path / "torchrun")  # torchrun in a fork of this process, its ranks forked
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = tmp_path / "ddp"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["stop_reason"].startswith("early stopping: val_score")
    assert summary["best"]["step"] == 3 and summary["best"]["checkpoint"] == "checkpoints/best/step_00000003"
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_00000005"]
    best = list_checkpoints(run / "checkpoints" / "best")
    assert [p.name for p in best] == ["step_00000003"] and is_verified(best[0])
    path, weights = load_best_weights(run)
    assert path == best[0] and "head.weight" in weights
