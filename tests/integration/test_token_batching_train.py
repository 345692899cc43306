"""`turbotrain train --data.batching=tokens` on a folder of text files: trains end to end, one
document per file, batches within the token budget, and a stop + resume equals a straight run."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import tiny_overrides

from turbotrain import load_config
from turbotrain.app.training import train
from turbotrain.cli import main


def _folder(tmp_path: Path) -> Path:
    root = tmp_path / "docs"
    root.mkdir()
    for i in range(60):  # documents of very different lengths: 1 to ~90 lines
        lines = [f"def f{i}_{j}(x):\n    return x * {j} + {i % 7}\n" for j in range(1 + (i * 37) % 90)]
        (root / f"m{i:02d}.py").write_text("".join(lines))
    return root


def _overrides(tmp_path: Path, folder: Path, **train: int) -> dict:
    return tiny_overrides(
        tmp_path,
        data={"path": str(folder), "batching": "tokens", "val_fraction": 0.1},
        batch={"max_tokens": 96},
        train={"max_steps": 8, "eval_every": 4, "checkpoint_every": 4, **train},
    )


def test_token_batching_trains_a_text_folder_and_resumes_exactly(tmp_path):
    folder = _folder(tmp_path)
    full = train(load_config(overrides=_overrides(tmp_path / "a", folder)), progress=False)
    assert full["status"] == "completed" and full["steps"] == 8
    train_docs, val_docs = full["resolved"]["batching"].split(" documents")[0].split(" + ")
    # one per file (the train/val cut may split one in two)
    assert int(train_docs) + int(val_docs) in (
        60,
        61,
    )
    assert "batches of <= 96 tokens" in full["resolved"]["batching"]
    # tokens counted from the batches' shapes: padding included, never over budget
    assert full["tokens"] <= 8 * 96
    records = [
        json.loads(line)
        for line in (tmp_path / "a" / "runs" / "t" / "metrics.jsonl").read_text().splitlines()
    ]
    # finite, below a uniform guess (ln 256)
    assert all(r["loss"] == r["loss"] and r["loss"] < 6.0 for r in records)

    first = train(
        load_config(overrides=_overrides(tmp_path / "b", folder, stop_after_steps=4)), progress=False
    )
    assert first["status"] == "stopped"
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
    resumed = json.loads((out / "t" / "summary.json").read_text())
    assert resumed["steps"] == 8 and resumed["tokens"] == full["tokens"]
    assert abs(resumed["final_train_loss"] - full["final_train_loss"]) < 1e-5
    assert abs(resumed["final_val_loss"] - full["final_val_loss"]) < 1e-5
