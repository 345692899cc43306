"""Reference image classifiers (workload W2) and a synthetic image set they can learn:
:class:`ResNet` (224x224, compute-bound) and :class:`CifarResNet` (32x32, overhead-bound steps).
``model(images)`` -> logits, ``model(images, labels)`` -> mean cross-entropy; images are uint8
NCHW, normalised inside the model, so batches cross the host-device link at one byte per pixel.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn


def _normalise(images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [0, 255] -> ``dtype`` in [-1, 1]; float input is taken as already normalised."""
    if images.dtype == torch.uint8:
        return images.to(dtype).mul_(2.0 / 255.0).sub_(1.0)
    return images.to(dtype)


def _loss_or_logits(logits: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    return logits if labels is None else F.cross_entropy(logits.float(), labels)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and an identity (or 1x1 projection) shortcut."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)), inplace=True)
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.shortcut(x), inplace=True)


class ResNet(nn.Module):
    """ResNet-style classifier for 224x224 images (widths ``width`` x 1, 2, 4, 8); the defaults are
    ResNet-18 (11.7M parameters with 1000 classes, ~1.8 GFLOPs forward per image)."""

    def __init__(self, layers: tuple[int, ...] = (2, 2, 2, 2), width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        blocks: list[nn.Module] = []
        c_in = width
        for i, n in enumerate(layers):
            c_out = width * 2**i
            for j in range(n):
                blocks.append(BasicBlock(c_in, c_out, stride=2 if (i > 0 and j == 0) else 1))
                c_in = c_out
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(c_in, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.stem(_normalise(images, cast(nn.Conv2d, self.stem[0]).weight.dtype))
        for block in self.blocks:
            x = block(x)
        return _loss_or_logits(self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)), labels)


def _conv_bn(c_in: int, c_out: int, pool: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = [
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    ]
    if pool:
        layers.append(nn.MaxPool2d(2))
    return nn.Sequential(*layers)


class _Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(_conv_bn(channels, channels), _conv_bn(channels, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class CifarResNet(nn.Module):
    """ResNet-9-style classifier for 32x32 images (widths ``width`` x 1, 2, 4, 8; 64 is the
    DAWNBench ResNet-9, the benchmark's is narrower so each step is short and overhead-bound)."""

    def __init__(self, width: int = 32, classes: int = 10) -> None:
        super().__init__()
        w = width
        self.blocks = nn.ModuleList(
            [
                _conv_bn(3, w),
                _conv_bn(w, 2 * w, pool=True),
                _Residual(2 * w),
                _conv_bn(2 * w, 4 * w, pool=True),
                _conv_bn(4 * w, 8 * w, pool=True),
                _Residual(8 * w),
            ]
        )
        self.head = nn.Linear(8 * w, classes, bias=False)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = _normalise(images, self.head.weight.dtype)
        for block in self.blocks:
            x = block(x)
        logits = self.head(torch.flatten(F.adaptive_max_pool2d(x, 1), 1)) * 0.125  # ResNet-9's logit scale
        return _loss_or_logits(logits, labels)


def synthetic_images(
    n: int, batch_size: int, image_size: int, classes: int, seed: int = 0, noise: float = 0.35
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` fixed batches of learnable uint8 images (n, B, 3, S, S) and labels (n, B), seeded."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.rand(classes, 3, 8, 8, generator=g)
    labels = torch.randint(classes, (n, batch_size), generator=g)
    images = torch.empty(n, batch_size, 3, image_size, image_size, dtype=torch.uint8)
    for i in range(n):
        base = F.interpolate(templates[labels[i]], size=(image_size, image_size), mode="nearest")
        pixels = (base + noise * torch.randn(base.shape, generator=g)).clamp_(0.0, 1.0)
        images[i] = pixels.mul_(255.0).round_().to(torch.uint8)
    return images, labels
