"""Extending a finished run (#47 item 4b): ``--resume --train.max_steps=N`` re-plans the schedule
over the new length and says so in one line, with what the learning rate does; the settings that
line names keep it decaying from where it was instead. Read back from metrics.jsonl's ``lr``."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
from conftest import tiny_overrides

from turbotrain.cli import main


def _train(tmp_path: Path, text_file: Path, *extra: str) -> None:
    o = tiny_overrides(tmp_path, data={"path": str(text_file)}, train={"max_steps": 4, "checkpoint_every": 4})
    args = ["train", "--no-progress", "--monitor.log_every=1"]
    for section, values in o.items():
        args += [f"--{section}.{k}={v}" for k, v in values.items() if k not in ("progress", "log_every")]
    assert main(args + list(extra)) == 0


def _cosine(peak: float, floor: float, progress: float) -> float:
    return floor + (peak - floor) * (1 + math.cos(math.pi * progress)) / 2


def _lrs(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in records if "lr" in r}


@pytest.mark.slow
def test_extending_a_finished_run_says_what_the_lr_does_and_how_to_keep_it_decaying(
    tmp_path: Path, text_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _train(tmp_path, text_file)  # 4 steps: warm-up 2, cosine from 3e-3 to 3e-4 at step 4
    run = tmp_path / "runs" / "t"
    shutil.copytree(run, tmp_path / "copy")
    caplog.set_level("INFO")
    _train(tmp_path, text_file, "--resume", "--train.max_steps=8")
    line = next(r.getMessage() for r in caplog.records if "the cosine schedule now spans" in r.getMessage())
    m = re.fullmatch(
        r"train.max_steps 4 -> 8: the cosine schedule now spans 8 steps: the learning rate goes from "
        r"0.0003 to ([\d.e-]+) at step 5, then decays to 0.0003 at step 8; to keep decaying from 0.0003 "
        r"instead, resume with (--optim.lr=0.0003 --optim.warmup_steps=4 --optim.min_lr=3e-05) "
        r"\(a new peak at this step and a lower floor\)",
        line,
    )
    assert m, line
    lrs = _lrs(run)
    # a record's lr is the next step's: step 5 trains at cosine(2/6) of the new span, as the line says
    assert lrs[4] == pytest.approx(3e-4) and float(m[1]) == pytest.approx(
        _cosine(3e-3, 3e-4, 2 / 6), rel=1e-2
    )
    assert lrs[5] == pytest.approx(_cosine(3e-3, 3e-4, 3 / 6))  # it rose, and decays from there
    # the line's own settings, on the same finished run: from 3e-4 down to 3e-5, never up
    shutil.rmtree(run)
    shutil.copytree(tmp_path / "copy", run)
    caplog.clear()
    _train(tmp_path, text_file, "--resume", "--train.max_steps=8", *m[2].split())
    kept = _lrs(run)
    assert [kept[s] for s in range(5, 9)] == pytest.approx(
        [_cosine(3e-4, 3e-5, (s - 4) / 4) for s in range(5, 9)]
    )
    assert "goes from 0.0003 to 0.0003 at step 5, then decays to 3e-05 at step 8" in caplog.text
