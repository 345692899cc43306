"""End to end: an out-of-memory error mid-run (injected) changes nothing a user can see except
the event; 'stop' fails with a one-line error; --batch.micro=auto trains with the found size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides
from faults.oom import inject_oom

from turbotrain import load_config
from turbotrain.app.training import train
from turbotrain.base.errors import TurbotrainError
from turbotrain.cli import main
from turbotrain.core.oom import OutOfMemoryStop
from turbotrain.loop.checkpoint import load_latest
from turbotrain.tools.memory import estimate_memory


def _config(tmp_path: Path, text_file: Path, name: str, **sections):
    base = {"train": {"max_steps": 24, "eval_every": 12, "checkpoint_every": 0}, "monitor": {"log_every": 4}}
    for key, values in sections.items():
        base.setdefault(key, {}).update(values)
    return load_config(
        overrides=tiny_overrides(tmp_path, data={"path": str(text_file)}, run={"name": name}, **base)
    )


def _curve(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if r.get("loss") is not None]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_injected_oom_at_step_20_changes_neither_global_batch_nor_loss(tmp_path, text_file, accumulation):
    plain = train(_config(tmp_path, text_file, "plain", batch={"accumulation": accumulation}))
    with inject_oom(20):
        hit = train(_config(tmp_path, text_file, "oom", batch={"accumulation": accumulation}))

    assert plain["status"] == hit["status"] == "completed" and hit["steps"] == 24
    assert hit["final_train_loss"] == pytest.approx(plain["final_train_loss"], abs=1e-5)
    assert hit["final_val_loss"] == pytest.approx(plain["final_val_loss"], abs=1e-5)
    runs = tmp_path / "runs"
    for (s1, l1), (s2, l2) in zip(_curve(runs / "plain"), _curve(runs / "oom"), strict=True):
        assert s1 == s2 and l2 == pytest.approx(l1, abs=1e-5)  # the whole loss curve, not just the end
    assert hit["tokens"] == plain["tokens"]  # same data consumed
    assert hit["resolved"]["global_batch"] == plain["resolved"]["global_batch"] == 4 * accumulation
    (event,) = hit["events"]
    assert event["kind"] == "oom_recovery" and event["step"] == 20
    assert (
        f"global batch {4 * accumulation} unchanged" in event["detail"]
        and "micro-batch 4 -> 2" in event["detail"]
    )
    assert plain["events"] == []
    summary = json.loads((runs / "oom" / "summary.json").read_text())
    assert summary["events"] == hit["events"]


def test_resume_after_recovery_keeps_the_smaller_micro_batch(tmp_path, text_file):
    with inject_oom(10):
        straight = train(_config(tmp_path, text_file, "straight"))
    first = _config(tmp_path, text_file, "resumed", train={"stop_after_steps": 16, "checkpoint_every": 8})
    with inject_oom(10):
        assert train(first)["status"] == "stopped"
    run_dir = tmp_path / "runs" / "resumed"
    _, payload = load_latest(run_dir / "checkpoints")
    assert payload["engine"]["batch_runner"]["split"] == 2
    resumed = train(first.replace(train={"stop_after_steps": 0}), resume_dir=run_dir)
    assert resumed["steps"] == 24
    assert [e["kind"] for e in resumed["events"]] == ["oom_recovery"]  # not injected again
    assert resumed["final_train_loss"] == pytest.approx(straight["final_train_loss"], abs=1e-5)


def test_on_oom_stop_fails_with_a_clear_error(tmp_path, text_file, capsys):
    config = _config(tmp_path, text_file, "stop", memory={"on_oom": "stop"})
    with pytest.raises(OutOfMemoryStop) as info, inject_oom(3):
        train(config)
    assert isinstance(info.value, TurbotrainError) and isinstance(info.value, torch.OutOfMemoryError)
    # a Python caller
    assert "step 3" in str(info.value) and '{"memory": {"on_oom": "halve"}}' in str(info.value)
    summary = json.loads((tmp_path / "runs" / "stop" / "summary.json").read_text())
    assert summary["status"].startswith("failed: OutOfMemoryStop")


def _cli_args(config_overrides: dict) -> list[str]:
    return [
        f"--{section}.{key}={value}"
        for section, values in config_overrides.items()
        for key, value in values.items()
    ]


def test_train_cli_with_auto_micro_batch_keeps_the_global_batch(tmp_path, text_file):
    overrides = tiny_overrides(
        tmp_path,
        data={"path": str(text_file)},
        run={"name": "auto"},
        train={"max_steps": 4, "eval_every": 0, "checkpoint_every": 0},
    )
    overrides["batch"] = {"micro": "auto", "global_size": 24}
    cap = estimate_memory(load_config(overrides=overrides), micro=12, vocab_size=256).peak_bytes / 2**30
    overrides["batch"]["max_memory_gib"] = cap
    assert main(["train", "--preset", "gpt-tiny", *_cli_args(overrides)]) == 0

    run_dir = tmp_path / "runs" / "auto"
    summary = json.loads((run_dir / "summary.json").read_text())
    search = summary["resolved"]["batch_search"]
    assert search["micro"] * search["accumulation"] == 24 == summary["resolved"]["global_batch"]
    assert search["micro"] < 24 and search["accumulation"] > 1  # the cap forced accumulation
    assert search["chosen_peak_gib"] * 1.10 <= cap + 1e-4
    assert summary["memory"]["batch_search"]["micro"] == search["micro"]
    assert summary["memory"]["estimate"]["micro_batch"] == search["micro"]
    assert (run_dir / "batch_size.json").is_file()
    assert summary["tokens"] == 4 * 24 * 32  # steps x global batch x block_size

    # resuming reads the cached answer instead of searching again
    assert (
        main(
            [
                "train",
                "--resume",
                "--preset",
                "gpt-tiny",
                f"--run.out_dir={tmp_path / 'runs'}",
                "--run.name=auto",
                "--train.max_steps=6",
                "--monitor.progress=false",
            ]
        )
        == 0
    )
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["resolved"]["batch_search"]["cached"] is True
    assert resumed["resolved"]["batch_search"]["micro"] == search["micro"] and resumed["steps"] == 6
