"""The integrations' options and names (issue 46): Lightning's ``val_key`` (and one warning when
validation ran without it), runs named after their directory or module, not "turbotrain".

Tiny models (an MLP of 16 -> 32 -> 1) and 8 steps: each case is a second or two on CPU.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning")

from turbotrain.integrations.lightning import TurbotrainLightningCallback  # noqa: E402

STEPS = 8


class Regressor(L.LightningModule):
    """An MLP whose validation logs ``valid_loss`` (as Lightning's public examples name it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("valid_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(callback: TurbotrainLightningCallback, root: Path | None = None) -> None:
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g))
    trainer = L.Trainer(
        max_steps=STEPS,
        val_check_interval=4,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        log_every_n_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        callbacks=[callback],
        **({"default_root_dir": str(root)} if root else {}),
    )
    trainer.fit(Regressor(), DataLoader(data, batch_size=8), DataLoader(data, batch_size=8))


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_lightning_val_key_records_validation_under_its_name(tmp_path, caplog):
    """(#46 item 4) A module logging ``valid_loss``: without ``val_key`` one warning naming what
    it logged and no validation records; with ``val_key="valid_loss"`` a record per validation."""
    with caplog.at_level(logging.WARNING, logger="turbotrain.integrations"):
        fit(TurbotrainLightningCallback(tmp_path / "default", report=False, nvml=False))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "'val_loss'" in warnings[0] and "valid_loss" in warnings[0]
    assert "val_key=" in warnings[0]
    assert not any("val_loss" in r for r in records(tmp_path / "default"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="turbotrain.integrations"):
        fit(TurbotrainLightningCallback(tmp_path / "named", report=False, nvml=False, val_key="valid_loss"))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    val = [(r["step"], r["val_loss"]) for r in records(tmp_path / "named") if "val_loss" in r]
    assert [s for s, _ in val] == [4, 8] and all(v > 0 for _, v in val)


def test_lightning_runs_are_named_after_their_directory_or_module(tmp_path, monkeypatch):
    """(#46 item 6) Not "turbotrain": the root directory's name, else the module's class."""
    callback = TurbotrainLightningCallback(report=False, nvml=False)
    fit(callback, tmp_path / "exp-3")
    assert callback.summary["run"] == "exp-3"
    assert json.loads((tmp_path / "exp-3" / "turbotrain" / "summary.json").read_text())["run"] == "exp-3"
    monkeypatch.chdir(tmp_path)  # no default_root_dir: the working directory, so the module names it
    callback = TurbotrainLightningCallback(report=False, nvml=False)
    fit(callback)
    assert callback.summary["run"] == "Regressor"
