"""choose weighs its measuring against the run's resolved length (#47 item 2): a ``--model`` run
by ``train.epochs`` is as long as its epochs make it on its data, not the default ``max_steps``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from turbotrain.cli import main

WORKLOAD = Path(__file__).with_name("rows_workload.py")


def test_choose_reads_the_length_train_epochs_resolve_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TT_ROWS_FILE", str(tmp_path / "rows.jsonl"))
    caplog.set_level(logging.DEBUG, logger="turbotrain")
    args = ["train", "--model", f"{WORKLOAD}:shuffled", "--train.epochs=2", "--batch.micro=6"]
    args += ["--data.num_workers=0", "--no-progress", "--run.out_dir", str(tmp_path), "--run.name=r"]
    assert main(args) == 0
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("choose:")]
    # 20 rows at 6 a step: 3 steps per epoch, 6 in all (the default max_steps is 300)
    assert len(said) == 1 and "the run's 6 steps are too few" in said[0], said
    assert said[0] == f"choose: {json.loads((tmp_path / 'r' / 'choose.json').read_text())['summary']}"
    assert any(
        "train.epochs = 2: 3 optimizer steps per epoch, 6 in all" in r.getMessage() for r in caplog.records
    )
