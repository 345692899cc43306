"""turbotrain's monitoring, run directory and report for a training loop it does not drive.

The Hugging Face and Lightning callbacks and the Accelerate helper all feed one :class:`LoopObserver`
with what their trainer tells them; it reuses the Monitor, the FLOP count, the CompileGuard and the
report. Host-device syncs: none of its own per step. A record reads the loss it is handed (one sync
per logging step, marked there); on CUDA the first step's end is synchronised once, to time it."""

from __future__ import annotations

import atexit
import logging
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypedDict

import torch
from torch import nn

from ..app.environment import collect_hardware
from ..app.report import write_report
from ..app.summary import RunFacts, failed_status, write_summary
from ..base.batch import TokenTally, batch_size
from ..base.records import read_metrics
from ..base.rundir import METRICS_FILE, truncate_metrics
from ..core.compile_guard import CompileGuard
from ..loop.monitor import MfuProbe, Monitor, Probe, build_probes, estimate_flops_per_sample
from ..loop.monitor.flops import flop_tokens_per_sample
from ..loop.monitor.trackers import TrackerOptions, build_sinks
from ..parts.hardware import DeviceSpec, lookup_peak

log = logging.getLogger("turbotrain.integrations")

__all__ = ["LoopObserver", "ObserverOptions", "failed_status", "peak_spec", "resumed_counts", "run_name"]

DEFAULT_FOLDER = "turbotrain"  # the callbacks' default run directory: <the trainer's directory>/turbotrain


class ObserverOptions(TypedDict, total=False):
    """The options every integration passes on to its :class:`LoopObserver` (and ``name``)."""

    peak_tflops: float | None  # the device's dense peak for MFU where the GPU is not in the table
    nvml: bool  # sample GPU utilisation
    sinks: tuple[Any, ...]  # more sinks beside metrics.jsonl
    trackers: tuple[str, ...]  # any of "wandb" (offline), "mlflow", "trackio"
    project: str  # the trackers' project or experiment


def run_name(run_dir: str | Path, fallback: str = "") -> str:
    """``run_dir``'s name, or its parent's for the default folder ``turbotrain``; else ``fallback``."""
    path = Path(run_dir).resolve()
    if path.name != DEFAULT_FOLDER:
        return path.name or fallback or DEFAULT_FOLDER
    return path.parent.name or fallback or DEFAULT_FOLDER


