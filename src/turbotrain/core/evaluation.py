"""Evaluation: the mean loss (and metrics) over batches under the precision's autocast, no_grad, and
eagerly (no eval-mode graph is compiled for a few batches); one host-device sync per evaluation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..base.batch import move_to
from .transforms import eager
from .window import LossFn, Window, as_loss

MetricsFn = Callable[[nn.Module, Any], Mapping[str, torch.Tensor]]


def evaluate_batches(
    model: nn.Module, batches: Iterable[Any], loss_fn: LossFn, metrics_fn: MetricsFn | None, window: Window
) -> dict[str, float]:
    """The mean loss and each metric over ``batches``, averaged over the ranks; the mode restored."""
    device, autocast, mean_over_ranks = window.device, window.precision.autocast, window.strategy.mean_
    was_training = model.training
    model.eval()
    total, n = torch.zeros((), device=device), 0
    sums: dict[str, torch.Tensor] = {}
    with torch.no_grad(), autocast(), eager():
        for batch in batches:
            batch = move_to(batch, device, non_blocking=True)
            total += as_loss(loss_fn(model, batch)).float()
            for name, value in (metrics_fn(model, batch) if metrics_fn is not None else {}).items():
                value = torch.as_tensor(value, device=device).float().mean()
                sums[name] = sums[name] + value if name in sums else value
            n += 1
    model.train(was_training)
    names = ["loss", *sums]
    # every rank evaluated its own batches
    means = mean_over_ranks(torch.stack([total, *sums.values()]) / max(n, 1))
    return dict(zip(names, means.tolist()))  # host-device sync point (once per evaluation)
