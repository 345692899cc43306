"""Experts that grow during a ``turbotrain train`` run (``moe.grow_at_step``, ``moe.grow_to``;
docs/moe.md): the run stops at the step, its checkpoint saved, and resumes at once in the same
process with the grown model (a rebuild: the optimizer, DDP, a compiled graph and expert
parallelism's hooks all hold the expert parameters, so each is built anew, consistent).
"""

from __future__ import annotations

import logging
from typing import Any

from ..base.config import RunConfig, setting
from ..loop.hooks import FitContext, Hook, StopAfter
from ..parts.models.moe.settings import MoESettings, grows

log = logging.getLogger(__name__)

GROW_REASON = "moe.grow_at_step"  # how the growth's stop reason starts


class GrowExperts(StopAfter):
    """Stops the fit once step ``step`` has trained (the Checkpointer saves it), when the fit started
    before it, the run goes on after it and nothing else stopped it there."""

    def __init__(self, step: int, grow_to: int, max_steps: int) -> None:
        super().__init__(step)
        self.grow_to, self.max_steps = grow_to, max_steps

    def on_step_end(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        if not ctx.should_stop and self.start_step < self.step == step < self.max_steps:
            ctx.request_stop(f"{GROW_REASON} = {self.step}: growing to {self.grow_to} experts")
            log.info(
                "%s: saving step %d, then resuming from it with the grown experts", ctx.stop_reason, step
            )


def growth_stops(c: RunConfig) -> list[Hook]:
    """``[GrowExperts]`` for a run whose experts grow, ``[]`` otherwise."""
    if not grows(c):
        return []
    e = c.table(MoESettings)
    step, end = e.grow_at_step, c.train.max_steps
    if step >= end:  # legitimate for a later extension of the run: a warning, not a refusal
        log.warning(
            "moe.grow_at_step = %d is at or past train.max_steps = %d: the experts do not grow in this "
            "run (a resume with %s, or any end past it, grows them at step %d)",
            step,
            end,
            setting("train.max_steps", 2 * step),
            step,
        )
    return [GrowExperts(step, e.grow_to, end)]


def stopped_to_grow(summary: dict[str, Any]) -> bool:
    """Whether a run's fit stopped for the growth (then it resumes at once with more experts)."""
    return str(summary.get("stop_reason", "")).startswith(GROW_REASON)
