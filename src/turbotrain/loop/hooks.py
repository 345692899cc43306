"""Hooks: components the loop calls at fixed events; each decides itself whether it is its turn, so
the loop stays free of ``if log_step: ...`` branches (after torchtitan's trainer components)."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..base.signals import active as active_signals

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..core.engine import Engine

log = logging.getLogger(__name__)


@dataclass
class FitContext:
    """What hooks see and may change: the run's objects, the latest metrics and a stop flag."""

    engine: Engine
    model: nn.Module
    optimizer: torch.optim.Optimizer
    max_steps: int
    should_stop: bool = False
    stop_reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)  # latest values, filled by hooks
    side_s: float = 0.0  # seconds spent in hooks' side work (evaluation, checkpoints): not training

    def request_stop(self, reason: str) -> None:
        self.should_stop, self.stop_reason = True, reason


class Hook:
    """No-op base: override the events you need."""

    def on_fit_start(self, ctx: FitContext) -> None: ...

    def on_step_end(self, ctx: FitContext) -> None: ...

    def on_fit_end(self, ctx: FitContext) -> None: ...

    def on_exception(self, ctx: FitContext, exc: BaseException) -> None: ...


class HookList(Hook):
    def __init__(self, hooks: Iterable[Hook] = ()) -> None:
        self.hooks = list(hooks)

    def on_fit_start(self, ctx: FitContext) -> None:
        for h in self.hooks:
            h.on_fit_start(ctx)

    def on_step_end(self, ctx: FitContext) -> None:
        for h in self.hooks:
            h.on_step_end(ctx)

    def on_fit_end(self, ctx: FitContext) -> None:
        for h in self.hooks:
            h.on_fit_end(ctx)

    def on_exception(self, ctx: FitContext, exc: BaseException) -> None:
        """Every hook cleans up even when an earlier one's cleanup fails; the exception propagates."""
        for h in self.hooks:
            try:
                h.on_exception(ctx, exc)
            except Exception:
                log.exception("hook %s failed while handling %s", type(h).__name__, type(exc).__name__)


def every(step: int, interval: int) -> bool:
    """True on multiples of ``interval`` (never when the interval is 0)."""
    return interval > 0 and step % interval == 0


class StopAfter(Hook):
    """End this invocation after ``step``; one that starts at or past it (a resume) is not stopped."""

    def __init__(self, step: int) -> None:
        self.step, self.start_step = step, 0

    def on_fit_start(self, ctx: FitContext) -> None:
        self.start_step = ctx.engine.state.step

    def on_step_end(self, ctx: FitContext) -> None:
        if self.step > self.start_step and ctx.engine.state.step >= self.step:
            ctx.request_stop(f"stop_after_steps = {self.step}")


class StopOnSignal(Hook):
    """SIGTERM/SIGINT/SIGUSR1 end the run after the current step (the final checkpoint is written); a
    second one interrupts at once. Under a command's handlers (:mod:`turbotrain.base.signals`) it tells
    them what the first does, else it installs its own for the fit. Data parallel (``agree``): the
    ranks agree every ``interval`` steps and stop together (one alone would hang the others)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, agree: Callable[[bool], bool] | None = None, interval: int = 1) -> None:
        self._ctx: FitContext | None = None
        self._previous: dict[int, Any] = {}
        self._controller: Any = None  # the process-wide StopSignals, when installed
        self.agree, self.interval = agree, interval
        self._pending = ""  # a signal seen here, not yet agreed on

    def _first(self, name: str) -> None:
        if self._ctx is not None and self.agree is None:
            self._ctx.request_stop(f"signal {name}")
        elif self._ctx is not None:
            self._pending = f"signal {name}"

    def _handle(self, signum: int, frame: Any) -> None:
        if self._ctx is None or self._ctx.should_stop or self._pending:
            self._restore()
            raise KeyboardInterrupt
        self._first(signal.Signals(signum).name)

    def on_step_end(self, ctx: FitContext) -> None:
        if (
            self.agree is not None
            and every(ctx.engine.state.step, self.interval)
            and self.agree(bool(self._pending))
        ):
            ctx.request_stop(self._pending or "signal on another rank")

    def _restore(self) -> None:
        if self._controller is not None:
            self._controller.on_first(None)  # after the fit: recorded only (the command ends 75)
            self._controller = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def on_fit_start(self, ctx: FitContext) -> None:
        self._ctx = ctx
        self._controller = active_signals()
        if self._controller is not None:
            self._controller.on_first(self._first)
            return
        try:
            for sig in self.SIGNALS:
                if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # inherited as ignored (a background job): stays ignored
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            self._restore()

    def on_fit_end(self, ctx: FitContext) -> None:
        self._restore()

    def on_exception(self, ctx: FitContext, exc: BaseException) -> None:
        self._restore()


class Evaluate(Hook):
    """Validation loss every ``interval`` steps and at the end, into ``ctx.metrics['val_loss']``;
    ``metrics_fn``'s metrics into ``ctx.metrics['val_metrics']`` as ``val_<name>``."""

    def __init__(
        self, batches: list[Any], interval: int, loss_fn: Any = None, metrics_fn: Any = None
    ) -> None:
        self.batches, self.interval, self.loss_fn, self.metrics_fn = batches, interval, loss_fn, metrics_fn
        self.last_step = -1

    def _run(self, ctx: FitContext) -> None:
        if not self.batches:
            return
        kwargs = {"loss_fn": self.loss_fn} if self.loss_fn is not None else {}
        start = time.perf_counter()
        values = ctx.engine.evaluate_metrics(ctx.model, self.batches, metrics_fn=self.metrics_fn, **kwargs)
        ctx.metrics["val_loss"] = values.pop("loss")
        ctx.metrics["val_metrics"] = {f"val_{name}": value for name, value in values.items()}
        ctx.side_s += time.perf_counter() - start
        ctx.metrics["val_step"] = self.last_step = ctx.engine.state.step

    def on_step_end(self, ctx: FitContext) -> None:
        if every(ctx.engine.state.step, self.interval) or ctx.engine.state.step >= ctx.max_steps:
            self._run(ctx)

    def on_fit_end(self, ctx: FitContext) -> None:
        if self.last_step != ctx.engine.state.step:
            self._run(ctx)
