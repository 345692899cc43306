"""The one clock of every measuring tool, the same code on every device (:class:`Stamp`: the only
place ``torch.cuda.Event`` is created)."""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ...base.errors import TurbotrainError
from ...base.units import GIB


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host-device sync point: only before reading clocks


class Stamp:
    """A point on ``device``'s timeline: a CUDA event (read after a synchronize), else ``perf_counter``."""

    def __init__(self, device: torch.device) -> None:
        self.event: Any = None
        self.host = time.perf_counter()
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()

    def ms_to(self, later: Stamp) -> float:
        if self.event is not None:
            return float(self.event.elapsed_time(later.event))
        return 1000 * (later.host - self.host)


@dataclass(frozen=True)
class Timing:
    """Milliseconds of repeated measurements: the median is the figure, the spread beside it."""

    ms: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.ms)

    @property
    def spread(self) -> float:
        """(max - min) / median: 0.1 means the samples span 10 % of the median."""
        return (max(self.ms) - min(self.ms)) / max(self.median, 1e-12)


def median_of(values: Iterable[float | None]) -> float | None:
    """The median of the known values (None left out); None when there are none."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def time_call(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 2) -> Timing:
    """``fn`` timed ``repeats`` times after ``warmup`` untimed calls, synchronized before and after."""
    for _ in range(warmup):
        fn()
    sync(device)  # host-device sync point: timing only
    pairs = []
    for _ in range(repeats):
        start = Stamp(device)
        fn()
        if device.type != "cuda":
            sync(device)
        pairs.append((start, Stamp(device)))
    sync(device)  # host-device sync point: timing only, once, before the events are read
    return Timing(tuple(a.ms_to(b) for a, b in pairs))


class StepClock:
    """Times optimizer steps: ``start()``, ``mark(loss)`` after each, ``finish()`` once (one read)."""

    def __init__(self, device: torch.device, warmup_steps: int, timed_steps: int) -> None:
        if warmup_steps < 1 or timed_steps < 1:
            raise ValueError("StepClock needs at least one warm-up and one timed step")
        self.device, self.warmup, self.timed = device, warmup_steps, timed_steps
        self.steps = 0
        self.losses: list[torch.Tensor] = []
        self.t0 = 0.0
        self.first_step_s: float | None = None
        self.t_warm = 0.0  # host clock at the end of the warm-up
        self.stamps: list[Stamp] = []  # after each step from the end of warm-up
        self.figures: dict[str, Any] | None = None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.t0 = time.perf_counter()

    def mark(self, loss: torch.Tensor | None) -> None:
        """After an optimizer step: keep a copy of its loss (no host sync) and stamp it."""
        self.steps += 1
        if loss is not None:
            self.losses.append(loss.detach().clone())
        n = self.steps
        if n == 1:
            sync(self.device)
            self.first_step_s = time.perf_counter() - self.t0
        if n == self.warmup:
            sync(self.device)
            self.t_warm = time.perf_counter()
        if n >= self.warmup:
            self.stamps.append(Stamp(self.device))

    def finish(self) -> dict[str, Any]:
        """The figures (one synchronize, one loss read); raises on a wrong step count."""
        if self.figures is not None:
            return self.figures
        expected = self.warmup + self.timed
        if self.steps != expected:
            raise TurbotrainError(f"contender ran {self.steps} optimizer steps, expected {expected}")
        sync(self.device)
        timed_s = time.perf_counter() - self.t_warm
        step_ms = [a.ms_to(b) for a, b in zip(self.stamps, self.stamps[1:])]
        losses = torch.stack([x.float().reshape(()) for x in self.losses]).tolist() if self.losses else []
        if len(losses) != expected:
            raise TurbotrainError(f"contender reported {len(losses)} losses for {expected} steps")
        self.figures = {
            "steps": self.steps,
            "time_to_first_step_s": self.first_step_s,
            "timed_s": timed_s,
            "step_ms": step_ms,
            "step_ms_median": statistics.median(step_ms),
            "step_ms_spread": Timing(tuple(step_ms)).spread,
            "losses": losses,
            "first_loss": losses[0],
            "final_loss": losses[-1],
            **peak_memory(self.device),
        }
        return self.figures


def peak_memory(device: torch.device) -> dict[str, float]:
    """CUDA: the allocator's peak allocated/reserved GiB; CPU: the process's peak RSS (not comparable)."""
    if device.type == "cuda":
        return {
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
        }
    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}  # Linux: KiB
