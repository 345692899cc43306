"""`turbotrain train` with choose.measure: the decision table printed, written to the run
directory and summary.md, the chosen setting in config.toml; `--resume` and the next run of the
same model measure nothing. Real measurements of a tiny GPT, compile left off (explicitly: a
setting the user gives is not a candidate) so only the eager precisions are timed."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import tiny_overrides

from turbotrain import load_config
from turbotrain.cli import main


def _args(tmp_path: Path, text_file: Path, name: str, *extra: str) -> list[str]:
    o = tiny_overrides(tmp_path, data={"path": str(text_file)}, run={"name": name})
    args = ["train", "--no-progress"]
    for section, values in o.items():
        values = {k: v for k, v in values.items() if k != "progress"}
        args += [f"--{section}.{k}={v}" for k, v in values.items()]
    return args + [
        "--compile.scope=off",
        "--choose.measure=always",
        "--choose.steps=3",
        "--choose.warmup=1",
        *extra,
    ]


def test_train_chooses_by_measurement_and_reuses_the_choice(tmp_path, text_file, capsys):
    assert main(_args(tmp_path, text_file, "a", "--train.stop_after_steps=3")) == 0
    out = capsys.readouterr().out
    assert (
        "choose: measuring eager (plain eager, fp32)" in out and "choose: measuring eager bf16-mixed" in out
    )
    assert "| candidate | recipe | step ms |" in out
    run = tmp_path / "runs" / "a"
    decision = json.loads((run / "choose.json").read_text())
    names = [r["name"] for r in decision["rows"]]
    assert names == ["eager", "eager bf16-mixed"] and decision["measured"]
    kept = [r for r in decision["rows"] if r["status"] == "kept"]
    assert len(kept) == 1 and all(r["step_ms"] > 0 for r in decision["rows"])
    # what was kept is what the run trained with, and what config.toml says
    mode = kept[0]["changes"]["precision"]["mode"]
    assert load_config(str(run / "config.toml")).precision.mode == mode
    assert json.loads((run / "summary.json").read_text())["resolved"]["precision"] == mode
    assert "## Settings chosen by measurement" in (run / "summary.md").read_text()
    # --resume trains on with the choice, measuring nothing
    assert main(["train", "--no-progress", "--resume", str(run)]) == 0
    assert "choose:" not in capsys.readouterr().out
    # (the next run of the same model reusing the measurements: tests/unit/test_choose.py)
