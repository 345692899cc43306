"""The non-finite policy: what the Engine does when the guard has counted non-finite steps.

The window enqueues each step's check on the device (:class:`~turbotrain.core.precision.NonFiniteGuard`)
and a non-finite step is skipped there; every ``sync_every`` optimizer steps the Engine reads the
guard's count (the host-device sync it shares with the monitor) and asks this policy what follows
(``precision.nonfinite``): ``skip`` goes on; ``fallback`` switches to a safer precision after
``max_nonfinite_steps`` new skips; ``stop`` raises :class:`~turbotrain.base.errors.NonFiniteError`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from ..base.config import setting
from ..base.errors import NonFiniteError
from .precision.core import DeviceCaps, Precision  # the classes' own module: one import level less

log = logging.getLogger(__name__)


class NonFinitePolicy:
    """``precision.nonfinite`` and ``max_nonfinite_steps``, with the guard counts it last acted
    on and logged (saved with the engine's state, so a resumed run neither repeats a fallback nor
    logs old skips again)."""

    def __init__(self, mode: str, max_steps: int) -> None:
        self.mode = mode
        self.max_steps = max_steps
        self.acted = 0  # the guard's count when the policy last acted
        self.logged = 0  # the guard's count when skips were last logged

    def decide(self, count: int, step: int, precision: Precision, caps: DeviceCaps) -> str | None:
        """Given the guard's ``count`` at optimizer step ``step``: the precision to fall back to,
        or None to go on. Logs new skips once; raises NonFiniteError under ``stop``, or when
        there is no safer precision."""
        new = count - self.acted
        if new <= 0:
            return None
        if count > self.logged:  # once per new skip, not again at every poll
            log.warning(
                "%d non-finite step(s) skipped by step %d (%s)", count - self.logged, step, precision.name
            )
            self.logged = count
        if self.mode == "skip" or new < self.max_steps:
            return None
        where = f"{count} non-finite loss/gradient steps by step {step} in {precision.name}"
        if self.mode == "stop":
            raise NonFiniteError(
                f"{where}; lower optim.lr, check the data, or use {setting('precision.nonfinite', 'fallback')}"
            )
        target = precision.fallback_for(caps)
        if target is None:
            raise NonFiniteError(
                f"{where}, and there is no safer precision to fall back to; lower optim.lr or check the data"
            )
        self.acted = count
        return target

    def load(self, acted: int, seen: int) -> None:
        """A resumed run's counts: ``acted`` as saved, skips up to the guard's ``seen`` already logged."""
        self.acted, self.logged = acted, seen


def move_to_precision(
    models: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None, old: Precision, new: Precision
) -> None:
    """A fallback from ``old`` to ``new`` applied to the training objects: ``old``'s layer swaps
    (fp8's float8 linears) undone, and with another parameter dtype the weights and the
    optimizer's floating-point state cast to it. The parameters stay the same objects, so the
    optimizer still holds them."""
    models = list(models)
    for model in models:
        old.revert_module(model)
    if old.param_dtype != new.param_dtype:
        for model in models:
            model.to(new.param_dtype)
        if optimizer is not None:
            for state in optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.is_floating_point() and key != "step":
                        state[key] = value.to(new.param_dtype)
