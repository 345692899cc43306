"""An out-of-memory error injected into training, for the tests of the out-of-memory policy
(``turbotrain.core.oom``): a real ``torch.OutOfMemoryError``, once per engine, after the forward of
the last micro-batch of optimizer step N and before its backward, where a micro-batch too large
for the device would raise it.

In a test's own process: ``with inject_oom(N): ...`` arms every Engine made inside the block
(a run that ``train()`` builds too). In a ``python -m turbotrain`` subprocess: ``TT_FAULT=oom:N``
(sitecustomize.py in this folder, through :func:`faults.faultenv.fault_env`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from turbotrain.core.engine import Engine


def arm(engine: Engine, at_step: int) -> None:
    """``engine`` raises the injected error once, in optimizer step ``at_step`` (counted from 1)."""
    window = engine.window
    forward = window.forward
    fired = [False]

    def forward_then_oom(model: torch.nn.Module, batch: Any, loss_fn: Any) -> torch.Tensor:
        loss = forward(model, batch, loss_fn)
        last = window.pending == window.accumulation - 1  # this micro-batch's backward ends the window
        if not fired[0] and last and engine.state.step + 1 == at_step:
            fired[0] = True
            raise torch.OutOfMemoryError(f"injected out-of-memory error in step {at_step}")
        return loss

    window.forward = forward_then_oom  # type: ignore[method-assign]


def install(at_step: int) -> Callable[[], None]:
    """Arm every Engine made from now on (see :func:`arm`); returns what undoes it."""
    init = Engine.__init__

    def armed_init(self: Engine, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        arm(self, at_step)

    Engine.__init__ = armed_init  # type: ignore[method-assign]
    return lambda: setattr(Engine, "__init__", init)


@contextlib.contextmanager
def inject_oom(at_step: int) -> Iterator[None]:
    """Arm every Engine made inside the block (see :func:`arm`)."""
    undo = install(at_step)
    try:
        yield
    finally:
        undo()
