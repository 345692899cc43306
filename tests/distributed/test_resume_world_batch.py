"""A resume at another world size never changes the global batch unasked (issue 23 item 3).

A 2-rank fsdp run with micro 8 (global 16) stopped with a checkpoint, resumed in one plain
process: one line naming the old and the new global batch and how to keep or accept it, exit 2,
before anything trains (metrics and config.toml unchanged). With ``--batch.global_size=16`` it
trains on (micro 8 x accumulation 2 keeps the global batch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
TINY = ["--run.device=cpu", "--model.n_layer=1", "--model.n_head=2", "--model.d_model=32", "--model.block_size=32",
        "--precision.mode=fp32", "--train.max_steps=6", "--train.checkpoint_every=2", "--train.eval_every=0",
        "--monitor.log_every=1", "--data.num_workers=0", "--monitor.nvml=false", "--no-progress"]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def test_resume_at_another_world_size_keeps_or_refuses_the_global_batch(tmp_path: Path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(400)))
    run = tmp_path / "runs" / "r"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = _run(torchrun + ["-m", "turbotrain", "train", "--data", str(corpus), f"--run.out_dir={tmp_path / 'runs'}",
                            "--run.name=r", f"--data.cache_dir={tmp_path / 'cache'}", "--batch.micro=8",
                            "--distributed.strategy=fsdp", "--train.stop_after_steps=2", *TINY])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "checkpoints" / "step_00000002").is_dir()
    config, metrics = (run / "config.toml").read_bytes(), (run / "metrics.jsonl").read_bytes()

    plain = [sys.executable, "-m", "turbotrain", "train", "--resume", str(run), "--no-progress"]
    refused = _run(plain + ["--distributed.strategy=single"])
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines() == [
        "turbotrain train: error: step_00000002 was trained at a global batch of 16 (2 processes x batch.micro 8 x "
        "accumulation 1) and this resume would train at 8 (1 process x 8 x 1); keep 16 (the same batches) with "
        "--batch.micro=16 or --batch.global_size=16 (by accumulation 2), or train at 8 with --batch.micro=8"]
    assert (run / "config.toml").read_bytes() == config and (run / "metrics.jsonl").read_bytes() == metrics
    assert not list(run.glob(".config.toml.tmp*"))

    kept = _run(plain + ["--distributed.strategy=single", "--batch.global_size=16", "--train.stop_after_steps=0"])
    assert kept.returncode == 0, kept.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == "step_00000002" and summary["steps"] == 6
    assert summary["world_size"] == 1 and summary["resolved"]["global_batch"] == 16
