"""A workload that writes down the dataset rows of every micro-batch it trains on (one JSON list
per loss call, appended to the file named by $TT_ROWS_FILE): 20 rows, so a global batch of 6
leaves 2 over in each epoch. Used by tests/integration/test_epochs_order.py (not a test module)."""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from turbotrain import Workload

ROWS = 20


class Numbered(Dataset):
    """Row ``i`` is (its number as a feature, ``i``)."""

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([float(i)]), torch.tensor(i)


def recorded_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, rows = batch
    with open(os.environ["TT_ROWS_FILE"], "a") as f:
        f.write(json.dumps(rows.tolist()) + "\n")
    return F.mse_loss(model(x / ROWS).squeeze(1), torch.zeros(len(rows)))


def shuffled() -> Workload:
    return Workload(
        model=nn.Linear(1, 1),
        train_loader=DataLoader(Numbered(), batch_size=3, shuffle=True),
        loss_fn=recorded_loss,
    )


def in_order() -> Workload:
    return Workload(
        model=nn.Linear(1, 1), train_loader=DataLoader(Numbered(), batch_size=3), loss_fn=recorded_loss
    )
