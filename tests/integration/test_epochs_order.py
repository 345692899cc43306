"""An epochs run over a dataset the global batch does not divide (20 rows, 6 per optimizer step:
micro 3 x accumulation 2, or micro 6) trains, row by row, on the order the docs promise
(src/turbotrain/parts/data/epochs.py): epoch ``e`` is a permutation drawn from ``(run.seed, e)``
when the loader shuffles (the loader's own order otherwise), cut into full global batches; the 2
rows left over in each epoch are dropped, never trained on as a partial batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from turbotrain.cli import main

WORKLOAD = Path(__file__).with_name("rows_workload.py")
ROWS, GLOBAL, EPOCHS, SEED = 20, 6, 2, 7
STEPS_PER_EPOCH = ROWS // GLOBAL  # 3: rows 18 and 19 of each epoch's order are dropped


def reference_order(epoch: int, shuffle: bool) -> list[int]:
    """Epoch ``epoch``'s order as documented: torch.randperm from (seed, epoch), or 0..19."""
    if not shuffle:
        return list(range(ROWS))
    return torch.randperm(ROWS, generator=torch.Generator().manual_seed(SEED * 1_000_003 + epoch)).tolist()


def trained_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, func: str, micro: int) -> list[list[int]]:
    """The rows of each micro-batch trained on, in order (the loss calls of the training steps)."""
    rows_file = tmp_path / f"{func}.jsonl"
    monkeypatch.setenv("TT_ROWS_FILE", str(rows_file))
    assert (
        main(
            [
                "train",
                "--model",
                f"{WORKLOAD}:{func}",
                f"--train.epochs={EPOCHS}",
                f"--batch.micro={micro}",
                f"--batch.accumulation={GLOBAL // micro}",
                f"--run.seed={SEED}",
                "--data.num_workers=0",
                "--monitor.log_every=1",
                "--no-progress",
                "--run.out_dir",
                str(tmp_path),
                f"--run.name={func}",
            ]
        )
        == 0
    )
    calls = [json.loads(line) for line in rows_file.read_text().splitlines()]
    steps = [
        r["step"]
        for r in map(json.loads, (tmp_path / func / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    ]
    assert steps == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))  # 3 full steps per epoch, no partial fourth
    micro_batches = EPOCHS * STEPS_PER_EPOCH * (GLOBAL // micro)
    return calls[-micro_batches:]  # earlier calls: the FLOP count's forward on an example batch


@pytest.mark.parametrize("func,shuffle,micro", [("shuffled", True, 3), ("in_order", False, 6)])
def test_an_epochs_run_trains_each_epochs_order_row_by_row_and_drops_the_partial_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, func: str, shuffle: bool, micro: int
) -> None:
    micro_batches = trained_rows(tmp_path, monkeypatch, func, micro)
    assert all(len(b) == micro for b in micro_batches)  # never a short batch
    per_epoch = STEPS_PER_EPOCH * GLOBAL // micro
    for epoch in range(EPOCHS):
        trained = [row for b in micro_batches[epoch * per_epoch : (epoch + 1) * per_epoch] for row in b]
        assert trained == reference_order(epoch, shuffle)[:18], f"epoch {epoch + 1}"
        assert len(set(trained)) == 18  # no row twice in an epoch
    first, second = (sum(micro_batches[e * per_epoch : (e + 1) * per_epoch], []) for e in range(EPOCHS))
    if shuffle:  # the loader's shuffle honoured: not the dataset's order, and a new order each epoch
        assert first != list(range(18)) and first != second
    else:
        assert first == second == list(range(18))
