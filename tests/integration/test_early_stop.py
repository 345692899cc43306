"""Early stopping and the best checkpoint (``[best]``) on the example CNN through ``turbotrain train
--model``: the run ends at the evaluation where the metric has not improved for ``patience``
passes, says so in its summary, and keeps the best evaluation's checkpoint beside keep_last=1; a
run stopped before and resumed ends at the same evaluation with the same best."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import shutil
import signal
from pathlib import Path

import inprocess
import pytest
import torch
from conftest import HANG_S

from turbotrain.cli import main
from turbotrain.loop.best_checkpoint import BEST_FILE, best_folder, load_best_weights
from turbotrain.loop.checkpoint import is_verified, list_checkpoints, load_latest_weights

WORKLOAD = f"{Path(__file__).resolve().parent / 'best_workload.py'}:make"
ARGS = [
    "--model",
    WORKLOAD,
    "--train.max_steps=12",
    "--train.eval_every=1",
    "--train.eval_batches=1",
    "--train.checkpoint_every=1",
    "--train.keep_last=1",
    "--monitor.log_every=1",
    "--best.metric=val_score",
    "--best.mode=max",
    "--best.min_delta=0.05",
    "--best.patience=2",
    "--best.checkpoint=true",
    "--no-progress",
]
REASON = "early stopping: val_score did not improve on 0.6 (step 3) by more than 0.05 in 2 validation passes"


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


@pytest.fixture(scope="module")
def early_stopped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The ARGS run, which early stopping ends at step 5, trained once for the tests that read it
    (a test that resumes it resumes a copy): its run directory and what it printed."""
    out = tmp_path_factory.mktemp("early")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["train", *ARGS, "--run.out_dir", str(out), "--run.name=full"]) == 0
    return out / "full", printed.getvalue()


def test_early_stopping_ends_the_cnn_at_the_right_evaluation_and_keeps_the_best_checkpoint(
    tmp_path: Path, early_stopped: tuple[Path, str]
):
    out = ["--run.out_dir", str(tmp_path)]
    full, printed = early_stopped
    # the closing lines show the best pass and its checkpoint, not only the last pass (#47 item 8)
    best = f"  best val_score 0.6000 at step 3 (max); checkpoint {full / 'checkpoints/best/step_00000003.pt'}"
    assert best in printed.splitlines()
    summary = _summary(full)
    # passes at steps 1, 2, 3 improve; 4 (0.6) and 5 (0.64 < 0.6 + 0.05) do not: patience 2 ends it at 5
    assert (summary["status"], summary["steps"], summary["stop_reason"]) == ("stopped", 5, REASON)
    assert summary["best"] == {
        "metric": "val_score",
        "mode": "max",
        "value": 0.6000000238418579,  # the float32 mean Evaluate read
        "step": 3,
        "checkpoint": "checkpoints/best/step_00000003.pt",
    }
    assert "early stopping: val_score" in (full / "summary.md").read_text()
    assert "checkpoints/best/step_00000003.pt" in (full / "summary.md").read_text()
    # keep_last=1 pruned every other step's checkpoint; the best one survives beside it and verifies
    assert [p.name for p in list_checkpoints(full / "checkpoints")] == ["step_00000005.pt"]
    best = list_checkpoints(full / "checkpoints" / "best")
    assert [p.name for p in best] == ["step_00000003.pt"] and is_verified(best[0])

    # the run stopped after step 3 (same schedule) holds step 3's weights: the best checkpoint is them
    assert main(["train", *ARGS, *out, "--run.name=split", "--train.stop_after_steps=3"]) == 0
    _, at_3 = load_latest_weights(tmp_path / "split" / "checkpoints")
    path, weights = load_best_weights(full)
    assert path.name == "step_00000003.pt" and weights.keys() == at_3.keys()
    assert all(torch.equal(weights[k], at_3[k]) for k in weights)
    _, at_5 = load_latest_weights(full / "checkpoints")
    assert not all(torch.equal(weights[k], at_5[k]) for k in weights)
    spec = importlib.util.spec_from_file_location(
        "workload_cnn", Path(__file__).parents[2] / "examples/workload_cnn.py"
    )
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.SmallCNN().load_state_dict(weights)  # the example's own model takes them as they are

    # resumed, it ends at the evaluation the uninterrupted run ended at, with the same best
    assert main(["train", "--resume", str(tmp_path / "split"), "--no-progress"]) == 0
    resumed = _summary(tmp_path / "split")
    assert (resumed["steps"], resumed["stop_reason"], resumed["best"]) == (5, REASON, summary["best"])


NAN_ARGS = [
    "--model",
    WORKLOAD.replace(":make", ":make_nan"),
    "--train.max_steps=6",
    "--train.eval_every=2",
    "--train.eval_batches=1",
    "--train.checkpoint_every=2",
    "--monitor.log_every=1",
    "--no-progress",
]


def test_a_nan_metric_is_written_as_null_with_one_warning_and_training_goes_on(tmp_path: Path, caplog):
    """#44 item 4: a metrics_fn's NaN does not stop the run: its records hold null, one warning names it."""
    assert main(["train", *NAN_ARGS, "--run.out_dir", str(tmp_path), "--run.name=n"]) == 0
    run = tmp_path / "n"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in records if "val_score" in r]
    assert [r["step"] for r in scored] == [2, 4, 6] and all(r["val_score"] is None for r in scored)
    assert all(isinstance(r["val_accuracy"], float) for r in scored)
    warned = [r.getMessage() for r in caplog.records if "val_score" in r.getMessage()]
    assert len(warned) == 1 and "NaN" in warned[0] and "null" in warned[0], warned
    assert (_summary(run)["status"], _summary(run)["steps"]) == ("completed", 6)
    assert [p.name for p in list_checkpoints(run / "checkpoints")][-1] == "step_00000006.pt"


