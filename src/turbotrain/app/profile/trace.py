"""A torch.profiler window over a few training steps (:class:`ProfilerWindow`), and the per-step
figures of its events (:func:`analyze`): host time per phase from the ranges turbotrain marks and
PyTorch emits, the rest "other"; on CUDA device time, host-to-device copies and idle gaps."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType

from ...loop.hooks import FitContext
from ..measure import DATA_LABEL, FORWARD_LABEL, HOOK_LABEL
from .syncs import StepWindow

PHASES = ("data", "forward", "backward", "optimizer", "hooks")
PHASE_PREFIXES = (
    ("autograd::engine::evaluate_function", "backward"),
    (("Optimizer.step#", "Optimizer.zero_grad#"), "optimizer"),
    (HOOK_LABEL, "hooks"),
)


def phase_of(name: str) -> str | None:
    """The phase a host range belongs to, by the name PyTorch or turbotrain gave it."""
    if name in (DATA_LABEL, FORWARD_LABEL):
        return "data" if name == DATA_LABEL else "forward"
    return next((phase for prefix, phase in PHASE_PREFIXES if name.startswith(prefix)), None)


@contextlib.contextmanager
def _without_kineto_markers() -> Iterator[None]:
    """The profiler's start and stop with what they write to the process's stderr (file
    descriptor 2) passed on, less kineto's own markers (``USDT: ... profiler_start``), which
    no log level turns off and which say nothing to the reader."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as caught:
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(keepends=True) if not line.startswith(b"USDT:")]
            if kept:
                os.write(2, b"".join(kept))


class ProfilerWindow(StepWindow):
    """Profile optimizer steps ``after + 1`` to ``after + steps`` (CPU activity, and CUDA's on a GPU)."""

    def __init__(self, device: torch.device, after: int, steps: int) -> None:
        super().__init__(after, steps)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities, with_stack=True)
        self.window_s = self._t0 = 0.0

    def begin(self, ctx: FitContext) -> None:
        ctx.engine.synchronize()  # host-device sync point: the window starts with an empty queue
        with _without_kineto_markers():
            self.prof.start()
        self._t0 = time.perf_counter()

    def end(self, ctx: FitContext | None) -> None:
        if ctx is not None:  # not at an exception: timed
            ctx.engine.synchronize()  # host-device sync point: the window's last kernels are in it
            self.window_s = time.perf_counter() - self._t0
        with _without_kineto_markers():
            self.prof.stop()

    def export(self, path: Path) -> Path:
        """The window's Chrome trace (open in chrome://tracing or ui.perfetto.dev); gzipped for .gz."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(path))
        return path


def _union_us(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _ancestors(event: Any) -> Iterable[Any]:
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def _outermost(events: list[Any], pred: Callable[[Any], bool]) -> list[Any]:
    """Events for which ``pred`` holds and no ancestor's does (no double counting of nesting)."""
    return [e for e in events if pred(e) and not any(pred(a) for a in _ancestors(e))]


def _span(e: Any) -> tuple[float, float]:
    return float(e.time_range.start), float(e.time_range.end)


def time_weighted_median(durations_us: Iterable[float]) -> float | None:
    """Half of the time goes to operators at most this long (us; None for none). Unlike the plain
    median it follows the time: one 300 us matmul and three 10 us element-wise operators give
    300 us (the plain median says 10), so the regime does not flip with the CPU's speed."""
    ordered = sorted(durations_us)
    if not ordered:
        return None
    half = sum(ordered) / 2
    return next((d for d, seen in zip(ordered, accumulate(ordered)) if seen >= half), ordered[-1])


def analyze(window: ProfilerWindow) -> dict[str, Any]:
    """Per-step figures of the profiled window."""
    events = list(window.prof.events())
    steps = max(window.steps, 1)
    host = [e for e in events if e.device_type == DeviceType.CPU]
    window_us = window.window_s * 1e6
    step_ms = window_us / 1000 / steps
    aten = _outermost(host, lambda e: e.name.startswith("aten::"))
    forward_ops = [e for e in aten if any(a.name == FORWARD_LABEL for a in _ancestors(e))]
    forward_us = [e.cpu_time_total for e in forward_ops]
    out: dict[str, Any] = {
        "profiled_steps": steps,
        "profiled_step_ms": step_ms,
        "phases": _phases(host, window_us, steps),
        "forward_ops_per_step": len(forward_ops) / steps,
        "forward_op_median_us": statistics.median(forward_us) if forward_us else None,
        "forward_op_time_median_us": time_weighted_median(forward_us),
    }
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    if kernels:
        out["device"] = _device_timeline(kernels, window_us, steps)
    return out


def _phases(host: list[Any], window_us: float, steps: int) -> dict[str, dict[str, float]]:
    """Host (and device) ms per step of each phase; "other" is the window's time outside them."""
    phases: dict[str, dict[str, float]] = {}
    covered: list[tuple[float, float]] = []
    for phase in PHASES:
        outer = _outermost(host, lambda e, p=phase: phase_of(e.name) == p)  # type: ignore[misc]
        spans = [_span(e) for e in outer]
        covered.extend(spans)
        device_us = sum(float(getattr(e, "device_time_total", 0.0) or 0.0) for e in outer)
        phases[phase] = {"host_ms": _union_us(spans) / 1000 / steps, "device_ms": device_us / 1000 / steps}
    phases["other"] = {"host_ms": max(window_us - _union_us(covered), 0.0) / 1000 / steps, "device_ms": 0.0}
    step_ms = window_us / 1000 / steps
    for p in phases.values():
        p["share"] = p["host_ms"] / step_ms if step_ms else 0.0
    return phases


def _device_timeline(kernels: list[Any], window_us: float, steps: int) -> dict[str, float]:
    """CUDA: busy and idle ms per step, host-to-device copies, kernels per step and their median."""
    busy = _union_us(_span(k) for k in kernels)
    durations = [_span(k)[1] - _span(k)[0] for k in kernels]
    return {
        "busy_ms": busy / 1000 / steps,
        "idle_ms": max(window_us - busy, 0.0) / 1000 / steps,
        "idle_share": max(window_us - busy, 0.0) / window_us if window_us else 0.0,
        "h2d_copy_ms": sum(d for d, k in zip(durations, kernels) if "HtoD" in k.name) / 1000 / steps,
        "kernels_per_step": len(kernels) / steps,
        "kernel_median_us": statistics.median(durations),
    }
