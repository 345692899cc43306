"""Engine -> optimizer -> schedule -> setup: the one assembly of a trainable model from a config,
so training, the memory report, the batch search and bench cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..base.config import RunConfig
from .engine import Engine
from .optim import optimizer_from_config, scheduler_from_config
from .plan import ParallelPlan


@dataclass
class Trainable:
    """A model set up for training: moved, cast, transformed, with its optimizer and schedule."""

    engine: Engine
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    loader: Iterable[Any] | None


def build_trainable(
    config: RunConfig,
    model: nn.Module,
    *,
    max_steps: int | None = None,
    loader: Iterable[Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    plan: ParallelPlan | None = None,
) -> Trainable:
    """The engine, AdamW (or the caller's ``optimizer``) and schedule for ``config``, all set up."""
    engine = Engine(config, plan=plan)
    c = config.optim
    scheduler = None
    if optimizer is None:
        optimizer = optimizer_from_config(model, engine.device, c)
        if max_steps is not None:
            scheduler = scheduler_from_config(optimizer, c, max_steps)
    model, optimizer, loader = engine.setup(
        model, optimizer, loader, scheduler=scheduler, scheduler_interval="step"
    )
    assert optimizer is not None
    return Trainable(engine, model, optimizer, scheduler, loader)
