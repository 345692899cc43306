"""Monitoring, checkpoints and a report for your own training loop, in one call (docs/own-loop.md):
:func:`track` gives an own loop the hooks ``fit()`` runs, called by the engine after every step it
takes; they read device values only on logging steps, as in ``fit()``.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from ..base.rundir import CHECKPOINTS
from ..core.engine import Engine, LossFn, default_loss
from ..loop.checkpoint import Checkpointer, restore_latest, run_state
from ..loop.hooks import FitContext, HookList
from ..loop.monitor import MfuProbe, Monitor, TrackerOptions
from ..loop.run_hooks import MonitorPlan, build_hooks, build_monitor
from .environment import collect_hardware
from .report import write_report, write_summary
from .summary import RunFacts, failed_status


def engine_facts(
    engine: Engine,
    monitor: Monitor,
    run: str,
    status: str,
    elapsed_s: float,
    optimizations: dict[str, Any],
    **more: Any,
) -> RunFacts:
    """What the engine and the monitor know of a run (data parallel: all ranks' counts, one rank's
    median tokens/s); ``more``: what only one kind of run knows."""
    mfu = next((p for p in monitor.probes if isinstance(p, MfuProbe)), None)
    world = engine.strategy.world  # data parallel: every rank trains an equal share
    rank_rates = [r["rank_tokens_per_s"] for r in monitor.records if r.get("rank_tokens_per_s")]
    return RunFacts(
        run=run,
        status=status,
        steps=engine.state.step,
        samples=engine.state.samples * world,
        tokens=engine.state.tokens * world,
        world_size=world,
        first_step_s=monitor.first_step_s,
        elapsed_s=round(elapsed_s, 3),
        hardware=collect_hardware(engine.device),
        events=[asdict(e) for e in engine.events],
        flops_per_sample=mfu.flops_per_sample if mfu else None,
        flops_source=mfu.source if mfu else None,
        flops_convention=mfu.convention if mfu else None,
        recompute_flops_per_sample=mfu.recompute_per_sample if mfu else None,
        peak_tflops=mfu.peak_tflops(engine.precision.mfu_peak()) if mfu else None,
        compile=engine.compile_guard.summary(),
        optimizations=optimizations,
        more={**({"rank_tokens_per_s_median": statistics.median(rank_rates)} if rank_rates else {}), **more},
    )


class Tracker:
    """The hooks of an own loop (see the module docstring); made by :func:`track`."""

    def __init__(
        self,
        engine: Engine,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        run_dir: str | Path,
        *,
        scheduler: Any = None,
        example_batch: Any = None,
        loss_fn: LossFn = default_loss,
        log_every: int = 10,
        max_steps: int | None = None,
        eval_batches: Iterable[Any] | None = None,
        eval_every: int = 0,
        checkpoint_every: int | None = None,
        keep_last: int = 3,
        resume: bool = False,
        progress: bool = True,
        nvml: bool = True,
        report: bool = True,
        trackers: Iterable[str] = (),
        config: dict[str, Any] | None = None,
        project: str = "turbotrain",
    ) -> None:
        self.engine, self.run_dir, self.report = engine, Path(run_dir), report
        self.run_dir.mkdir(parents=True, exist_ok=True)
        scheduler = scheduler if scheduler is not None else engine.scheduler
        self.state = run_state(engine, model, optimizer, scheduler)
        checkpoints = self.run_dir / CHECKPOINTS
        self.resumed_from = (
            restore_latest(checkpoints, self.state).name if resume and checkpoints.is_dir() else ""
        )
        options = TrackerOptions(project=project, name=self.run_dir.name, config=config or {})
        progress_steps = max_steps if progress else None
        plan = MonitorPlan(
            log_every, self.run_dir, progress_steps, nvml, trackers=tuple(trackers), tracker_options=options
        )
        self.monitor, _ = build_monitor(engine, model, example_batch, plan, loss_fn=loss_fn)
        self.hooks = self._hooks(eval_batches, eval_every, loss_fn, scheduler, checkpoint_every, keep_last)
        self.ctx = FitContext(engine, model, optimizer, max_steps or sys.maxsize)
        self._start = time.perf_counter()
        self._closed = False
        self.hooks.on_fit_start(self.ctx)
        engine.add_step_callback(self._after_step)

    def _hooks(
        self,
        eval_batches: Iterable[Any] | None,
        eval_every: int,
        loss_fn: LossFn,
        scheduler: Any,
        checkpoint_every: int | None,
        keep_last: int,
    ) -> HookList:
        """The hook chain: evaluation before the monitor, the checkpointer last (run_hooks explains)."""
        saver = None
        if checkpoint_every is not None:
            saver = Checkpointer(self.run_dir / CHECKPOINTS, checkpoint_every, keep_last, self.state)
        batches = list(eval_batches) if eval_batches is not None else None
        return HookList(
            build_hooks(
                self.monitor,
                eval_batches=batches,
                eval_every=eval_every,
                loss_fn=loss_fn,
                scheduler=scheduler,
                checkpointer=saver,
            )
        )

    def _after_step(self) -> None:
        if not self._closed:
            self.hooks.on_step_end(self.ctx)

    def save(self) -> None:
        """Write a checkpoint now (needs ``checkpoint_every``; atomic and checksummed)."""
        for hook in self.hooks.hooks:
            if isinstance(hook, Checkpointer):
                hook.save(self.ctx)

    def close(self, exc: BaseException | None = None) -> dict[str, Any]:
        """End of training: the last record, the final checkpoint and evaluation, summary.json and
        (``report``) plots and summary.md; returns the summary. Idempotent."""
        if self._closed:
            return {}
        self._closed = True
        status = failed_status(exc) if exc is not None else "completed"
        if exc is None:
            self.hooks.on_fit_end(self.ctx)
        else:
            self.hooks.on_exception(self.ctx, exc)
        summary = write_summary(self.run_dir, self.facts(status), self.monitor.records)
        if self.report and exc is None:
            summary = write_report(self.run_dir).summary
        return summary

    def facts(self, status: str) -> RunFacts:
        """What summary.json says beyond the metrics."""
        engine, elapsed, run = self.engine, time.perf_counter() - self._start, self.run_dir.name
        done = {
            "precision": engine.precision.name,
            "compile": engine.options.compile_scope,
            **engine.switches,
        }
        return engine_facts(engine, self.monitor, run, status, elapsed, done, resumed_from=self.resumed_from)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, _kind: type | None, exc: BaseException | None, _tb: TracebackType | None) -> None:
        self.close(exc)


def track(
    engine: Engine,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    run_dir: str | Path,
    **options: Any,
) -> Tracker:
    """Monitor (and optionally evaluate and checkpoint) an own loop in ``run_dir``; use it as a
    context manager, or call ``close()`` at the end. Options: ``example_batch`` (FLOPs and MFU),
    ``loss_fn``, ``log_every`` (steps between metric reads: the host-device syncs), ``max_steps``
    (progress bar length), ``eval_batches`` + ``eval_every``, ``checkpoint_every`` (0 = at the
    end only; None = no checkpoints) + ``keep_last``, ``resume`` (load the newest checkpoint in
    ``run_dir`` first; ``engine.state.batches`` is then the data position), ``scheduler``,
    ``progress``, ``nvml``, ``report`` (plots and summary.md at the end), ``trackers`` (any of
    ``"wandb"``, ``"mlflow"``, ``"trackio"``: the same records, ``config`` (your hyperparameters)
    once, the summary and plots at the end, under ``project``)."""
    if optimizer is None:
        raise TypeError(
            "track(engine, model, optimizer, run_dir): optimizer is None: pass the optimizer engine.setup returned"
        )
    return Tracker(engine, model, optimizer, run_dir, **options)
