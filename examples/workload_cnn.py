"""A user-style CNN workload for turbotrain's tools: your model and data, no turbotrain code in them.

    turbotrain train   --model examples/workload_cnn.py:make --train.max_steps 64
    turbotrain bench   --model examples/workload_cnn.py:make --matrix precision
    turbotrain profile --model examples/workload_cnn.py:make --verify
    turbotrain profile --model examples/workload_cnn.py:make_slow_data --verify   # a loader that reads slowly
    turbotrain tune    --model examples/workload_cnn.py:make --trials 8

FUNC takes no arguments and returns a Workload (a dict with the same keys works too); turbotrain
seeds torch before calling it, and calls it again for every run it measures.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from turbotrain import Workload


class Shapes(Dataset):
    """32x32 RGB images whose class sets the mean colour: learnable, made on the fly like a
    decoded image would be. ``read_ms`` simulates a slow read (a network disk, JPEG decoding)."""

    def __init__(self, size: int = 2048, classes: int = 10, read_ms: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.labels = torch.randint(classes, (size,), generator=g)
        self.noise_seed = 1234
        self.classes, self.read_ms = classes, read_ms

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.read_ms:
            time.sleep(self.read_ms / 1000)
        g = torch.Generator().manual_seed(self.noise_seed + i)
        y = self.labels[i]
        x = torch.randn(3, 32, 32, generator=g) * 0.5 + (y.float() / self.classes - 0.5)
        return x, y


class SmallCNN(nn.Module):
    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.head(x.mean((2, 3)))


def cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def accuracy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Validation metrics besides the loss: the share of images classified right."""
    images, labels = batch
    return {"accuracy": (model(images).argmax(1) == labels).float().mean()}


def make() -> Workload:
    """The CNN on in-memory-fast data."""
    loader = DataLoader(Shapes(), batch_size=64, shuffle=True, drop_last=True)
    return Workload(
        model=SmallCNN(),
        train_loader=loader,
        loss_fn=cross_entropy,
        metrics_fn=accuracy,
        eval_loader=DataLoader(Shapes(256), batch_size=64),
    )


def make_slow_data() -> Workload:
    """The same CNN whose dataset takes 1 ms per image to read, loaded in the main process."""
    loader = DataLoader(Shapes(read_ms=1.0), batch_size=64, shuffle=True, drop_last=True, num_workers=0)
    return Workload(model=SmallCNN(), train_loader=loader, loss_fn=cross_entropy)
