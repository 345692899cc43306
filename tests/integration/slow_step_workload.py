"""A tiny workload whose every step takes 0.6 s (longer than the progress bar's redraw period),
whose loss function logs one line of its own at its 4th call, with a validation set. Used by
tests/integration/test_progress_bar.py (not a test module)."""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from turbotrain import Workload

STEP_S = 0.6
calls = 0


def slow_mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    global calls
    calls += 1
    if calls == 4:
        logging.getLogger("user").warning("a line from the user's own code")
    if model.training:
        time.sleep(STEP_S)
    x, y = batch
    return F.mse_loss(model(x), y)


def make() -> Workload:
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    return Workload(
        model=nn.Linear(4, 1),
        train_loader=DataLoader(data, batch_size=8),
        eval_loader=DataLoader(data, batch_size=32),
        loss_fn=slow_mse,
    )
