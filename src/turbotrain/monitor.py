"""Monitoring: windowed throughput and the latest loss every ``log_every`` steps, to sinks.

The only host-device synchronisation is the loss read on logging steps; every other step the
monitor does an integer modulo and returns. Sinks: ``metrics.jsonl`` and a rich progress bar.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .hooks import FitContext, Hook, every

Probe = Callable[[FitContext], dict[str, Any]]


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per logged step, appended and flushed so a crash loses at most one line."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record, allow_nan=False, default=_jsonable) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _jsonable(x: Any) -> Any:
    return str(x)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


class ProgressSink:
    """A rich progress bar with loss, tokens/s and ETA on a terminal; plain lines otherwise."""

    def __init__(self, total_steps: int, start_step: int = 0, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.live = self.console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.live,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, stats="")
        self.progress.start()

    def write(self, record: dict[str, Any]) -> None:
        stats = format_record(record)
        if self.live:
            self.progress.update(self.task, completed=record["step"], stats=stats)
        else:
            self.console.print(f"step {record['step']:>6} | {stats}", highlight=False)

    def close(self) -> None:
        self.progress.stop()


def format_record(record: dict[str, Any]) -> str:
    """The short human line for one metrics record."""
    parts = []
    if record.get("loss") is not None:
        parts.append(f"loss {record['loss']:.4f}")
    if record.get("val_loss") is not None:
        parts.append(f"val {record['val_loss']:.4f}")
    if record.get("tokens_per_s"):
        parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    elif record.get("samples_per_s"):
        parts.append(f"{record['samples_per_s']:,.1f} samples/s")
    if record.get("mfu") is not None:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    if record.get("mem_peak_gib") is not None:
        parts.append(f"peak {record['mem_peak_gib']:.2f} GiB")
    return " | ".join(parts)


class Monitor(Hook):
    """Every ``interval`` steps: loss (a host-device sync), lr, throughput over the window since
    the last record, plus whatever the ``probes`` add (memory, MFU, GPU utilisation).

    Also measures the time to the first step (one extra sync, once) so warm-up and compilation
    are reported apart from steady-state throughput.
    """

    def __init__(self, interval: int, sinks: Iterable[Sink] = (), probes: Iterable[Probe] = ()) -> None:
        self.interval = interval
        self.sinks = list(sinks)
        self.probes = list(probes)
        self.records: list[dict[str, Any]] = []
        self.first_step_s: float | None = None
        self._t0 = 0.0
        self._last: tuple[float, int, int, int] = (0.0, 0, 0, 0)  # time, step, samples, tokens
        self._side_s = 0.0  # ctx.side_s at the last record

    def on_fit_start(self, ctx: FitContext) -> None:
        s = ctx.engine.state
        self._t0 = time.perf_counter()
        self._last = (self._t0, s.step, s.samples, s.tokens)
        self._start_step = s.step

    def on_step_end(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        if self.first_step_s is None and step == self._start_step + 1:
            ctx.engine.synchronize()  # host-device sync point, once: time to first step
            self.first_step_s = time.perf_counter() - self._t0
            ctx.metrics["first_step_s"] = self.first_step_s
            self._last = (time.perf_counter(), step, ctx.engine.state.samples, ctx.engine.state.tokens)
            self._side_s = ctx.side_s
        elif every(step, self.interval):
            self.log(ctx)

    def on_fit_end(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        last = self.records[-1] if self.records else {}
        if last.get("step") != step or (ctx.metrics.get("val_step") == step and "val_loss" not in last):
            self.log(ctx)
        for sink in self.sinks:
            sink.close()

    def on_exception(self, ctx: FitContext, exc: BaseException) -> None:
        for sink in self.sinks:
            sink.close()

    def log(self, ctx: FitContext) -> dict[str, Any]:
        engine, s = ctx.engine, ctx.engine.state
        loss = engine.last_loss
        record: dict[str, Any] = {
            "step": s.step,
            "loss": _finite(float(loss.item())) if loss is not None else None,  # host-device sync point
        }
        now = time.perf_counter()
        t, step, samples, tokens = self._last
        dt = now - t - (ctx.side_s - self._side_s)  # evaluation and checkpoint time are not training
        self._side_s = ctx.side_s
        if dt > 0 and s.step > step:
            record["step_ms"] = 1000 * dt / (s.step - step)
            record["samples_per_s"] = (s.samples - samples) / dt
            record["tokens_per_s"] = (s.tokens - tokens) / dt
        self._last = (now, s.step, s.samples, s.tokens)
        if engine.scheduler is not None:
            record["lr"] = engine.scheduler.get_last_lr()[0]
        elif ctx.optimizer is not None:
            record["lr"] = ctx.optimizer.param_groups[0]["lr"]
        record["elapsed_s"] = now - self._t0
        record["samples"], record["tokens"] = s.samples, s.tokens
        if ctx.metrics.get("val_step") == s.step:
            record["val_loss"] = ctx.metrics.get("val_loss")
        for probe in self.probes:
            record.update(probe(ctx))
        ctx.metrics.update({k: v for k, v in record.items() if k != "val_loss"})
        self.records.append(record)
        for sink in self.sinks:
            sink.write(record)
        return record
