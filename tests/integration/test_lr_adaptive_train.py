"""`turbotrain train` with the adaptive LR: the plateau schedule lowers the LR after an evaluation
that did not improve (and only then), survives a stop and resume, and the LR scaling rule follows
a global batch chosen by the batch finder."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_overrides

from turbotrain import load_config
from turbotrain.app.training import train
from turbotrain.cli import main

PLATEAU = {
    "schedule": "plateau",
    "plateau_patience": 0,
    "plateau_factor": 0.5,
    "lr": 0.03,
    "min_lr": 1e-4,
    "warmup_steps": 2,
}


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_plateau_lowers_the_lr_after_each_evaluation_without_improvement_and_resumes_exactly(
    tmp_path, text_file
):
    train_section = {"max_steps": 12, "eval_every": 2, "checkpoint_every": 6}
    config = load_config(
        overrides=tiny_overrides(
            tmp_path / "a", data={"path": str(text_file)}, optim=PLATEAU, train=train_section
        )
    )
    full = train(config, progress=False)
    records = _records(tmp_path / "a" / "runs" / "t")
    assert [r["step"] for r in records] == list(range(2, 13, 2))
    best, lr, lowered = float("inf"), 0.03, []
    for r in records:  # one evaluation per record; steps 2.. are after warmup
        if r["val_loss"] < best * (1 - 1e-4):
            best = r["val_loss"]
        else:
            lr, _ = lr * 0.5, lowered.append(r["step"])
        assert r["lr"] == pytest.approx(lr), r
    assert lowered, "the run should have had an evaluation without improvement (raise PLATEAU lr if not)"
    events = [e for e in full["events"] if e["kind"] == "lr_plateau"]
    assert [e["step"] for e in events] == lowered

    split = tiny_overrides(
        tmp_path / "b",
        data={"path": str(text_file)},
        optim=PLATEAU,
        train={**train_section, "stop_after_steps": 6},
    )
    assert train(load_config(overrides=split), progress=False)["status"] == "stopped"
    out = tmp_path / "b" / "runs"
    assert (
        main(
            [
                "train",
                "--resume",
                "--run.out_dir",
                str(out),
                "--run.name=t",
                "--train.stop_after_steps=0",
                "--no-progress",
            ]
        )
        == 0
    )
    resumed = _records(out / "t")
    assert [r["lr"] for r in resumed] == pytest.approx([r["lr"] for r in records])
    assert [r["val_loss"] for r in resumed] == pytest.approx([r["val_loss"] for r in records], abs=1e-5)


def test_lr_scaling_follows_the_global_batch_the_finder_chose(tmp_path, text_file):
    overrides = tiny_overrides(
        tmp_path,
        data={"path": str(text_file)},
        train={"max_steps": 2, "eval_every": 2},
        batch={"micro": "auto", "max_memory_gib": 0.01},
        optim={"lr_scaling": "sqrt", "lr_batch": 4, "warmup_steps": 0, "schedule": "constant"},
    )
    summary = train(load_config(overrides=overrides), progress=False)
    found = summary["resolved"]["batch_search"]["global_batch"]
    assert found != 4
    factor = (found / 4) ** 0.5
    assert summary["config"]["optim"]["lr"] == pytest.approx(3e-3 * factor)
    assert f"global batch {found} instead of 4" in summary["resolved"]["lr_scaling"]
    assert _records(tmp_path / "runs" / "t")[-1]["lr"] == pytest.approx(3e-3 * factor)
