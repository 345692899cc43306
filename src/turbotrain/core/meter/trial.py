"""The one trial runner of the measuring tools: a step of a copy of the user's model on the run's
device and precision (the batch finder, ``memory --measure``, the precision check, ``bench --inference``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ContextManager

import torch
from torch import nn

from ..transforms import eager
from ..window import LossFn, as_loss, default_loss

if TYPE_CHECKING:
    from ..engine import Engine

Optimizer = torch.optim.Optimizer


def copy_on(
    engine: Engine, model: nn.Module, optimizer: Optimizer | Callable[..., Optimizer] | None = None
) -> tuple[nn.Module, Optimizer | None]:
    """A deep copy of ``model`` set up by ``engine``, with a new optimizer like ``optimizer``."""
    net = copy.deepcopy(model)
    opt = None
    if isinstance(optimizer, Optimizer):
        opt = type(optimizer)(net.parameters(), **optimizer.defaults)
    elif optimizer is not None:
        opt = optimizer(net.parameters())
    net, opt, _ = engine.setup(net, opt)
    return net, opt


def train_step(
    model: nn.Module,
    optimizer: Optimizer,
    batch: Any,
    *,
    loss_fn: LossFn | None = None,
    autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
    eagerly: bool = False,
    micro_steps: int = 1,
    on_phase: Callable[[str], None] | None = None,
    zero_grad: bool = True,
) -> None:
    """``micro_steps`` forward/backward passes, then the optimizer step; ``on_phase`` after each phase."""
    loss_fn = loss_fn or default_loss
    note = on_phase or (lambda _phase: None)
    for _ in range(micro_steps):
        with autocast(), eager() if eagerly else contextlib.nullcontext():
            loss = as_loss(loss_fn(model, batch))  # a model's output with .loss counts as its loss
        note("forward")
        loss.backward()
        del loss
        note("backward")
    optimizer.step()
    note("optimizer")
    if zero_grad:
        optimizer.zero_grad(set_to_none=True)
