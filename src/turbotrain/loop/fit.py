"""fit(): the reference training loop. It calls the engine and the hooks, and nothing else.

Each optimizer step's ``batch.accumulation`` loader batches go to ``engine.train_window``
together (where a whole-step wrapper such as a CUDA graph applies). It reads no configuration and
has no host-device sync; the hooks read device values every N steps."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..core.engine import Engine, LossFn, default_loss
from .hooks import FitContext, Hook, HookList


def _steps_and_passes(
    engine: Engine, batches: Iterable[Any], max_steps: int | None, epochs: int | None
) -> tuple[int, int]:
    """(max_steps, passes over ``batches``) from one of ``max_steps`` and ``epochs``."""
    if (max_steps is None) == (epochs is None):
        raise TypeError("fit() takes one of max_steps or epochs")
    if epochs is None:
        assert max_steps is not None
        return max_steps, 1
    per_step = engine.batches_per_step
    per_epoch = len(batches) // per_step  # type: ignore[arg-type]
    if per_epoch < 1:
        raise ValueError(
            f"an epoch of {len(batches)} batches is shorter than one optimizer step "  # type: ignore[arg-type]
            f"({per_step} batches with accumulation)"
        )
    return epochs * per_epoch, epochs


def _train_pass(
    ctx: FitContext, hook: HookList, batches: Iterable[Any], window: list[Any], per_step: int, loss_fn: LossFn
) -> list[Any]:
    """One pass over ``batches``, a step per window of ``per_step`` batches, until they run out, a
    hook stops it or ``ctx.max_steps``; returns the unfinished window's batches (the next pass's)."""
    engine, model, optimizer, max_steps = ctx.engine, ctx.model, ctx.optimizer, ctx.max_steps
    # a stop asked before the first step takes effect after it (hooks see one step)
    for batch in batches:
        if engine.pending_micro_steps:
            # a window an earlier fit() left open when its batches ran out: it carries on
            # batch by batch, as an own loop's would, and its step ends it
            engine.forward_backward(model, batch, loss_fn)
            if not engine.step(optimizer):
                continue
        else:
            window.append(batch)
            if len(window) < per_step:
                continue
            engine.train_window(model, optimizer, window, loss_fn)
            window = []
        hook.on_step_end(ctx)
        if ctx.should_stop or engine.state.step >= max_steps:
            break
    return window


def fit(
    engine: Engine,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Any],
    *,
    max_steps: int | None = None,
    epochs: int | None = None,
    hooks: Iterable[Hook] = (),
    loss_fn: LossFn = default_loss,
) -> FitContext:
    """Train until ``engine.state.step`` reaches ``max_steps``, the batches run out, or a hook
    requests a stop. ``epochs`` instead of ``max_steps``: that many passes over ``batches`` (each
    iterates it again, so a shuffling DataLoader reshuffles), ``epochs x (len(batches) //
    engine.batches_per_step)`` steps. Returns the context (latest metrics, stop reason)."""
    max_steps, passes = _steps_and_passes(engine, batches, max_steps, epochs)
    per_step = engine.batches_per_step
    # on the device and counted (a loader from setup() is kept as it is)
    batches = engine.setup_loader(batches)
    ctx = FitContext(engine, model, optimizer, max_steps)
    hook = HookList(hooks)
    hook.on_fit_start(ctx)
    model.train()
    window: list[Any] = []  # this step's loader batches (a window may span two passes)
    try:
        for _ in range(passes):
            if engine.state.step >= max_steps:
                break
            window = _train_pass(ctx, hook, batches, window, per_step, loss_fn)
            if ctx.should_stop:
                break
        # the batches ran out inside a window: its batches train as an own loop's would, their
        # gradients pending (the data position counts them)
        for batch in window:
            engine.forward_backward(model, batch, loss_fn)
        hook.on_fit_end(ctx)
    except BaseException as exc:  # also a failing on_fit_end: every hook still gets to clean up
        hook.on_exception(ctx, exc)
        raise
    return ctx
