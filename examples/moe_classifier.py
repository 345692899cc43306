"""An image classifier with mixture-of-experts layers (``turbotrain.MoE``), as a workload for
turbotrain's tools. The data is SYNTHETIC, made in memory (no download): 28x28 grey images of 10
classes, each class a faint fixed random pattern under noise (learnable, not at once).

    turbotrain bench   --model examples/moe_classifier.py:make --matrix precision
    turbotrain profile --model examples/moe_classifier.py:make

The model: a convolutional stem cuts the image into 4x4 = 16 patch features, one MoE layer
routes every patch (``(B, 16, d)`` tokens), a linear layer pools the patches into one feature
vector, a second MoE layer routes it (``(B, d)``), and a linear head classifies. The MoE layers' load-balancing loss is not in ``loss_fn``: the
engine adds it in ``backward`` (in a loop of your own without the engine:
``loss + turbotrain.parts.models.moe.aux_loss(model)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from turbotrain import MoE, Workload


class SyntheticDigits(Dataset):
    """``size`` 1x28x28 images: ``signal`` x class ``y``'s fixed pattern (seed 0) plus unit noise
    (seed from ``seed`` and i)."""

    def __init__(self, size: int = 2048, classes: int = 10, seed: int = 1, signal: float = 0.1) -> None:
        g = torch.Generator().manual_seed(0)
        self.patterns = signal * torch.randn(classes, 1, 28, 28, generator=g)
        self.labels = torch.randint(classes, (size,), generator=torch.Generator().manual_seed(seed))
        self.seed = seed

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + i)
        y = self.labels[i]
        return self.patterns[y] + torch.randn(1, 28, 28, generator=g), y


class MoEClassifier(nn.Module):
    def __init__(self, d: int = 64, n_experts: int = 8, top_k: int = 2, classes: int = 10) -> None:
        super().__init__()
        # 28x28 -> 4x4 patches of d features
        self.stem = nn.Sequential(nn.Conv2d(1, d, 7, stride=7), nn.GELU())
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.pool = nn.Linear(16 * d, d)  # where a pattern sits matters: the patches flattened, not averaged
        self.patch_experts = MoE(d, n_experts, top_k, hidden=2 * d)  # (B, 16, d)
        self.feature_experts = MoE(d, n_experts, top_k, hidden=2 * d)  # (B, d)
        self.head = nn.Linear(d, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images).flatten(2).transpose(1, 2)  # (B, 16, d)
        x = x + self.patch_experts(self.norm1(x))
        v = self.pool(x.flatten(1))  # (B, d)
        v = v + self.feature_experts(self.norm2(v))
        return self.head(v)


def cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def accuracy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    images, labels = batch
    return {"accuracy": (model(images).argmax(dim=-1) == labels).float().mean()}


def make() -> Workload:
    """The classifier on 2048 synthetic training images (batches of 64) and 256 held out."""
    loader = DataLoader(SyntheticDigits(), batch_size=64, shuffle=True, drop_last=True)
    return Workload(
        model=MoEClassifier(),
        train_loader=loader,
        loss_fn=cross_entropy,
        eval_loader=DataLoader(SyntheticDigits(256, seed=2), batch_size=64),
        metrics_fn=accuracy,
    )
