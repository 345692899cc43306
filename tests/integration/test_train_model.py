"""`turbotrain train --model FILE.py:FUNC`: a user's workload through the whole product (train,
evaluate its own metric, checkpoint, resume exactly, report) with no GPT code in the way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from turbotrain.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
QUICK = [
    "--train.max_steps=6",
    "--train.eval_every=3",
    "--train.checkpoint_every=3",
    "--train.eval_batches=2",
    "--monitor.log_every=3",
    "--no-progress",
]


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _stopped_and_resumed(tmp_path: Path, model: str, *args: str) -> tuple[dict, dict, Path, Path]:
    """The same run uninterrupted and stopped at step 3 then resumed: both summaries and run dirs."""
    out = ["--run.out_dir", str(tmp_path)]
    assert main(["train", "--model", model, *QUICK, *args, *out, "--run.name=full"]) == 0
    assert (
        main(
            ["train", "--model", model, *QUICK, *args, *out, "--run.name=split", "--train.stop_after_steps=3"]
        )
        == 0
    )
    assert main(["train", "--resume", str(tmp_path / "split"), "--no-progress"]) == 0
    full, split = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("full", "split"))
    return full, split, tmp_path / "full", tmp_path / "split"


def test_an_image_classifier_trains_two_epochs_reports_accuracy_and_resumes_mid_epoch_exactly(
    tmp_path: Path,
) -> None:
    # 2048 images at a global batch of 256: 8 steps per epoch; stopped at step 3, in the first epoch
    full, split, run, resumed = _stopped_and_resumed(
        tmp_path, f"{EXAMPLES / 'workload_cnn.py'}:make", "--train.epochs=2", "--batch.micro=256"
    )
    assert split["resumed_from"] and split["steps"] == full["steps"] == 16
    assert _losses(resumed) == _losses(run)  # the same batches in the same steps after the resume, to the bit
    assert split["final_val_loss"] == full["final_val_loss"]
    assert split["final_val_accuracy"] == full["final_val_accuracy"] and 0 <= full["final_val_accuracy"] <= 1
    epochs = full["epochs"]
    assert [(e["epoch"], e["step"]) for e in epochs] == [(1, 8), (2, 16)]
    assert all(
        e["epoch_s"] > 0 and 0 <= e["epoch_val_accuracy"] <= 1 and e["epoch_train_loss"] > 0 for e in epochs
    )
    assert [e["epoch_val_loss"] for e in split["epochs"]] == [e["epoch_val_loss"] for e in epochs]
    assert full["resolved"]["model_family"] == "workload" and full["resolved"]["model"] == "SmallCNN"
    # an image model: samples/s
    assert full["steady_state"]["samples_per_s"] > 0 and not full["tokens_per_s_median"]
    summary_md = (run / "summary.md").read_text()
    assert "validation accuracy" in summary_md and "## Epochs" in summary_md
    assert (run / "plots" / "metrics.png").is_file()
    # the command's micro-batch, not the loader's 64
    assert "micro = 256" in (run / "config.toml").read_text()


def test_sample_of_a_run_whose_model_does_not_generate_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "cnn"
    run.mkdir()
    (run / "config.toml").write_text(f'[model]\nworkload = "{EXAMPLES / "workload_cnn.py"}:make"\n')
    assert main(["sample", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not generate text" in err[0]


def test_a_hugging_face_causal_lm_trains_resumes_exactly_and_counts_tokens(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    full, split, run, resumed = _stopped_and_resumed(tmp_path, f"{EXAMPLES / 'hf_causal_lm.py'}:make")
    assert _losses(resumed) == _losses(run)
    assert split["final_val_loss"] == full["final_val_loss"]
    # tokens/s; TFLOP/s (MFU on a GPU)
    assert full["tokens_per_s_median"] > 0 and full["flops_per_sample"] > 0
    assert "micro = 16" in (run / "config.toml").read_text()  # the workload loader's batch size


def test_model_and_resume_together_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--resume", str(tmp_path), "--model", "x.py:make"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "leave --model out" in err[0]


COUNTED = """
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from turbotrain import Workload


def make():
    with open(Path(__file__).with_name("calls.txt"), "a") as f:  # one line per call of FUNC
        f.write("called\\n")
    data = TensorDataset(torch.randn(64, 4), torch.randint(2, (64,)))
    return Workload(model=torch.nn.Linear(4, 2), train_loader=DataLoader(data, batch_size=8),
                    loss_fn=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]))
"""


def test_the_workload_function_is_called_once_per_run(tmp_path: Path) -> None:
    # the loader's batch size (batch.micro) and the run's model come from one call of FUNC: a FUNC that
    # builds a large model or opens a dataset does it once
    (tmp_path / "counted.py").write_text(COUNTED)
    args = [
        "--train.max_steps=2",
        "--train.eval_every=0",
        "--no-progress",
        "--run.out_dir",
        str(tmp_path / "runs"),
    ]
    assert main(["train", "--model", f"{tmp_path / 'counted.py'}:make", *args]) == 0
    assert (tmp_path / "calls.txt").read_text().splitlines() == ["called"]
    run = next((tmp_path / "runs").iterdir())
    assert "micro = 8" in (run / "config.toml").read_text()  # the loader's batch size, read from that call