def test_early_stopping_on_a_metric_nan_since_the_first_pass_stops_in_one_line(tmp_path: Path):
    """#44 item 3: the stop says the metric was NaN; the stop step's checkpoint is written."""
    args = [*NAN_ARGS, "--best.metric=val_score", "--best.mode=max", "--best.patience=2"]
    assert main(["train", *args, "--run.out_dir", str(tmp_path), "--run.name=n"]) == 0
    summary = _summary(tmp_path / "n")
    assert (summary["status"], summary["steps"]) == ("stopped", 4)
    assert (
        summary["stop_reason"]
        == "early stopping: val_score was NaN in all 2 validation passes, the last at step 4"
    )
    assert [p.name for p in list_checkpoints(tmp_path / "n" / "checkpoints")][-1] == "step_00000004.pt"


def _losses(run: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


# no early stopping, 8 steps: the passes at steps 1, 2, 3 and 6 improve (the 4th link: step 6's)
EIGHT = [a for a in ARGS if not a.startswith(("--best.patience", "--train.max_steps"))] + [
    "--train.max_steps=8"
]


@pytest.fixture(scope="module")
def uninterrupted_eight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The EIGHT run never killed, trained once for both kill points (read, never resumed)."""
    out = tmp_path_factory.mktemp("eight")
    assert main(["train", *EIGHT, "--run.out_dir", str(out), "--run.name=full"]) == 0
    return out / "full"


@pytest.mark.slow  # a killed subprocess
@pytest.mark.parametrize("fault", ["best-link:4", "best-sidecar:4"])
def test_a_kill_before_the_best_is_linked_is_finished_by_the_resume(
    tmp_path: Path, fault: str, uninterrupted_eight: Path
):
    """#44 item 1: kill -9 after step 6's checkpoint (the new best) is written, before it is linked
    into best/ (or with its file linked, not its checksum); --resume finishes the link: best/,
    best.json, the summary and load_best_weights hold step 6 as in the uninterrupted run, no
    leftover, and every step's loss and the final weights are the uninterrupted run's."""
    out = ["--run.out_dir", str(tmp_path)]
    log = tmp_path / "killed.txt"  # its stdout and stderr; the process a fork of this one
    killed = inprocess.turbotrain(["train", *EIGHT, *out, "--run.name=killed"], log, log, fault=fault)
    assert killed.wait(timeout=HANG_S) == -signal.SIGKILL, log.read_text()
    full, run = uninterrupted_eight, tmp_path / "killed"
    assert json.loads((best_folder(run) / BEST_FILE).read_text())["step"] == 3  # the kill left step 3's
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert _summary(run)["best"] == _summary(full)["best"]
    assert _summary(run)["best"]["checkpoint"] == "checkpoints/best/step_00000006.pt"
    assert sorted(p.name for p in best_folder(run).iterdir()) == sorted(
        p.name for p in best_folder(full).iterdir()
    )
    assert json.loads((best_folder(run) / BEST_FILE).read_text()) == json.loads(
        (best_folder(full) / BEST_FILE).read_text()
    )
    (path, weights), (_, expected) = load_best_weights(run), load_best_weights(full)
    assert path.name == "step_00000006.pt" and all(torch.equal(weights[k], expected[k]) for k in expected)
    assert _losses(run) == _losses(full) and len(_losses(full)) == 8
    (_, last), (_, last_full) = (
        load_latest_weights(run / "checkpoints"),
        load_latest_weights(full / "checkpoints"),
    )
    assert all(torch.equal(last[k], last_full[k]) for k in last_full)


def test_a_resume_of_a_run_early_stopping_ended_trains_nothing_and_says_why(
    tmp_path: Path, caplog, early_stopped: tuple[Path, str]
):
    """#44 item 9: --resume of a run early stopping ended (was: another validation window trained
    each time): nothing trained, the same summary, the reason and how to train on in one line; a
    larger best.patience trains on."""
    run = tmp_path / "r"
    shutil.copytree(early_stopped[0], run)  # the ARGS run, as `train ARGS --run.name=r` leaves it
    records = (run / "metrics.jsonl").read_text()
    with caplog.at_level("INFO"):
        assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    summary = _summary(run)
    assert (summary["status"], summary["steps"], summary["stop_reason"]) == ("stopped", 5, REASON)
    assert (run / "metrics.jsonl").read_text() == records  # nothing trained, nothing logged
    said = [r.getMessage() for r in caplog.records if "nothing to train" in r.getMessage()]
    assert said == [
        f"{run} was ended at step 5 by {REASON}: nothing to train; to train on, resume with a larger "
        "best.patience, e.g. --best.patience=4"
    ]
    assert main(["train", "--resume", str(run), "--best.patience=3", "--no-progress"]) == 0
    summary = _summary(run)  # 0.9 at step 6 improves; 7, 8 and 9 do not: patience 3 ends it at 9
    assert (summary["steps"], summary["best"]["step"]) == (9, 6)