def peak_spec(device: torch.device, peak_tflops: float | None = None) -> DeviceSpec | None:
    """The peak MFU is measured against: ``peak_tflops`` (dense, one device), else the GPU's; or None."""
    if peak_tflops is not None:
        if not peak_tflops > 0:
            raise ValueError(f"peak_tflops = {peak_tflops!r}: give the device's dense peak in TFLOP/s (> 0)")
        p = float(peak_tflops)
        return DeviceSpec(f"given peak {p:g} TFLOP/s", p, p, p, p, p, 0.0)
    return lookup_peak(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def resumed_counts(run_dir: Path, step: int) -> tuple[int, int]:
    """Before a resume from the checkpoint of ``step``: this process's samples and tokens at that
    step (its ``checkpoint`` event; else the last record's, one warning), and metrics.jsonl cut after it."""
    path = run_dir / METRICS_FILE
    records = read_metrics(path)[0] if path.is_file() else []
    truncate_metrics(path, step)
    marks = [r for r in records if r.get("event") == "checkpoint" and r["step"] == step]
    if marks:
        return int(marks[-1].get("samples", 0)), int(marks[-1].get("tokens", 0))
    kept = [r for r in records if "event" not in r and r["step"] <= step and "samples" in r]
    last = kept[-1] if kept else {"step": 0, "samples": 0, "tokens": 0}
    log.warning(
        "resumed at step %d without its checkpoint's counts in %s: samples and tokens go on from "
        "step %d's record (the steps between not counted)",
        step,
        path,
        last["step"],
    )
    return int(last["samples"]), int(last["tokens"])


_OPEN: dict[Path, LoopObserver] = {}  # runs not closed yet, by run directory


@atexit.register
def _close_open_runs() -> None:
    """At the process's end, a run still open was left by an exception: its summary says failed."""
    exc = getattr(sys, "last_value", None)  # the exception that ended the process, if one did
    for observer in list(_OPEN.values()):
        try:
            observer.close(failed_status(exc), report=False)
        except Exception as err:  # the process is ending: one line, never a second traceback
            log.warning("turbotrain: %s: summary not written (%s)", observer.run_dir, err)


class LoopObserver:
    """The run directory of one training run in another trainer. ``world``: data-parallel processes
    (rates: this process's counts x world); ``resume_step``: the checkpoint step the trainer resumed
    from; the rest: :class:`ObserverOptions`. A run left open by an exception its trainer does not
    report is closed as failed when the next run starts in its directory, or when the process ends."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        device: torch.device | str,
        framework: str,
        world: int = 1,
        precision: str = "fp32",
        peak_tflops: float | None = None,
        nvml: bool = True,
        sinks: Iterable[Any] = (),
        trackers: Iterable[str] = (),
        project: str = "turbotrain",
        optimizations: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None,
        max_steps: int | None = None,
        name: str | None = None,
        resume_step: int = 0,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.name = name or run_name(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        left = _OPEN.get(self.run_dir.resolve())
        if left is not None:  # its trainer raised and this one starts over (or resumes) here
            left.close("failed: training stopped before its end (a new run started here)", report=False)
        # this process's samples (from shapes) and real tokens (a resume's go on)
        self.samples, tokens = resumed_counts(self.run_dir, resume_step) if resume_step else (0, 0)
        self.tally = TokenTally(tokens)
        self.device = torch.device(device)
        self.framework, self.world, self.precision = framework, world, precision
        self.optimizations = dict(optimizations or {})
        self.config = dict(config or {})
        self.max_steps = max_steps
        self.spec = peak_spec(self.device, peak_tflops)
        if self.spec is None:
            log.info(
                "MFU left out: no datasheet peak for %s (achieved TFLOP/s is still recorded)", self.device
            )
        self.mfu: MfuProbe | None = None  # once FLOPs are known (after the first step)
        self.monitor = self._monitor(sinks, trackers, project, nvml)
        self.guard = CompileGuard()
        self.step = 0
        self.side_s = 0.0  # seconds of work that is not training (FLOP count, checkpoints)
        self.flops_per_sample: float | None = None
        self.flops_source = ""
        self._start = time.perf_counter()
        self._first, self._closed = -1, False
        _OPEN[self.run_dir.resolve()] = self

    def _monitor(self, sinks: Iterable[Any], trackers: Iterable[str], project: str, nvml: bool) -> Monitor:
        """The Monitor: metrics.jsonl, the trackers, more sinks, the probes."""
        options = TrackerOptions(project=project, name=self.name, config=self.config)
        all_sinks: list[Any] = [*build_sinks(["jsonl", *trackers], self.run_dir, options), *sinks]
        probes: list[Probe] = [
            *build_probes(self.device, precision=self.precision, nvml_enabled=nvml),
            lambda record: self.mfu(record) if self.mfu is not None else {},
        ]
        # interval 0: the observer decides the logging steps (its trainer's), the Monitor never does
        return Monitor(0, all_sinks, probes, world=self.world)

    def start(self, step: int = 0) -> None:
        self.step, self._first = step, step + 1
        self.guard.start()
        self.monitor.start(step, self.samples, self.tally.total())
        self._start = time.perf_counter()

    def count(self, batch: Any) -> None:
        """One training micro-batch: its samples (from shapes) and real tokens (summed on the device)."""
        self.samples += batch_size(batch)
        self.tally.add(batch)

    @property
    def tokens(self) -> int:
        """This process's tokens so far (a host-device sync point for masks on a device)."""
        return self.tally.total()

    def step_end(self, step: int, loss: Any = None) -> None:
        """Optimizer step ``step`` is done; on the first one the time to first step (on CUDA one
        host-device sync, once, unless ``loss`` is a CUDA tensor the Monitor synchronises on)."""
        self.step = step
        if step == self._first:
            if self.device.type == "cuda" and not (isinstance(loss, torch.Tensor) and loss.is_cuda):
                torch.cuda.synchronize(self.device)  # host-device sync point, once: time to first step
            self.monitor.observe(step, loss, samples=self.samples, tokens=self.tokens, side_s=self.side_s)

    def record(
        self,
        step: int,
        loss: Any = None,
        *,
        lr: float | None = None,
        grad_norm: Any = None,
        val_loss: float | None = None,
        val_metrics: dict[str, float] | None = None,
    ) -> dict[str, Any] | None:
        """A logging step's record; reads ``loss`` (a host-device sync point for a device tensor)."""
        self.step = max(self.step, step)
        self.guard.check(step)  # host dictionaries only
        return self.monitor.observe(
            step,
            loss,
            lr=lr,
            grad_norm=grad_norm,
            samples=self.samples,
            tokens=self.tokens,
            val_loss=val_loss,
            val_metrics=val_metrics,
            precision=self.precision,
            side_s=self.side_s,
            force=True,
        )

    def checkpointed(self, step: int) -> None:
        """The trainer wrote its checkpoint of ``step``: the counts into metrics.jsonl, for a resume."""
        self.monitor.write_event(
            {"event": "checkpoint", "step": step, "samples": self.samples, "tokens": self.tokens}
        )

    def add_side(self, seconds: float) -> None:
        """``seconds`` of work that is not training (a checkpoint), left out of the throughput."""
        self.side_s += max(0.0, seconds)

    def set_flops(self, flops_per_sample: float, source: str, tokens_per_sample: float = 0.0) -> None:
        """Training FLOPs per sample (counted on ``tokens_per_sample``): TFLOP/s and MFU from now on."""
        self.flops_per_sample, self.flops_source = float(flops_per_sample), source
        self.mfu = MfuProbe(
            self.flops_per_sample, self.spec, self.precision, source, self.world, tokens_per_sample
        )

    def count_flops(
        self, model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any] | None = None
    ) -> None:
        """FLOPs per sample counted once on ``batch`` (side-effect free, its time left out; a failure
        is one warning, and no MFU)."""
        t0 = time.perf_counter()
        try:
            flops, source = estimate_flops_per_sample(model, batch, loss_fn)
        except Exception as exc:  # an optional measurement: training goes on without it
            log.warning("FLOPs not counted, so no TFLOP/s or MFU (%s: %s)", type(exc).__name__, exc)
            return
        finally:
            self.add_side(time.perf_counter() - t0)
        self.set_flops(flops, source, flop_tokens_per_sample(batch))

    def facts(self, status: str) -> RunFacts:
        return RunFacts(
            run=self.name,
            status=status,
            steps=self.step,
            samples=self.samples * self.world,
            tokens=self.tokens * self.world,
            world_size=self.world,
            first_step_s=self.monitor.first_step_s,
            elapsed_s=round(time.perf_counter() - self._start, 3),
            hardware=collect_hardware(self.device),
            flops_per_sample=self.flops_per_sample,
            flops_source=self.flops_source or None,
            peak_tflops=self.mfu.peak_tflops() if self.mfu is not None else None,
            compile=self.guard.summary(),
            optimizations={"precision": self.precision, **self.optimizations},
            more={
                "framework": self.framework,
                **({"max_steps": self.max_steps} if self.max_steps else {}),
                **({"config": self.config} if self.config else {}),
            },
        )

    def close(self, status: str = "completed", report: bool = True) -> dict[str, Any]:
        """The sinks closed, summary.json written and (``report``, completed) the report; idempotent."""
        if self._closed:
            return {}
        self._closed = True
        if _OPEN.get(self.run_dir.resolve()) is self:
            del _OPEN[self.run_dir.resolve()]
        self.monitor.close()
        summary = write_summary(self.run_dir, self.facts(status), self.monitor.records)
        if report and status == "completed":
            summary = write_report(self.run_dir).summary
        return summary
