"""The non-finite policy (``precision.nonfinite``), asked every ``sync_every`` steps when the Engine
reads the guard's count: ``skip`` goes on; ``fallback`` switches to a safer precision after
``max_nonfinite_steps`` new skips; ``stop`` raises :class:`~turbotrain.base.errors.NonFiniteError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..base.config import setting
from ..base.errors import NonFiniteError
from .precision.core import DeviceCaps, Precision  # the classes' own module: one import level less
from .window import Window

log = logging.getLogger(__name__)


class NonFinitePolicy:
    """The policy over the ``window``'s guard and precision, with the counts it acted on and logged."""

    def __init__(
        self, mode: str, max_steps: int, window: Window, caps: DeviceCaps, build: Callable[[str], Precision]
    ) -> None:
        self.mode = mode
        self.max_steps = max_steps
        self.window, self.caps, self.build = window, caps, build
        self.acted = 0  # the guard's count when the policy last acted
        self.logged = 0  # the guard's count when skips were last logged

    def poll(self, step: int, optimizer: torch.optim.Optimizer | None) -> str:
        """Read the guard's count (host-device sync point) and act: the fallback's detail, else ""."""
        target = self.decide(self.window.guard.poll(), step, self.window.precision, self.caps)
        return self.switch(target, optimizer) if target is not None else ""

    def switch(self, mode: str, optimizer: torch.optim.Optimizer | None) -> str:
        """Change the window's precision mid-run (a fallback); returns the event's detail."""
        old = self.window.precision
        self.window.set_precision(self.build(mode))
        move_to_precision(self.window.models, optimizer, old, self.window.precision)
        detail = f"{old.name} -> {mode} after {self.window.guard.seen} non-finite steps"
        log.warning("precision fallback: %s", detail)
        return detail

    def state_dict(self) -> dict[str, Any]:
        """The precision's, the guard's and the policy's state, for the engine's."""
        precision = self.window.precision
        return {
            "precision_name": precision.name,
            "precision": precision.state_dict(),
            "guard": self.window.guard.state_dict(),
            "nonfinite_acted": self.acted,
        }

    def load_state_dict(
        self, sd: Mapping[str, Any], fell_back: bool, optimizer: torch.optim.Optimizer | None
    ) -> None:
        """:meth:`state_dict`'s, before the weights load; ``fell_back``: keep the saved, safer precision."""
        if fell_back and sd.get("precision_name") and sd["precision_name"] != self.window.precision.name:
            self.switch(sd["precision_name"], optimizer)
        self.window.precision.load_state_dict(sd.get("precision", {}))
        self.window.guard.load_state_dict(sd.get("guard", {}))
        self.acted, self.logged = int(sd.get("nonfinite_acted", 0)), self.window.guard.seen

    def decide(self, count: int, step: int, precision: Precision, caps: DeviceCaps) -> str | None:
        """The precision to fall back to given the guard's ``count``, or None; raises under ``stop``."""
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


def move_to_precision(
    models: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None, old: Precision, new: Precision
) -> None:
    """A fallback applied: layer swaps undone, weights and optimizer state cast to ``new``'s dtype."""
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
