"""An epochs run (``train.epochs``) resumed at another global batch: its place is counted in steps of
the batch it trained at, so such a resume is refused in one line before any step (exit 2, no
traceback, the run untouched); resumed at its own batch it ends where an uninterrupted run ends,
each epoch logged once and every sample of every epoch trained once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from turbotrain.cli import main

CNN = f"{Path(__file__).resolve().parents[2] / 'examples' / 'workload_cnn.py'}:make"
# 2048 images at a global batch of 256: 8 steps per epoch, 24 for 3 epochs (6,144 samples)
RUN = [
    "--train.epochs=3",
    "--batch.micro=256",
    "--train.checkpoint_every=4",
    "--train.eval_batches=1",
    "--monitor.log_every=4",
    "--no-progress",
]


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_an_epochs_run_resumed_at_another_micro_batch_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "e3"
    # stopped in epoch 2, its checkpoint at step 8
    assert (
        main(
            [
                "train",
                "--model",
                CNN,
                *RUN,
                "--run.out_dir",
                str(tmp_path),
                "--run.name=e3",
                "--train.stop_after_steps=11",
            ]
        )
        == 0
    )
    capsys.readouterr()
    config, metrics = (run / "config.toml").read_text(), (run / "metrics.jsonl").read_text()

    assert main(["train", "--resume", str(run), "--batch.micro=128", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert "train.epochs" in err[0] and "global batch of 256" in err[0] and "--batch.micro=256" in err[0], (
        err[0]
    )
    # untouched
    assert (run / "config.toml").read_text() == config and (run / "metrics.jsonl").read_text() == metrics

    # at its own batch it ends where an uninterrupted run ends: 24 steps, each epoch once
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == summary["max_steps"] == 24
    assert [(e["epoch"], e["step"]) for e in _records(run) if e.get("event") == "epoch"] == [
        (1, 8),
        (2, 16),
        (3, 24),
    ]
    assert summary["config"]["batch"]["micro"] == 256  # 24 steps x 256 = 6,144 samples: 3 epochs of 2,048
