"""Early stopping on a validation metric, and the one watch of that metric it shares with the best
checkpoint, so both agree on the best (docs/early-stopping.md). It reads the host floats Evaluate
left in ``ctx.metrics`` (no sync of its own); its state is in the run's checkpoint, so a resumed run
stops where an uninterrupted one would."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from difflib import get_close_matches
from typing import Any

from ..base.config import BEST_MODES, BestConfig, setting
from ..base.errors import TurbotrainError
from .hooks import FitContext, Hook

log = logging.getLogger(__name__)


def watch_for(b: BestConfig) -> MetricWatch | None:
    """The watch a run's ``[best]`` settings ask for; None when neither feature is on."""
    return MetricWatch(b.metric, b.mode, b.min_delta) if b.patience or b.checkpoint else None


class MetricWatch:
    """The best value so far of one validation metric (``val_loss`` or ``val_<name>``) by ``mode``; a
    value improves on it when better by more than ``min_delta`` (the metric's units). NaN never
    improves."""

    def __init__(self, metric: str = "val_loss", mode: str = "min", min_delta: float = 0.0) -> None:
        if mode not in BEST_MODES:
            raise ValueError(f"mode = {mode!r}: use 'min' or 'max'")
        self.metric, self.mode, self.min_delta = metric, mode, float(min_delta)
        self.best: float | None = None
        self.best_step = -1
        self.stale = 0  # validation passes since the best one
        self.seen_step = -1  # the step of the last validation pass read

    def improves(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def value(self, ctx: FitContext) -> float:
        """This step's value of the metric from ``ctx.metrics`` (an unknown one: one line)."""
        if self.metric == "val_loss":
            return float(ctx.metrics["val_loss"])
        others = ctx.metrics.get("val_metrics") or {}
        self.require_known(["val_loss", *others])
        return float(others[self.metric])

    def require_known(self, known: Sequence[str]) -> None:
        """The metric is one of ``known``, or one line naming them (and the close name, if any)."""
        if self.metric in known:
            return
        close = get_close_matches(self.metric, known, n=1)
        advice = (
            f"did you mean {close[0]}? ({setting('best.metric', close[0])})"
            if close
            else f"use {setting('best.metric', 'val_loss')} or add it to your workload's metrics_fn"
        )
        raise TurbotrainError(
            f"best.metric = {self.metric!r} is not a metric of this run's validation "
            f"(it computes {', '.join(known)}); {advice}"
        )

    def observe(self, ctx: FitContext) -> bool | None:
        """Read this step's validation pass, once: True when it improved on the best, False when not,
        None when no pass ran at this step (or it was read already)."""
        step = ctx.engine.state.step
        if ctx.metrics.get("val_step") != step or step == self.seen_step or "val_loss" not in ctx.metrics:
            return None
        self.seen_step = step
        value = self.value(ctx)
        if self.improves(value):
            self.best, self.best_step, self.stale = value, step, 0
            return True
        self.stale += 1
        return False

    def facts(self) -> dict[str, Any]:
        """For the run's summary: the metric, its mode, best value and step (None before any)."""
        return {"metric": self.metric, "mode": self.mode, "value": self.best, "step": self.best_step}

    def state_dict(self) -> dict[str, Any]:
        return dict(best=self.best, best_step=self.best_step, stale=self.stale, seen_step=self.seen_step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_step = state["best"], int(state["best_step"])
        self.stale, self.seen_step = int(state["stale"]), int(state["seen_step"])


class EarlyStopping(Hook):
    """End the fit after ``patience`` validation passes in a row without improvement (0: it only
    watches). Placed right after Evaluate: it reads the pass Evaluate just ran."""

    def __init__(self, watch: MetricWatch, patience: int) -> None:
        if patience < 0:
            raise ValueError(f"patience = {patience} must be >= 0")
        self.watch, self.patience = watch, patience

    def on_step_end(self, ctx: FitContext) -> None:
        improved = self.watch.observe(ctx)
        # at the last step the run ends anyway: it completed, early stopping did not end it
        last = ctx.engine.state.step >= ctx.max_steps
        if improved is False and self.patience and self.watch.stale >= self.patience and not last:
            ctx.request_stop(self.reason())
            log.info("%s", ctx.stop_reason)

    def reason(self) -> str:
        """Why the fit stops: the best value and its step, or that the metric was NaN at every pass."""
        w = self.watch
        if w.best is None:  # NaN never improves: no pass was ever the best
            return (
                f"early stopping: {w.metric} was NaN in all {w.stale} validation passes, "
                f"the last at step {w.seen_step}"
            )
        return (
            f"early stopping: {w.metric} did not improve on {w.best:.6g} (step {w.best_step}) "
            f"by more than {w.min_delta:g} in {w.stale} validation passes"
        )

    def on_fit_end(self, ctx: FitContext) -> None:
        self.watch.observe(ctx)  # a final pass (after a signal's stop) counts for the best
