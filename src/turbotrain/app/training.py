"""A whole training run assembled from a prepared run (:mod:`turbotrain.app.prepare`) and trained.

Nothing lost, nothing overwritten: ``config.toml`` is written first (a run killed at any moment can
be resumed); a resume drops the metrics of steps it runs again and rewrites ``config.toml`` once its
first step has trained; a full disk ends the run with one line naming the file and the last intact
checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..base.atomic import DiskFullError, atomic_write, clean_stale_temps, disk_full_cause
from ..base.config import RunConfig, setting, to_toml
from ..base.records import read_metrics
from ..base.rundir import (
    CHECKPOINTS,
    CONFIG_FILE,
    METRICS_FILE,
    PLOTS_DIR,
    already_exists,
    holds_a_run,
    truncate_metrics,
)
from ..base.runlock import RunLock
from ..base.seeds import rng_state, set_rng_state
from ..base.signals import StopSignals
from ..base.signals import held as held_signals
from ..base.version import collect_git
from ..core.assembly import Trainable, build_trainable
from ..core.engine import Engine, default_loss
from ..core.main_rank import main_first
from ..core.optim import resolve_implementation
from ..loop.best_checkpoint import watched
from ..loop.checkpoint import Checkpointer, RunState, clean_unfinished, latest_verified, run_state
from ..loop.checkpoint.remote import MirrorHook, RemoteMirror, remote_store
from ..loop.early_stop import EarlyStopping, MetricWatch, watch_for
from ..loop.fit import fit
from ..loop.hooks import FitContext, Hook, StopAfter, StopOnSignal
from ..loop.monitor import Monitor
from ..loop.monitor.sinks import JsonlSink
from ..loop.run_hooks import build_hooks, build_monitor, monitor_plan
from ..parts.data import LoaderSettings, resolve_loader_settings
from ..parts.models.spec import LossFn, ModelSpec, RunData
from ..tools.memory import memory_summary, resolve_batch_size
from .experts_growth import growth_stops, stopped_to_grow
from .prepare import PreparedRun, plan_run, prepare_config, start, stop_startup
from .resume import resume_from
from .run_settings import resolve_epochs, say_recipe, scale_lr, warn_long_warmup
from .summary import RunFacts, failed_status, write_summary
from .tracking import engine_facts

__all__ = ["Training", "build_training", "plan_run", "stopped_by_signal", "train", "train_prepared"]

log = logging.getLogger(__name__)


def stopped_by_signal(summary: dict[str, Any]) -> bool:
    """Whether a run ended early because of SIGTERM/SIGINT (its final checkpoint is saved)."""
    reason = str(summary.get("stop_reason", ""))
    return summary.get("status") == "stopped" and reason.startswith("signal ")  # StopOnSignal's


@dataclass
class Training:
    """Everything a run needs, built and resolved; ``run()`` trains it."""

    config: RunConfig
    run_dir: Path
    spec: ModelSpec
    engine: Engine
    model: nn.Module
    optimizer: torch.optim.Optimizer
    data: RunData
    loader: Any
    hooks: list[Hook]
    monitor: Monitor
    state: RunState  # what checkpoints save and a resume loads
    prepared: PreparedRun  # the run as started (with its start decisions): what a restart continues
    resolved: dict[str, Any] = field(default_factory=dict)
    resumed_from: str = ""
    mirror: RemoteMirror | None = None  # run.remote: the copy in the store (rank 0), closed by the caller

    def run(self) -> FitContext:
        return fit(
            self.engine,
            self.model,
            self.optimizer,
            self.loader,
            max_steps=self.config.train.max_steps,
            hooks=self.hooks,
            loss_fn=self.spec.loss_fn() or default_loss,
        )


@dataclass
class Assembled:
    """What a training run and a measured run (``measure``) share (:func:`assemble`)."""

    run: PreparedRun  # as started: with the decisions of its start (:func:`~turbotrain.app.prepare.start`)
    config: RunConfig  # the settings, with what the data and the batch search decided
    data: RunData
    loss_fn: LossFn | None  # the workload's; None: the model returns its loss
    plain: nn.Module  # the model itself (DDP wraps it, FSDP2 shards it in place)
    own_optimizer: torch.optim.Optimizer | None  # the workload's; None: AdamW from the optim section
    trainable: Trainable
    batch_search: Any  # the batch finder's answer (batch.micro = 'auto'), else None
    lr_note: str
    epochs: tuple[int, int] | None  # (steps per epoch, epochs) for train.epochs
    started: dict[str, Any] = field(default_factory=dict)  # the start hooks' facts (fp8's timed layers)


def assemble(run: PreparedRun, show: bool) -> Assembled:
    """Open the data, start the run, build the engine and optimizer as its plan says, then search the
    batch and scale the learning rate to it. ``show``: live progress for anything slow (rank 0)."""
    c, plan, spec, run_dir = run.settings, run.plan, run.spec, run.run_dir
    # rank 0 first: it fills caches, the others read them
    data = main_first(lambda: spec.open_data(c, run_dir, show=show))
    loss_fn = spec.loss_fn()  # once the data is open (a workload's own); None: the model returns its loss
    if plan.rank == 0:
        data.save(run_dir)
    c, epochs = resolve_epochs(c, data, plan.data)  # train.epochs -> max_steps, before the schedule is made
    started = start(run, c, data, loss_fn)  # the start decisions, the generators seeded, the model built
    c, plain = started.config, started.model
    plain = spec.parallelize(plain, plan)  # the family's part of the plan; engine.setup does the rest
    own_optimizer = spec.optimizer(plain)  # a workload's own; None: AdamW from the optim section
    t = build_trainable(c, plain, max_steps=c.train.max_steps, optimizer=own_optimizer, plan=plan)
    # batch.micro = 'auto': search the size (or read this run's cache) before any checkpoint loads
    c, batch_search = resolve_batch_size(
        c,
        t.engine,
        t.model,
        t.optimizer,
        run_dir=run_dir,
        max_micro=data.positions,
        make_batch=data.probe_batch(c, t.engine.device),
        loss_fn=loss_fn,
    )
    c, lr_note = scale_lr(c, batch_search, t.optimizer, t.scheduler)  # optim.lr_scaling, before any load
    return Assembled(
        started.run, c, data, loss_fn, plain, own_optimizer, t, batch_search, lr_note, epochs, started.facts
    )


def build_training(
    run: PreparedRun | RunConfig, run_dir: Path | None = None, *, progress: bool | None = None
) -> Training:
    """Build the data, model, optimizer, engine and hooks of the prepared ``run`` (a RunConfig: a
    script's run of it in ``run_dir``, prepared here)."""
    if isinstance(run, RunConfig):
        run = prepare_config(run, run_dir)
    early = watch_for(run.config.best)  # a built-in model's validation computes the loss alone: checked now
    if early is not None and not run.config.model.workload and run.spec.metrics_fn() is None:
        early.require_known(["val_loss"])
    main = run.main  # under torchrun rank 0 alone writes the run's shared files and prints
    store = remote_store(run.config, run.run_dir) if main else None  # run.remote refuses: one line, first
    show = (run.settings.monitor.progress if progress is None else progress) and main
    a = assemble(run, show)
    run, c, engine = a.run, a.config, a.trainable.engine
    watch = watch_for(c.best)  # early stopping / the best checkpoint
    state, resumed_from = _state(run, a, watch)
    first_step_draws = rng_state()  # the generators the first step draws from (a resume's, restored)
    if run.resume and main:  # the steps after the checkpoint run again: their old records would count twice
        truncate_metrics(run.run_dir / METRICS_FILE, engine.state.step)
    warn_long_warmup(c)
    settings = resolve_loader_settings(
        engine.device, c.data.num_workers, c.data.pin_memory, c.data.prefetch_factor
    )
    rank, world = engine.strategy.rank, engine.strategy.world
    loader = engine.setup_loader(a.data.loader(c, settings, engine.state.batches, rank, world))
    val_batches, example = a.data.val_batches(c, rank, world), a.data.example(c)
    if c.model.workload and main:
        say_recipe(c, a.own_optimizer is not None, bool(val_batches))
    resolved = _resolved(a, run.spec, settings)
    # the other ranks measure but write nothing
    plan = monitor_plan(c, run.run_dir if main else None, progress_steps=c.train.max_steps if show else None)
    monitor, jsonl = build_monitor(engine, a.plain, example, plan, loss_fn=a.loss_fn)
    # reading the example and counting FLOPs (a forward: dropout, a user's augmentation) drew from them
    set_rng_state(first_step_draws)
    hooks = _run_hooks(run, a, monitor, jsonl, state, watch, val_batches)
    mirror = RemoteMirror(store, run.run_dir, c.train.keep_last) if store is not None else None
    if mirror is not None:
        hooks.append(MirrorHook(mirror))  # after the Checkpointer and the best checkpoint
    t = a.trainable
    return Training(
        c, run.run_dir, run.spec, engine, t.model, t.optimizer, a.data, loader, hooks, monitor, state, run,
        resolved, resumed_from, mirror,
    )  # fmt: skip


def _state(run: PreparedRun, a: Assembled, watch: MetricWatch | None) -> tuple[RunState, str]:
    """What checkpoints save and a resume loads, and (a resume) the checkpoint it loaded."""
    c, t = a.config, a.trainable
    # the config rides along for reference only: a resume reads config.toml
    config = (lambda: to_toml(c), lambda _: None)
    best = {"best": watch} if watch is not None else None
    state = run_state(t.engine, t.model, t.optimizer, t.scheduler, config=config, optional=best)
    if not run.resume:
        return state, ""
    return state, resume_from(c, run.run_dir, state, t.engine, a.data, run.batch_given, t.scheduler)


def _resolved(a: Assembled, spec: ModelSpec, settings: LoaderSettings) -> dict[str, Any]:
    """What the run's 'auto' settings and its assembly resolved to (config.toml's header, summary.json)."""
    c, engine = a.config, a.trainable.engine
    world = engine.strategy.world
    resolved = {
        "device": str(engine.device),
        "precision": engine.precision.name,
        "compile": engine.options.compile_scope,
        "compile_mode": c.compile.mode,
        "optimizer": (
            f"AdamW ({resolve_implementation(c.optim.implementation, engine.device)})"
            if a.own_optimizer is None
            else f"{type(a.own_optimizer).__name__} (the workload's)"
        ),
        "num_workers": settings.num_workers,
        "pin_memory": settings.pin_memory,
        "model_family": spec.name,
        **spec.facts(c, a.plain),
        "data": a.data.description,
        "global_batch": c.batch.micro * c.batch.accumulation * world,
        "strategy": engine.strategy.name,
        "world_size": world,
        **a.data.facts,
    }
    if a.batch_search is not None:
        resolved["batch_search"] = a.batch_search.to_dict()
    resolved.update(a.started)  # fp8_layers: summary.md's "fp8 per layer" table
    if a.lr_note:
        resolved["lr_scaling"] = a.lr_note
    return resolved


def _run_hooks(
    run: PreparedRun,
    a: Assembled,
    monitor: Monitor,
    jsonl: JsonlSink | None,
    state: RunState,
    watch: MetricWatch | None,
    val_batches: list[Any] | None,
) -> list[Hook]:
    """The run's hooks in order: the stops, evaluation, the schedule, experts, epochs, checkpoints."""
    c, engine = a.config, a.trainable.engine
    world = engine.strategy.world
    # data parallel: the ranks agree on a signal every log_every steps, so they stop together
    stops = [
        StopOnSignal(engine.strategy.any_rank if world > 1 else None, c.monitor.log_every),
        StopAfter(c.train.stop_after_steps),
        *growth_stops(c),  # moe.grow_at_step: stop there; train_prepared resumes with more experts
    ]
    return build_hooks(
        monitor,
        stops=stops,
        eval_batches=val_batches,
        eval_every=c.train.eval_every,
        loss_fn=a.loss_fn,
        metrics_fn=run.spec.metrics_fn(),
        scheduler=a.trainable.scheduler,
        experts_model=a.plain,
        experts_dir=run.run_dir if run.main else None,
        epochs=a.epochs,
        checkpointer=Checkpointer(
            run.run_dir / CHECKPOINTS,
            c.train.checkpoint_every,
            c.train.keep_last,
            state,  # every rank: ddp/fsdp save together
            before_save=jsonl.flush if jsonl is not None else None,
            async_write=c.train.async_checkpoint,
        ),
        watch=watch,
        patience=c.best.patience,
        keep_best=c.best.checkpoint,
    )


class WriteConfigOnce(Hook):
    """Calls ``write`` at the end of the first step (before its checkpoint)."""

    def __init__(self, write: Callable[[], None]) -> None:
        self.write: Callable[[], None] | None = write

    def on_step_end(self, ctx: FitContext) -> None:
        if self.write is not None:
            write, self.write = self.write, None
            write()


def write_config(config: RunConfig, run_dir: Path, resolved: dict[str, Any]) -> None:
    """config.toml: the config as given, headed by what it resolved to (once start-up has done it)."""
    keys = ("device", "precision", "compile", "optimizer", "num_workers", "vocab_size")
    said = (
        ", ".join(f"{k}={v}" for k, v in resolved.items() if k in keys)
        or "not yet (start-up has not finished)"
    )
    header = f"# turbotrain run config (reload with --preset this-file.toml)\n# resolved: {said}\n"
    atomic_write(run_dir / CONFIG_FILE, header + to_toml(config))


def facts(training: Training, ctx: FitContext | None, status: str, elapsed_s: float) -> RunFacts:
    """What the run knows beyond its metrics, for summary.json."""
    c, engine, r = training.config, training.engine, training.resolved
    cuda = engine.device.type == "cuda"
    return engine_facts(
        engine,
        training.monitor,
        training.run_dir.name,
        status,
        elapsed_s,
        {
            "precision": engine.precision.name,  # after any fallback
            **engine.precision.summary(),  # fp8: recipe, the converted layers, those kept in bf16 and why
            **engine.switches,  # tf32, cudnn_benchmark, deterministic as applied
            "compile": r.get("compile")
            if r.get("compile") == "off"
            else f"{r.get('compile')} ({c.compile.mode})",
            "optimizer": r.get("optimizer"),
            **({"attention": r["attention"]} if "attention" in r else {}),
            "activation_checkpointing": c.memory.checkpointing,
            "micro_batch x accumulation": f"{c.batch.micro} x {c.batch.accumulation}",
            "data": f"{r.get('num_workers')} workers, pin_memory {r.get('pin_memory')}, "
            f"device prefetch {c.data.device_prefetch and cuda}",
        },
        max_steps=c.train.max_steps,
        stop_reason=ctx.stop_reason if ctx else "",
        **watched(training.hooks),  # best: the watched metric's best value, step and checkpoint
        resumed_from=training.resumed_from,
        resolved=r,
        memory=memory_summary(training),
        # Linux: KiB
        host_peak_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        git=collect_git(),  # the commit the run's code came from (TT_COMMIT where the tree has no .git)
        config=c.to_dict(),
    )


def train(
    config: RunConfig,
    *,
    resume_dir: Path | None = None,
    progress: bool | None = None,
    run_dir: Path | None = None,
    batch_given: bool = False,
) -> dict[str, Any]:
    """Train ``config`` in a new run directory (``run_dir``, else one named from the config) or
    continue ``resume_dir``; returns the summary. ``batch_given``: the caller chose the batch (a
    resume at another world size is not refused). A failure still writes summary.json; a new run
    that fails before its first step leaves no directory. Under torchrun rank 0 alone writes."""
    with held_signals() as signals:
        resumable = resume_dir is not None
        signals.on_first(lambda name: stop_startup(name, resume_dir, resumable))
        run = prepare_config(config, resume_dir or run_dir, resume=resumable, batch_given=batch_given)
        if not run.main:
            return train_prepared(run, signals, progress)[0]
        with RunLock(run.run_dir):
            summary, training = train_prepared(run, signals, progress)
            if training.mirror is not None:  # run.remote: the last uploads, or what is missing
                training.mirror.close()
            return summary


def train_prepared(
    run: PreparedRun, signals: StopSignals, progress: bool | None = None
) -> tuple[dict[str, Any], Training]:
    """Train the prepared ``run`` to its end (a stop for ``moe.grow_at_step``: resumed at once, grown),
    write its summary, then call its start hooks' ``ends``. The caller holds ``signals`` and the lock."""
    summary, training = _train_prepared_once(run, signals, progress)
    while stopped_to_grow(summary):  # every rank alike: the step is in the config
        if training.mirror is not None:  # the next part mirrors the same run with a mirror of its own
            training.mirror.close()
        summary, training = _train_prepared_once(replace(training.prepared, resume=True), signals, progress)
    for end in training.prepared.ends:
        end()
    return summary, training


def _train_prepared_once(
    run: PreparedRun, signals: StopSignals, progress: bool | None = None
) -> tuple[dict[str, Any], Training]:
    """:func:`train_prepared` until the fit ends, for whatever reason."""
    new, main, run_dir = not run.resume, run.main, run.run_dir
    if new and main and holds_a_run(run_dir):  # another process made it between the check and the lock
        raise already_exists(run_dir)
    try:
        # temp files of writes killed mid-way (checkpoints: the Checkpointer)
        for folder in (run_dir, run_dir / PLOTS_DIR) if main else ():
            clean_stale_temps(folder)
        try:
            signals.on_first(lambda name: stop_startup(name, run_dir, resumable=not new))
            if new and main:  # first of all: a run killed from here on has a config to resume from
                write_config(run.config, run_dir, {})
            training = build_training(run, progress=progress)
            if run.hooks is not None:  # an integration's, after the run's own (RunRequest.hooks)
                training.hooks.extend(run.hooks(run))
            # as given ('auto' stays 'auto' unless a start decision settled it), with what it resolved to
            given = training.prepared.config
            if main and new:
                write_config(given, run_dir, training.resolved)
            elif main:  # a resume's overrides reach config.toml once its first step has trained, never when it fails before
                training.hooks.insert(
                    0, WriteConfigOnce(lambda: write_config(given, run_dir, training.resolved))
                )
            # from here a signal is kept for the loop, which stops after a step (and saves)
            signals.on_first(None)
        except BaseException:
            if new and main:
                # created by this call, under its lock: nothing else is in it
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        try:
            return _train_built(training, run_dir, main), training
        finally:
            training.data.close()  # its token files: a notebook's or a long session's runs leave none open
    except BaseException as exc:
        full = _disk_full(exc, run_dir) if main else None
        if full is not None:
            raise full from None
        raise


def _nothing_to_train(training: Training, run_dir: Path) -> tuple[str, str, str] | None:
    """(status, stop reason, its line) when a resume has nothing to train: complete, or early-stopped."""
    c, step = training.config, training.engine.state.step
    if step >= c.train.max_steps:
        t = c.train
        more = ("train.epochs", 2 * t.epochs) if t.epochs else ("train.max_steps", 2 * t.max_steps)
        line = f"{run_dir} is complete (step {step} of {t.max_steps}): nothing to train; to train on, resume"
        return "completed", "", f"{line} with a larger {more[0]}, e.g. {setting(*more)}"
    stop = next((h for h in training.hooks if isinstance(h, EarlyStopping)), None)
    if stop is None or not stop.patience or stop.watch.stale < stop.patience:
        return None
    reason = stop.reason()
    larger = setting("best.patience", 2 * stop.patience)
    line = f"{run_dir} was ended at step {step} by {reason}: nothing to train; to train on, resume with"
    return "stopped", reason, f"{line} a larger best.patience, e.g. {larger}"


def _train_built(training: Training, run_dir: Path, main: bool) -> dict[str, Any]:
    """Train the built run to its end (or a stop) and write its summary."""
    done = _nothing_to_train(training, run_dir)
    if done is not None:
        training.monitor.close()  # nothing to log again: a final record would repeat the last step's
        status, reason, line = done
        if main:
            log.info("%s", line)
            # what killed saves left, which the Checkpointer's start (never reached here) removes
            clean_stale_temps(run_dir / CHECKPOINTS)
            clean_unfinished(run_dir / CHECKPOINTS)
        known = facts(training, None, status, 0.0).to_dict()
        known.update({"stop_reason": reason} if reason else {})
        return write_summary(run_dir, known, read_metrics(run_dir / METRICS_FILE)[0]) if main else known
    start = time.perf_counter()

    def finish(ctx: FitContext | None, status: str) -> dict[str, Any]:
        known = facts(training, ctx, status, time.perf_counter() - start)
        return write_summary(run_dir, known, training.monitor.records) if main else known.to_dict()

    try:
        ctx = training.run()
    except BaseException as exc:
        # the disk is full: the error that says so is the one to raise
        with contextlib.suppress(DiskFullError):
            finish(None, failed_status(exc))
        raise
    return finish(ctx, "stopped" if ctx.should_stop else "completed")


def _disk_full(exc: BaseException, run_dir: Path) -> DiskFullError | None:
    """``exc`` as one DiskFullError naming the file and the last intact checkpoint, when space ran out."""
    if isinstance(exc, DiskFullError):
        full = exc
    else:
        cause = disk_full_cause(exc)
        if cause is None:
            return None
        full = DiskFullError(
            cause.filename or f"the files of run {run_dir}", cause.strerror or "no space left"
        )
    last = latest_verified(run_dir / CHECKPOINTS)
    if last is None:
        return full.with_note("no checkpoint was saved yet")
    return full.with_note(f"the last intact checkpoint is {last}; continue with --resume once there is space")
