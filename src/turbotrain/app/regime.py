"""The run's regime, named from a short probe of its real step: launch-bound, compute-bound,
memory-bandwidth-bound or data-bound. It says which lever can pay: CUDA graphs and compile for a
launch-bound step, lower precision and bigger matmuls for a compute-bound one, fusion (compile)
and less traffic for a bandwidth-bound one, loader workers for a data-bound one.

The probe's figures (per optimizer step, milliseconds): the step time; the host's time blocked on
the loader; on CUDA the device's busy time (the union of kernel intervals in a profiler window)
and the host's time to enqueue the step; the achieved FLOP/s against the device's datasheet peak.
:func:`probe_from` reads them from ``profile``'s figures and trace; :func:`classify` is pure.

The rule, in order:
- **data-bound**: the host waits on the loader for >= ``DATA_SHARE`` of the step.
- **launch-bound**: the device idles >= ``IDLE_SHARE`` of the step (it waits on the host's launches).
- **compute-bound**: achieved FLOP/s >= ``COMPUTE_SHARE`` of the datasheet peak.
- **memory-bandwidth-bound**: the device is busy, but well under its peak FLOP/s: its kernels wait
  on memory.
- On a CPU (no device timeline, no datasheet peak) launch overhead and compute cannot be told
  apart: the step is named compute-bound, with that caveat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    if p.device_busy_ms is not None:
        idle = max(step - p.device_busy_ms, 0.0) / step
        if idle >= IDLE_SHARE:
            host = f"; the host takes {p.host_enqueue_ms:.2f} ms to enqueue it" if p.host_enqueue_ms else ""
            return Regime(
                "launch-bound",
                f"the device is busy {p.device_busy_ms:.2f} ms of the {step:.2f} ms step and idles {idle:.0%} "
                f"waiting on the host's launches{host}",
            )
    share = p.tflops / p.peak_tflops if p.tflops and p.peak_tflops else None
    if share is not None and share >= COMPUTE_SHARE:
        return Regime("compute-bound", f"{p.tflops:.1f} TFLOP/s achieved, {share:.0%} of the datasheet peak")
    if share is not None:
        busy = f"busy {p.device_busy_ms / step:.0%} of the step, " if p.device_busy_ms is not None else ""
        return Regime(
            "memory-bandwidth-bound",
            f"the device is {busy}at {share:.0%} of its peak FLOP/s ({p.tflops:.1f} of {p.peak_tflops:.0f} TFLOP/s): "
            "its kernels wait on memory",
        )
    if p.device_busy_ms is not None:
        return Regime(
            "compute-bound",
            f"the device is busy {p.device_busy_ms / step:.0%} of the step (no datasheet peak for it: "
            "compute and bandwidth cannot be told apart)",
        )
    return Regime(
        "compute-bound",
        "on a CPU the host runs the kernels: launch overhead and compute cannot be told apart, "
        f"{p.data_wait_ms:.2f} ms of the {step:.2f} ms step waits on the loader",
    )


def probe_from(
    figures: dict[str, Any], trace: dict[str, Any] | None = None, peak_tflops: float | None = None
) -> Probe:
    """The probe from :func:`turbotrain.app.measure.run`'s figures and, when profiled,
    :func:`turbotrain.app.profile.trace.analyze`'s trace (device busy time; the host's time of the
    step's phases as its enqueue time)."""
    trace = trace or {}
    device = trace.get("device") or {}
    phases = trace.get("phases") or {}
    host = (
        sum(v.get("host_ms", 0.0) for k, v in phases.items() if k not in ("data", "hooks", "other")) or None
    )
    return Probe(
        step_ms=float(trace.get("profiled_step_ms") or figures["step_ms_median"]),
        data_wait_ms=float(figures.get("data_wait_ms_per_step") or 0.0),
        device_busy_ms=device.get("busy_ms"),
        host_enqueue_ms=host,
        tflops=figures.get("tflops"),
        peak_tflops=peak_tflops,
    )
