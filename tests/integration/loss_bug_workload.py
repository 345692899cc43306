"""A workload whose loss has the newcomer's bug: ``F.cross_entropy`` on float targets (fails on
the first batch). Used by tests/integration/test_user_bug.py (not a test module)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from turbotrain import Workload

LOSS_LINE = 18  # the line of the failing call below


def float_targets(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y.float())  # the bug: class targets as floats


def make() -> Workload:
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 3, (32,)))
    return Workload(model=nn.Linear(4, 3), train_loader=DataLoader(data, batch_size=8), loss_fn=float_targets)
