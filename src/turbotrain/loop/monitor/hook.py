"""The Monitor: every ``log_every`` steps one record (loss, lr, the window's throughput, what its
probes add) to its sinks."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from ...base.atomic import DiskFullError
from ...parts.hardware import device_line
from ..hooks import FitContext, Hook, every

log = logging.getLogger(__name__)

# a probe's one-time warning (``memory_warning``): in ``fit()`` also an engine event of that kind
WARNING_SUFFIX = "_warning"

# Called on logging steps with the record so far; returns keys to merge in. Optional: ``start()``
# and ``close()`` (NvmlSampler's thread), ``due(step)``: steps of its own (MemoryProbe's
# ``monitor.memory_every``), whose records hold just the step and its keys (no loss read, no sync).
Probe = Callable[[dict[str, Any]], dict[str, Any]]


class StepProbe(Protocol):
    """A probe with steps of its own (``due``)."""

    def __call__(self, record: dict[str, Any]) -> dict[str, Any]: ...

    def due(self, step: int) -> bool: ...


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _read(value: Any) -> float | None:
    """A device scalar as a float (a host-device sync point); None for None or a non-finite value."""
    x = math.nan if value is None else float(value)
    return x if math.isfinite(x) else None


class Monitor(Hook):
    """Every ``interval`` steps: loss (a host-device sync), lr, throughput over the window since
    the last record, plus whatever the ``probes`` add. The time to the first step (one extra sync,
    once) keeps warm-up and compilation apart. A hook in ``fit()``; in your own loop call
    :meth:`start`, :meth:`observe` after each optimizer step, and :meth:`close`."""

    def __init__(
        self,
        interval: int,
        sinks: Iterable[Sink] = (),
        probes: Iterable[Probe] = (),
        world: int = 1,
        run_dir: Path | None = None,
    ) -> None:
        self.interval = interval
        self.run_dir = run_dir  # named in the run's opening line
        self.world = world  # data-parallel processes: rates are this rank's counts x world
        self.sinks = list(sinks)
        self.probes = list(probes)
        self.records: list[dict[str, Any]] = []
        self.first_step_s: float | None = None
        self._t0: float | None = None
        self._first = -1  # the step whose time to first step is measured
        self._last: tuple[float, int, int, int] = (0.0, 0, 0, 0)  # time, step, samples, tokens
        self._side_s = 0.0  # side_s at the last record
        # probes with steps of their own
        self._own_steps = [cast(StepProbe, p) for p in self.probes if callable(getattr(p, "due", None))]

    def last_loss_record(self) -> dict[str, Any]:
        """The last record holding a loss ({} before the first)."""
        return next((r for r in reversed(self.records) if "loss" in r), {})

    def start(self, step: int = 0, samples: int = 0, tokens: int = 0) -> None:
        """Start the clock (and the probes' threads); else the first :meth:`observe` starts it."""
        for probe in self.probes:
            getattr(probe, "start", lambda: None)()
        self._t0 = time.perf_counter()
        self._last = (self._t0, step, samples, tokens)
        self._first = step + 1

    def observe(
        self,
        step: int,
        loss: Any = None,
        *,
        lr: float | torch.Tensor | None = None,
        samples: int = 0,
        tokens: int = 0,
        val_loss: float | None = None,
        val_metrics: dict[str, float] | None = None,
        logged: dict[str, Any] | None = None,
        grad_norm: Any = None,
        precision: str | None = None,
        peak: str | None = None,
        side_s: float = 0.0,
        force: bool = False,
    ) -> dict[str, Any] | None:
        """The values after optimizer step ``step`` (``samples``/``tokens``: this process's so far;
        ``side_s``: seconds so far not training, left out of the throughput). On logging steps (every
        ``interval``, with a ``val_loss``, or ``force``) it reads ``loss`` and ``grad_norm``
        (host-device sync points) and writes and returns a record; otherwise it reads nothing."""
        self.tick(step)
        self._clock(step, loss, samples, tokens, side_s)
        if not (force or val_loss is not None or every(step, self.interval)):
            due = [p for p in self._own_steps if p.due(step)]
            return self._emit({"step": step}, due) if due else None  # allocator counters only: no sync
        record: dict[str, Any] = {"step": step, "loss": _read(loss)}  # host-device sync point
        now = self._rates(record, step, samples, tokens, side_s)
        known = {
            # a device tensor under whole-step CUDA graphs (capturable LR): sync, logging steps only
            "lr": _read(lr),
            "grad_norm": _read(grad_norm),
            "precision": precision,
            "mfu_peak": peak,
            "val_loss": val_loss,
        }
        assert self._t0 is not None  # started by _clock
        record.update(elapsed_s=now - self._t0, samples=samples, tokens=tokens)
        record.update({k: v for k, v in known.items() if v is not None})
        if val_loss is not None:
            record.update(val_metrics or {})  # val_accuracy, ...: evaluated with the loss
        # engine.log's means: host-device sync point
        record.update({k: _read(v) for k, v in (logged or {}).items()})
        return self._emit(record, self.probes)

    def _clock(self, step: int, loss: Any, samples: int, tokens: int, side_s: float) -> None:
        """Start the clock at the first observation, or take the time to first step."""
        if self._t0 is None:
            self.start(step, samples, tokens)
            self._first = -1  # the clock starts now: no time to first step
        elif step == self._first and self.first_step_s is None:
            if isinstance(loss, torch.Tensor) and loss.is_cuda:
                torch.cuda.synchronize(loss.device)  # host-device sync point, once: time to first step
            now = time.perf_counter()
            self.first_step_s = now - self._t0
            self._last, self._side_s = (now, step, samples, tokens), side_s

    def _rates(self, record: dict[str, Any], step: int, samples: int, tokens: int, side_s: float) -> float:
        """The window's step time and rates into ``record``; starts the next window; returns now."""
        now = time.perf_counter()
        t, last_step, last_samples, last_tokens = self._last
        dt = now - t - (side_s - self._side_s)  # evaluation and checkpoint time are not training
        if dt > 0 and step > last_step:
            record["step_ms"] = 1000 * dt / (step - last_step)
            # The whole run's rates: every rank trains an equal share (the same micro-batch).
            record["samples_per_s"] = self.world * (samples - last_samples) / dt
            record["tokens_per_s"] = self.world * (tokens - last_tokens) / dt
            if self.world > 1:
                record["rank_tokens_per_s"] = (tokens - last_tokens) / dt
        self._last, self._side_s = (now, step, samples, tokens), side_s
        return now

    def tick(self, step: int) -> None:
        """Step ``step`` is done: the progress bar advances; no record, no device read."""
        for sink in self.sinks:  # read each step, so a sink added after the Monitor is built ticks too
            tick = getattr(sink, "tick", None)
            if callable(tick):  # a sink's own `tick` attribute may be data (a counter), not a method
                tick(step)

    def _emit(self, record: dict[str, Any], probes: Iterable[Probe]) -> dict[str, Any]:
        for probe in probes:
            record.update(probe(record))
        self.write_event(record)
        return record

    def write_event(self, record: dict[str, Any]) -> None:
        """A record (or an event, ``{"event": "epoch", ...}``) into the records and every sink."""
        self.records.append(record)
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        """Stop the probes' threads and close the sinks (idempotent)."""
        for probe in self.probes:
            getattr(probe, "close", lambda: None)()
        for sink in self.sinks:
            sink.close()

    def on_fit_start(self, ctx: FitContext) -> None:
        s, engine = ctx.engine.state, ctx.engine
        # the run's one opening line: what it trains, on what, how long, where (summary.md says it again at the end)
        params = sum(p.numel() for p in ctx.model.parameters())
        where = f"; run {self.run_dir}" if self.run_dir is not None else ""
        log.info(
            "training %s params: %s; %d steps%s",
            f"{params:,}",
            device_line(engine.device, engine.precision.name, engine.options.compile_scope),
            ctx.max_steps,
            where,
        )
        self._compiling = engine.options.compile_scope != "off"
        if self._compiling:  # the first step compiles: minutes, say so
            log.info("compiling (first step; torch.compile, %s)...", engine.options.compile_scope)
        self.start(s.step, s.samples, s.tokens)

    def on_step_end(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        # the last step's record comes at the end
        own = step < ctx.max_steps and any(p.due(step) for p in self._own_steps)
        # Evaluate (before this hook) has just validated: record it
        evaluated = ctx.metrics.get("val_step") == step
        if step == self._first or every(step, self.interval) or own or evaluated:
            self._observe(ctx)
        else:
            self.tick(step)  # the bar advances every step: a count, no sync
        if step == self._first and self._compiling and self.first_step_s is not None:
            log.info("compiled: first step %.1f s", self.first_step_s)

    def on_fit_end(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        last = self.last_loss_record()
        if last.get("step") != step or (ctx.metrics.get("val_step") == step and "val_loss" not in last):
            self._observe(ctx, force=True)
        self.close()

    def on_exception(self, ctx: FitContext, exc: BaseException) -> None:
        with contextlib.suppress(DiskFullError):  # the error on its way is the one to report
            self.close()

    def _observe(self, ctx: FitContext, force: bool = False) -> None:
        engine, s, m = ctx.engine, ctx.engine.state, ctx.metrics
        record = self.observe(
            s.step,
            engine.last_loss,
            lr=ctx.optimizer.param_groups[0]["lr"] if ctx.optimizer is not None else None,
            samples=s.samples,
            tokens=s.tokens,
            val_loss=m.get("val_loss") if m.get("val_step") == s.step else None,
            val_metrics=m.get("val_metrics"),
            logged=engine.take_logged(),
            grad_norm=engine.last_grad_norm,
            precision=engine.precision.name,
            peak=engine.precision.mfu_peak(),
            side_s=ctx.side_s,
            force=force,
        )
        for key, text in (record or {}).items():
            if key.endswith(WARNING_SUFFIX) and text:  # a probe's one-time warning
                engine.record_event(key, text)  # into summary.json's events
        m.update(record or {}, first_step_s=self.first_step_s)
