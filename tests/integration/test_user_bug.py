"""A bug in the user's own loss is one line naming their file and line, exit 2, no traceback
(#47 item 5): the check profile made, shared (base/failure.py workload_failed)."""

from __future__ import annotations

from pathlib import Path

import pytest

import turbotrain
from turbotrain.base.errors import TurbotrainError
from turbotrain.cli import main

WORKLOAD = Path(__file__).with_name("loss_bug_workload.py")
WHERE = "(loss_bug_workload.py:18, in float_targets)"


def test_train_says_a_loss_bug_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["train", "--model", f"{WORKLOAD}:make", "--train.max_steps=2", "--no-progress"]
    assert main([*args, "--run.out_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert line.startswith("turbotrain train: error: the model's forward or loss on the example batch: ")
    assert line.endswith(WHERE) and "Traceback" not in err and "FLOPs not counted" not in err


@pytest.mark.parametrize(
    ("command", "said"),
    [
        (["memory"], "turbotrain memory: error: memory --model "),
        (
            ["bench", "--steps", "2"],
            "turbotrain bench: error: bench --model (counting its FLOPs on one batch): the workload failed: ",
        ),
        (  # before any trial's process (#47 item 5): it failed in each, for minutes
            ["tune", "--trials", "2"],
            "turbotrain tune: error: tune --model loss_bug_workload (its loss on one batch): the workload failed: ",
        ),
    ],
)
def test_memory_bench_and_tune_say_a_loss_bug_in_one_line(
    command: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ["--run.out_dir", str(tmp_path)] if command[0] == "tune" else []
    assert main([command[0], "--model", f"{WORKLOAD}:make", *command[1:], *out]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert line.startswith(said) and line.endswith(WHERE) and "Traceback" not in err


def test_the_python_api_raises_the_same_line(tmp_path: Path) -> None:
    with pytest.raises(TurbotrainError) as caught:
        turbotrain.train(f"{WORKLOAD}:make", max_steps=2, progress=False, out_dir=str(tmp_path))
    assert str(caught.value).endswith(WHERE) and "the workload failed: " in str(caught.value)
