"""Experts that grow during a ``turbotrain train`` run: ``moe.grow_at_step`` and ``moe.grow_to``.

How: once optimizer step ``grow_at_step`` has trained, the run stops there (:class:`GrowExperts`:
its checkpoint is saved, as at any stop) and resumes at once in the same process
(:func:`turbotrain.app.training.train_prepared`, when :func:`stopped_to_grow`), with a model
built with ``grow_to`` experts per MoE block (the family's start hook,
:func:`turbotrain.parts.models.moe.settings.grown`): the checkpoint's fewer experts
grow into it on load (:func:`turbotrain.parts.models.moe.grown_order`: old experts stay on their
rank, each new one copies an old one plus 1 % noise and goes to the expert-parallel rank holding
the fewest; the optimizer's moments of the new experts start at zero, the old ones are kept).

Why a rebuild through the resume path rather than swapping tensors in the live objects: many
objects hold references to the expert parameters (the optimizer's groups and state, the DDP
wrapper, a compiled graph, expert parallelism's gradient hooks, its global gradient norm and the
optimizer's checkpoint hooks, the precision's scaler); building them all anew from a checkpoint
keeps each of them consistent by construction, and it is the path a resume takes anyway, so the
checkpoint written after the growth resumes exactly like the unstopped run (the unstopped run *is*
such a resume). The cost: one checkpoint save and load, and the start-up again (a compiled model
compiles again, which new shapes need anyway).

A resume of the run builds the model for the step of its newest checkpoint that verifies: ``grow_to`` experts
from ``grow_at_step`` on, ``n_experts`` before (:func:`turbotrain.parts.models.moe.settings.experts_at`).
"""

from __future__ import annotations

import logging
from typing import Any

from ..base.config import RunConfig, setting
from ..loop.hooks import FitContext, Hook
from ..parts.models.moe.settings import MoESettings, grows

log = logging.getLogger(__name__)

GROW_REASON = "moe.grow_at_step"  # how the growth's stop reason starts


class GrowExperts(Hook):
    """Stops the fit once step ``step`` has trained, for the growth (the Checkpointer saves that
    step): only when the fit started before it, the run goes on after it (``max_steps``) and
    nothing else stopped it at that step (a signal's or ``stop_after_steps``'s stop wins: the
    resume that follows builds the grown model all the same)."""

    def __init__(self, step: int, grow_to: int, max_steps: int) -> None:
        self.step, self.grow_to, self.max_steps = step, grow_to, max_steps
        self.start_step = 0

    def on_fit_start(self, ctx: FitContext) -> None:
        self.start_step = ctx.engine.state.step

    def on_step_end(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        if not ctx.should_stop and self.start_step < self.step == step < self.max_steps:
            ctx.request_stop(f"{GROW_REASON} = {self.step}: growing to {self.grow_to} experts")
            log.info(
                "%s: saving step %d, then resuming from it with the grown experts", ctx.stop_reason, step
            )


def growth_stops(c: RunConfig) -> list[Hook]:
    """``[GrowExperts]`` for a run whose experts grow, ``[]`` otherwise (what training adds)."""
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
