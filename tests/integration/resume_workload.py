"""A workload whose every step draws from each random number generator a user's code reaches:
dropout (torch, main process), a random augmentation in DataLoader workers (torch, Python
``random`` and numpy there), and noise added in the loss from Python ``random`` and numpy in the
main process. A resume that forgets any generator's state trains on other numbers than the run
that was never stopped. Used by tests/integration/test_resume_exact.py (not a test module)."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from turbotrain import Workload


class Augmented(Dataset):
    """``size`` fixed 8-feature rows, each returned with a random jitter (the augmentation)."""

    def __init__(self, size: int = 96) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 8, generator=g)
        self.y = torch.randint(3, (size,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        jitter = 0.1 * torch.randn(8) + random.random() * 0.01 + float(np.random.rand()) * 0.01
        return self.x[i] + jitter, self.y[i]


def noisy_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    scale = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())  # Python and numpy, main process
    return F.cross_entropy(model(x * scale), y)


def make() -> Workload:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    loader = DataLoader(Augmented(), batch_size=8, shuffle=True, num_workers=2)
    return Workload(model=model, train_loader=loader, loss_fn=noisy_loss)
