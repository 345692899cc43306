"""What a run records, nothing dropped (issue 32 items 1 and 4): every evaluation reaches
metrics.jsonl, the progress line and summary.json whatever monitor.log_every; an epoch's train
loss is the mean of its steps; an image model's summary counts samples, not "0 tokens"."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from turbotrain.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CNN = f"{EXAMPLES / 'workload_cnn.py'}:make"


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("workload_cnn_example", EXAMPLES / "workload_cnn.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _load_example()  # the user's model and data, to evaluate checkpoints without turbotrain


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _evaluate_independently(checkpoint: Path) -> tuple[float, float]:
    """The example CNN's validation loss and accuracy at a checkpoint, in plain PyTorch: the mean
    over the workload's eval loader's batches of each batch's mean, as turbotrain defines it."""
    model = example.SmallCNN()
    model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True)["model"])
    model.eval()
    losses, hits = [], []
    with torch.no_grad():
        for images, labels in DataLoader(example.Shapes(256), batch_size=64):
            logits = model(images)
            losses.append(F.cross_entropy(logits, labels).item())
            hits.append((logits.argmax(1) == labels).float().mean().item())
    return sum(losses) / len(losses), sum(hits) / len(hits)


def test_every_evaluation_between_logging_steps_is_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the README's and docs/model_specs.md's command (eval_every 16 against the default log_every 10)
    # cut from 64 steps to 32: two evaluations, both between logging steps (test_docs runs the command)
    assert (
        main(
            [
                "train",
                "--model",
                CNN,
                "--train.max_steps",
                "32",
                "--train.eval_every",
                "16",
                "--train.checkpoint_every",
                "16",
                "--train.keep_last",
                "4",
                "--run.out_dir",
                str(tmp_path),
                "--run.name",
                "cnn",
            ]
        )
        == 0
    )
    run = tmp_path / "cnn"
    vals = {r["step"]: r for r in _records(run) if "val_loss" in r}
    assert sorted(vals) == [16, 32]
    # whole records, the usual schema
    assert all(r.get("loss") is not None and "val_accuracy" in r for r in vals.values())
    for step, record in vals.items():  # the recorded values are the model's at that step
        loss, accuracy = _evaluate_independently(run / "checkpoints" / f"step_{step:08d}.pt")
        assert record["val_loss"] == pytest.approx(loss, rel=1e-4)
        assert record["val_accuracy"] == pytest.approx(accuracy, abs=1e-6)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_val_step"] == 32 and summary["final_val_loss"] == vals[32]["val_loss"]
    assert summary["best_val_loss"] == min(r["val_loss"] for r in vals.values())
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    shown = [int(line.split("|")[0].split()[1]) for line in progress if "| val " in line]
    assert shown == [16, 32]


def test_epoch_train_loss_is_the_mean_of_the_epochs_steps_and_an_image_run_counts_samples(
    tmp_path: Path,
) -> None:
    # 2048 images at a global batch of 256: 8 steps per epoch; log_every 1 records each step's loss
    assert (
        main(
            [
                "train",
                "--model",
                CNN,
                "--train.epochs",
                "2",
                "--batch.micro",
                "256",
                "--monitor.log_every",
                "1",
                "--train.eval_every",
                "8",
                "--train.eval_batches",
                "1",
                "--no-progress",
                "--run.out_dir",
                str(tmp_path),
                "--run.name",
                "ep",
            ]
        )
        == 0
    )
    run = tmp_path / "ep"
    records = _records(run)
    losses = {r["step"]: r["loss"] for r in records if r.get("loss") is not None}
    assert sorted(losses) == list(range(1, 17))
    epochs = [r for r in records if r.get("event") == "epoch"]
    assert [e["step"] for e in epochs] == [8, 16]
    for e in epochs:
        steps = range(e["step"] - 7, e["step"] + 1)
        mean = sum(losses[s] for s in steps) / 8
        assert e["epoch_train_loss"] == pytest.approx(mean, rel=1e-6)
        assert e["epoch_train_loss"] != pytest.approx(losses[e["step"]], rel=1e-6)  # not the last step's
    summary_md = (run / "summary.md").read_text()
    assert "0 tokens" not in summary_md and "steady-state tokens/s" not in summary_md
    assert "16 of 16 optimizer steps, 4,096 samples," in summary_md
