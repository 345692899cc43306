"""Settings a run resolves from its data and its batch search before it trains (``train.epochs``,
``optim.lr_scaling``), and the warning for a warmup longer than the run."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..base.config import AUTO, MAX_STEPS, RunConfig, setting
from ..base.errors import ConfigError
from ..core.optim import lr_batch_factor, rescale_lr, warmup_length
from ..parts.models.spec import RunData

log = logging.getLogger(__name__)


def resolve_epochs(c: RunConfig, data: RunData, world: int) -> tuple[RunConfig, tuple[int, int] | None]:
    """``train.epochs``: max_steps, validation at each epoch's end, and (steps per epoch, epochs) to log."""
    epochs = c.train.epochs
    if not epochs:
        return c, None
    if not isinstance(c.batch.micro, int):
        raise ConfigError(
            "train.epochs needs a numeric batch.micro (with 'auto' the steps per epoch are not known "
            f"before the search); use {setting('batch.micro', 32)} or train.max_steps"
        )
    per_epoch = data.steps_per_epoch(c, world)
    # said as the field the user set, not as the max_steps it becomes
    if epochs * per_epoch > MAX_STEPS:
        raise ConfigError(
            f"train.epochs = {epochs} is too many for this data ({per_epoch} steps per epoch, at most "
            f"{MAX_STEPS} steps in a run); use {setting('train.epochs', MAX_STEPS // per_epoch)} or fewer"
        )
    log.info(
        "train.epochs = %d: %d optimizer steps per epoch, %d in all", epochs, per_epoch, epochs * per_epoch
    )
    return c.replace(train={"max_steps": epochs * per_epoch, "eval_every": per_epoch}), (per_epoch, epochs)


def warn_long_warmup(c: RunConfig) -> None:
    """A warmup longer than the run: one warning naming the setting."""
    warmup, steps = c.optim.warmup_steps, c.train.max_steps
    if isinstance(warmup, int) and warmup > steps:
        log.warning(
            f"optim.warmup_steps = {warmup} is longer than the run (train.max_steps = {steps}): the "
            f"learning rate peaks at {100 * steps / warmup:.0f}% of optim.lr; use "
            f"{setting('optim.warmup_steps', steps)} or fewer"
        )


def say_recipe(c: RunConfig, own_optimizer: bool, evaluates: bool) -> None:
    """A ``--model`` run's one line of what it inherits from turbotrain's training recipe."""
    o, t = c.optim, c.train
    if own_optimizer:
        optimizer = "your optimizer as it is (no schedule)"
    else:
        warmup = warmup_length(o.warmup_steps, t.max_steps)
        auto = " (auto: 10% of the run)" if o.warmup_steps == AUTO else ""
        decay = "constant" if o.schedule == "constant" else f"{o.schedule} decay to {o.min_lr:g}"
        optimizer = (
            f"AdamW lr {o.lr:g} (weight decay {o.weight_decay:g}), warm-up {warmup} steps{auto}, {decay}"
        )
    every = t.eval_every or t.max_steps
    evaluation = (
        f"evaluation every {every} steps" if evaluates else "no evaluation (the workload has no eval_loader)"
    )
    log.info(
        f"--model {c.model.workload}: turbotrain's recipe: {t.max_steps} steps, {optimizer}, {evaluation} "
        "(change any with --section.key=value)"
    )


def scale_lr(
    c: RunConfig, search: Any, optimizer: torch.optim.Optimizer, scheduler: Any
) -> tuple[RunConfig, str]:
    """``optim.lr_scaling``: lr and min_lr scaled (config, optimizer, schedule) when the batch finder's
    global batch is not the one ``optim.lr`` was tuned for; the config and a note ("": unchanged)."""
    reference = c.optim.lr_batch or c.batch.global_size
    if search is None or not reference:
        return c, ""
    factor = lr_batch_factor(c.optim.lr_scaling, reference, search.global_batch)
    if factor == 1.0:
        return c, ""
    rescale_lr(optimizer, scheduler, factor)
    note = (
        f"{c.optim.lr_scaling}: global batch {search.global_batch} instead of {reference}, "
        f"lr {c.optim.lr:.4g} x {factor:.4g} = {c.optim.lr * factor:.4g}"
    )
    log.info("optim.lr_scaling %s", note)
    return c.replace(optim={"lr": c.optim.lr * factor, "min_lr": c.optim.min_lr * factor}), note
