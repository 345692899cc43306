"""fit(): the reference training loop. It calls the engine and the hooks, and nothing else.

It reads no configuration: cadences live in the hooks, speed-ups in the engine. No host-device
synchronisation happens here; the hooks read device values every N steps.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from .engine import Engine, LossFn, default_loss
from .hooks import FitContext, Hook, HookList


def fit(
    engine: Engine,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Any],
    *,
    max_steps: int,
    hooks: Iterable[Hook] = (),
    loss_fn: LossFn = default_loss,
) -> FitContext:
    """Train until ``engine.state.step`` reaches ``max_steps``, the batches run out, or a hook
    requests a stop. Returns the context (latest metrics, stop reason)."""
    batches = engine.setup_loader(batches)  # on the device and counted (a loader from setup() is kept as it is)
    ctx = FitContext(engine, model, optimizer, max_steps)
    hook = HookList(hooks)
    hook.on_fit_start(ctx)
    model.train()
    try:
        if engine.state.step < max_steps:
            for batch in batches:
                engine.forward_backward(model, batch, loss_fn)
                if engine.step(optimizer):
                    hook.on_step_end(ctx)
                    if ctx.should_stop or engine.state.step >= max_steps:
                        break
        hook.on_fit_end(ctx)
    except BaseException as exc:  # also a failing on_fit_end: every hook still gets to clean up
        hook.on_exception(ctx, exc)
        raise
    return ctx
