"""A tiny MLP classifier: the overhead-bound CPU workload (framework cost per step shows here)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TinyMLP(nn.Module):
    """``model(x)`` -> logits (B, classes); ``model(x, y)`` -> mean cross-entropy loss."""

    def __init__(self, d_in: int = 256, width: int = 256, depth: int = 3, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(d_in if i == 0 else width, width), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head(self.body(x))
        return logits if y is None else F.cross_entropy(logits.float(), y)


def synthetic_batches(
    n: int, batch_size: int = 64, d_in: int = 256, classes: int = 10, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` fixed random (x, y) batches with a learnable rule (y from a random projection)."""
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(d_in, classes, generator=g)
    out = []
    for _ in range(n):
        x = torch.randn(batch_size, d_in, generator=g)
        out.append((x, (x @ proj).argmax(dim=1)))
    return out
