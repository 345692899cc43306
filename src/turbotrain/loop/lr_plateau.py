"""The hook that feeds validation losses to the adaptive (plateau) LR schedule, right after
Evaluate: the host float Evaluate read, so adapting the LR costs no sync of its own. A lowered LR
is logged and recorded as an event."""

from __future__ import annotations

import logging

from ..core.optim import PlateauLR
from .hooks import FitContext, Hook

log = logging.getLogger(__name__)


class ObservePlateau(Hook):
    """After each evaluation, give its validation loss to ``scheduler`` (a :class:`PlateauLR`)."""

    def __init__(self, scheduler: PlateauLR) -> None:
        self.scheduler = scheduler
        self.seen_step = -1

    def on_step_end(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        if ctx.metrics.get("val_step") != step or self.seen_step == step or "val_loss" not in ctx.metrics:
            return
        self.seen_step = step
        s = self.scheduler
        best = s.best
        if s.observe(float(ctx.metrics["val_loss"])):
            lr = s.get_last_lr()[0]
            detail = (
                f"validation loss {ctx.metrics['val_loss']:.4f} has not improved on {best:.4f} for "
                f"{s.patience + 1} evaluations: lr x {s.factor} -> {lr:.3g}"
            )
            log.info("plateau schedule: %s", detail)
            ctx.engine.record_event("lr_plateau", detail)
