"""The hook chain of a run, assembled in one place (``turbotrain train``, ``track``, ``profile`` and
``tune``). The order matters:

- the stop hooks only raise ``ctx.should_stop``, which the loop reads after all hooks have run;
- Evaluate before the Monitor, so a step's record carries the validation result; the plateau
schedule and early stopping right after Evaluate, so they decide before the step's checkpoint;
- the experts monitor before the Monitor; the epoch log right after it (its record follows);
- the Checkpointer last: its time is in ``ctx.side_s`` before the next window, and the final
record is written before the save (a full disk loses no metrics); only the best checkpoint after
it, which keeps the step's checkpoint the Checkpointer wrote instead of writing it twice."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from ..base.config import RunConfig
from ..base.errors import ConfigError
from ..core.engine import Engine
from ..core.optim import PlateauLR
from .best_checkpoint import KeepBest
from .checkpoint import Checkpointer
from .early_stop import EarlyStopping, MetricWatch
from .epochs import EpochLog
from .experts_monitor import experts_hooks
from .hooks import Evaluate, Hook
from .lr_plateau import ObservePlateau

# the monitor's modules, not the package: its __init__ would add a link to the layer's import chain
from .monitor.hook import Monitor
from .monitor.probes import build_probes
from .monitor.sinks import JsonlSink, ProgressSink
from .monitor.trackers import TRACKERS, TrackerOptions, build_sinks


@dataclass
class MonitorPlan:
    log_every: int = 10  # steps between metric reads: the host-device syncs
    run_dir: Path | None = None  # metrics.jsonl (and tensorboard/) go here; None: nowhere
    progress_steps: int | None = None  # a progress bar up to this step; None: no bar
    nvml: bool = True
    tensorboard: bool = False
    trackers: tuple[str, ...] = ()  # experiment trackers: "wandb", "mlflow", "trackio"
    tracker_options: TrackerOptions | None = None  # their project, run name, config, store
    memory_every: int = -1  # monitor.memory_every (-1: with each record)
    memory_warn_fraction: float = 0.9
    memory_cap_fraction: float = 0.0
    util_warn_pct: float = 80.0  # monitor.util_warn_pct: 0 = never
    util_warn_s: float = 120.0


def monitor_plan(c: RunConfig, run_dir: Path | None, progress_steps: int | None = None) -> MonitorPlan:
    m = c.monitor
    return MonitorPlan(
        m.log_every,
        run_dir,
        progress_steps=progress_steps,
        nvml=m.nvml,
        tensorboard=m.tensorboard,
        trackers=tuple(t for t in TRACKERS if getattr(m, t)),
        tracker_options=TrackerOptions(
            project=m.project,
            name=run_dir.name if run_dir is not None else "",
            config=c.to_dict(),
            wandb_mode=m.wandb_mode,
            mlflow_uri=m.mlflow_uri,
        ),
        memory_every=m.memory_every,
        memory_warn_fraction=m.memory_warn_fraction,
        memory_cap_fraction=c.memory.max_fraction,
        util_warn_pct=m.util_warn_pct,
        util_warn_s=m.util_warn_s,
    )


def build_monitor(
    engine: Engine,
    model: nn.Module,
    example: Any,
    plan: MonitorPlan,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
) -> tuple[Monitor, JsonlSink | None]:
    """The Monitor (and its metrics.jsonl sink, for a flush before checkpoints) with the standard probes."""
    names = ["jsonl", *(["tensorboard"] if plan.tensorboard else []), *plan.trackers]
    sinks: list[Any] = (
        build_sinks(names, plan.run_dir, plan.tracker_options) if plan.run_dir is not None else []
    )
    jsonl = next((s for s in sinks if isinstance(s, JsonlSink)), None)
    if plan.progress_steps is not None:
        sinks.append(ProgressSink(plan.progress_steps, engine.state.step))
    world = engine.strategy.world
    settings = {k: v for k, v in vars(plan).items() if k.startswith(("memory_", "util_"))}  # the probes'
    probes = build_probes(
        engine.device,
        model=model,
        example_batch=example,
        precision=engine.precision.name,
        nvml_enabled=plan.nvml,
        loss_fn=loss_fn,
        autocast=engine.autocast,
        devices=world,
        **settings,
    )
    return Monitor(plan.log_every, sinks, probes, world=world, run_dir=plan.run_dir), jsonl


def build_hooks(
    monitor: Monitor,
    *,
    stops: Sequence[Hook] = (),
    eval_batches: list[Any] | None = None,
    eval_every: int = 0,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    metrics_fn: Callable[[nn.Module, Any], Any] | None = None,
    scheduler: Any = None,
    experts_model: nn.Module | None = None,
    experts_dir: Path | None = None,
    epochs: tuple[int, int] | None = None,
    checkpointer: Checkpointer | None = None,
    watch: MetricWatch | None = None,
    patience: int = 0,
    keep_best: bool = False,
) -> list[Hook]:
    """The chain in the module docstring's order. ``eval_batches`` None: no evaluation; ``experts_model``:
    the unwrapped model with MoE layers; ``epochs``: (steps per epoch, epochs); ``watch``: the metric
    early stopping (``patience``; 0: never) and, with ``keep_best`` and a checkpointer, the best watch."""
    if watch is not None and not eval_batches:
        raise ConfigError(
            f"best.patience / best.checkpoint watch {watch.metric} of the validation passes, and this run "
            "has no validation data (a --model workload: give it an eval_loader)"
        )
    hooks: list[Hook] = list(stops)
    if eval_batches is not None:
        hooks.append(Evaluate(eval_batches, eval_every, loss_fn, metrics_fn))
        if isinstance(scheduler, PlateauLR):  # the loss Evaluate just read
            hooks.append(ObservePlateau(scheduler))
        if watch is not None:
            hooks.append(EarlyStopping(watch, patience))
    if experts_model is not None:
        hooks.extend(experts_hooks(experts_model, monitor.interval, experts_dir))  # MoE: tokens per expert
    hooks.append(monitor)
    if epochs is not None:  # after the Monitor: the epoch's last step record is written first
        hooks.append(EpochLog(monitor, *epochs))
    if checkpointer is not None:
        hooks.append(checkpointer)
        if watch is not None and keep_best and eval_batches is not None:
            hooks.append(KeepBest(watch, checkpointer))
    return hooks
