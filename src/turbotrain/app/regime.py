"""The run's regime, named from a short probe of its real step: data-bound (the loader wait >=
``DATA_SHARE`` of the step), launch-bound (the device idles >= ``IDLE_SHARE``: it waits on the host's
launches), compute-bound (achieved FLOP/s >= ``COMPUTE_SHARE`` of the datasheet peak) or
memory-bandwidth-bound (busy, well under the peak); on a CPU launch overhead and compute cannot be
told apart: 'not separable'. The probe comes from ``profile``'s trace (:func:`probe_from`) or from
:class:`Timeline` on a few steps of the real run (``doctor --model``, ``train`` through ``choose``);
:func:`classify` is pure. docs/choose.md#the-regime.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..core.meter.clock import Stamp
from ..loop.hooks import FitContext, Hook

DATA_SHARE = 0.25
IDLE_SHARE = 0.30
COMPUTE_SHARE = 0.35


@dataclass(frozen=True)
class Probe:
    """Per-step figures of a short probe (ms; FLOP/s in TFLOP/s); None where not measured."""

    step_ms: float
    data_wait_ms: float = 0.0
    device_busy_ms: float | None = None
    host_enqueue_ms: float | None = None
    tflops: float | None = None
    peak_tflops: float | None = None


@dataclass(frozen=True)
class Regime:
    name: str
    why: str

    def line(self) -> str:
        return f"regime: {self.name} ({self.why})"


def classify(p: Probe) -> Regime:
    """The regime of the probed step (see the module docstring)."""
    step = max(p.step_ms, 1e-9)
    if p.data_wait_ms >= DATA_SHARE * step:
        return Regime(
            "data-bound", f"the host waits {p.data_wait_ms:.2f} ms of the {step:.2f} ms step on the loader"
        )
    busy = p.device_busy_ms
    idle = 0.0 if busy is None else max(step - busy, 0.0) / step
    if idle >= IDLE_SHARE:
        host = f"; the host takes {p.host_enqueue_ms:.2f} ms to enqueue it" if p.host_enqueue_ms else ""
        idles = f"idles {idle:.0%} waiting on the host's launches{host}"
        return Regime(
            "launch-bound", f"the device is busy {busy:.2f} ms of the {step:.2f} ms step and {idles}"
        )
    share = p.tflops / p.peak_tflops if p.tflops and p.peak_tflops else None
    if share is not None and share >= COMPUTE_SHARE:
        return Regime("compute-bound", f"{p.tflops:.1f} TFLOP/s achieved, {share:.0%} of the datasheet peak")
    if share is not None:
        at = f"at {share:.0%} of its peak FLOP/s ({p.tflops:.1f} of {p.peak_tflops:.0f} TFLOP/s)"
        busy_share = f"busy {busy / step:.0%} of the step, " if busy is not None else ""
        return Regime("memory-bandwidth-bound", f"the device is {busy_share}{at}: its kernels wait on memory")
    if busy is not None:
        apart = "(no datasheet peak for it: compute and bandwidth cannot be told apart)"
        return Regime("compute-bound", f"the device is busy {busy / step:.0%} of the step {apart}")
    return Regime(
        "not separable",
        "on a CPU the host runs the kernels: launch overhead and compute cannot be told apart, "
        f"{p.data_wait_ms:.2f} ms of the {step:.2f} ms step waits on the loader",
    )


def profiled_scale(figures: Mapping[str, Any], trace: Mapping[str, Any]) -> float:
    """The timed steps' median over the profiled step time (the profiled steps run slower under
    the profiler): what scales a profiled time to the report's one step time; 1.0 unprofiled."""
    profiled = trace.get("profiled_step_ms")
    return float(figures["step_ms_median"]) / profiled if profiled else 1.0


def probe_from(
    figures: dict[str, Any], trace: dict[str, Any] | None = None, peak_tflops: float | None = None
) -> Probe:
    """The probe from :func:`turbotrain.app.measure.run`'s figures and, when profiled,
    :func:`turbotrain.app.profile.trace.analyze`'s trace (device busy time; the host's time of the
    step's phases as its enqueue time)."""
    trace = trace or {}
    device = trace.get("device") or {}
    phases = trace.get("phases") or {}
    enqueue = sum(v.get("host_ms", 0.0) for k, v in phases.items() if k not in ("data", "hooks", "other"))
    host = profiled_scale(figures, trace) * enqueue or None  # the host time, scaled to the timed step
    found = {"device_busy_ms": device.get("busy_ms"), "host_enqueue_ms": host, "peak_tflops": peak_tflops}
    return probe_of({**figures, **found})


PROBE_STEPS = 3  # optimizer steps probed after the timed ones (CUDA only)
# torch.cuda._sleep's spin: ~1.5 GHz; only needs to outlast the host's enqueue
SLEEP_CYCLES_PER_MS = 1_500_000
QUEUE_FULL = 0.9  # the host's enqueue took this share of the sleep: the launch queue filled, the host waited


class Timeline(Hook):
    """Host enqueue time against device busy time of :data:`PROBE_STEPS` steps after ``after``, no
    profiler, no sync per step (CUDA only; how: docs/choose.md#the-regime). A host span near the
    sleep means the launch queue filled: then only the busy time counts."""

    def __init__(self, after: int, steps: int = PROBE_STEPS) -> None:
        self.after, self.steps = after, steps
        self.pairs: list[tuple[Stamp, Stamp, float, float]] = []  # start, end, host ms, sleep ms
        self._open: tuple[Stamp, float, float] | None = None
        self._last = 0.0

    def on_step_end(self, ctx: FitContext) -> None:
        device = ctx.engine.device
        now = time.perf_counter()
        if device.type != "cuda":
            return
        step = ctx.engine.state.step
        if self._open is not None:
            start, t0, sleep_ms = self._open
            self.pairs.append((start, Stamp(device), 1000 * (now - t0), sleep_ms))
            self._open = None
        if self.after <= step < self.after + self.steps:
            sleep_ms = min(max(3000 * (now - self._last), 20.0), 1000.0)
            torch.cuda._sleep(int(sleep_ms * SLEEP_CYCLES_PER_MS))
            self._open = (Stamp(device), time.perf_counter(), sleep_ms)
        self._last = time.perf_counter()

    def figures(self) -> dict[str, Any]:
        """``device_busy_ms`` and ``host_enqueue_ms`` (medians; None where not measured)."""
        if not self.pairs:
            return {}
        torch.cuda.synchronize()  # host-device sync point: once, at the probe's end
        busy = statistics.median(a.ms_to(b) for a, b, _, _ in self.pairs)
        full = any(host >= QUEUE_FULL * sleep for _, _, host, sleep in self.pairs)
        host = None if full else statistics.median(h for _, _, h, _ in self.pairs)
        return {"device_busy_ms": busy, "host_enqueue_ms": host, "launch_queue_full": full}


def probe_of(figures: Mapping[str, Any]) -> Probe:
    """The probe from :func:`turbotrain.app.measure.run`'s figures with :meth:`Timeline.figures`
    and ``peak_tflops`` merged in (what :func:`probe_run` and ``choose`` keep)."""
    rest = {k: figures.get(k) for k in ("device_busy_ms", "host_enqueue_ms", "tflops", "peak_tflops")}
    return Probe(float(figures["step_ms_median"]), float(figures.get("data_wait_ms_per_step") or 0.0), **rest)


CPU_LINE = (
    "regime: not separable on a CPU (the host runs the kernels: launch overhead and compute cannot be "
    "told apart)"
)
