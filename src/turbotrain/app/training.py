"""Assemble a whole training run from a RunConfig: data, model, optimizer, engine, hooks.

This is the one place that reads the config for a run; ``fit()`` then receives built objects.
The files it leaves in the run directory are named in :mod:`turbotrain.base.rundir`; its summary.json
is written through :mod:`turbotrain.app.report`, which adds the figures from the metrics.

Nothing lost, nothing overwritten: the run directory is locked for as long as ``train()`` works
in it (:mod:`turbotrain.base.runlock`); ``config.toml`` is written before anything else, so a run
killed at any moment can be resumed (from step 0 when no checkpoint was saved yet); a resume
drops the metrics of steps it will run again, and rewrites ``config.toml`` (its overrides) only once
its first step has trained; SIGTERM/SIGINT are handled from the start to the end
(:mod:`turbotrain.base.signals`): during start-up they end it cleanly (:class:`StoppedBySignal`), during
training save a checkpoint first (the summary says ``stop_reason = "signal SIGTERM"``); a full disk ends it with one line that names the file and
the last intact checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import shutil
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..base.atomic import DiskFullError, atomic_write, clean_stale_temps, disk_full_cause
from ..base.config import MAX_STEPS, OptimConfig, RunConfig, setting, to_toml
from ..base.errors import ConfigError, TurbotrainError
from ..base.launch import Topology
from ..base.rundir import (
    CHECKPOINTS,
    CONFIG_FILE,
    METRICS_FILE,
    PLOTS_DIR,
    already_exists,
    holds_a_run,
    new_run_dir,
    truncate_metrics,
)
from ..base.runlock import RunLock
from ..base.signals import held as held_signals
from ..base.version import collect_git
from ..core.assembly import build_trainable
from ..core.device import local_device, resolve_device
from ..core.engine import Engine, default_loss
from ..core.main_rank import ReportedByMainRank, decided_by_main, main_first
from ..core.optim import lr_batch_factor, rescale_lr, resolve_implementation
from ..core.plan import ParallelPlan
from ..core.precision.fp8_choice import choose_for_run
from ..loop.best_checkpoint import watched
from ..loop.checkpoint import (
    Checkpointer,
    RunState,
    clean_unfinished,
    finished_checkpoints,
    latest_verified,
    restore_latest,
    rng_state,
    run_state,
    seed_all,
    set_rng_state,
)
from ..loop.checkpoint import saved_world as saved_world_of
from ..loop.early_stop import watch_for
from ..loop.fit import fit
from ..loop.hooks import FitContext, Hook, StopAfter, StopOnSignal
from ..loop.monitor import Monitor
from ..loop.run_hooks import build_hooks, build_monitor, monitor_plan
from ..parts.data import resolve_loader_settings
from ..parts.data.batching import processes
from ..parts.hardware import ram_bytes
from ..parts.models.blocks import declare_blocks
from ..parts.models.registry import spec_for
from ..parts.models.spec import ModelSpec, RunData
from ..tools.memory import memory_summary, resolve_batch_size
from .report import read_metrics, write_summary
from .tracking import run_facts

log = logging.getLogger(__name__)

SIGNAL_REASON = "signal "  # how StopOnSignal's stop_reason starts ("signal SIGTERM")


class StoppedBySignal(KeyboardInterrupt):
    """SIGTERM or SIGINT arrived before the first step: nothing was trained, nothing is lost.
    A KeyboardInterrupt, so no ``except Exception`` on the way can swallow it. ``run_dir`` is
    None when the run was not found or named yet."""

    def __init__(self, signame: str, run_dir: Path | None, resumable: bool) -> None:
        self.signame, self.run_dir, self.resumable = signame, run_dir, resumable
        then = (
            f"continue with --resume {run_dir or ''}".rstrip()
            if resumable
            else "nothing was written; start it again"
        )
        super().__init__(f"stopped by {signame} during start-up, before the first step; {then}")


def stopped_by_signal(summary: dict[str, Any]) -> bool:
    """Whether a run ended early because of SIGTERM/SIGINT (its final checkpoint is saved)."""
    return summary.get("status") == "stopped" and str(summary.get("stop_reason", "")).startswith(
        SIGNAL_REASON
    )


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
    resolved: dict[str, Any] = field(default_factory=dict)
    resumed_from: str = ""

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


def build_training(
    config: RunConfig,
    run_dir: Path,
    plan: ParallelPlan | None = None,
    *,
    resume: bool = False,
    progress: bool | None = None,
    batch_given: bool = False,
    spec: ModelSpec | None = None,
) -> Training:
    """Build the data, model, optimizer, engine and hooks for ``config`` in ``run_dir``, in that
    order, through the run's model spec (``spec``, else :func:`turbotrain.parts.models.registry.spec_for`), spread over
    processes as ``plan`` says (:func:`plan_run` resolved it; None: resolved here). A resume at another world size that
    would change the global batch is refused unless ``batch_given`` (the resume names the batch
    itself: :func:`check_resume_batch`)."""
    if plan is None:  # a caller that did not resolve it (measure, an own script): once, here
        plan = plan_run(config, spec=spec)[1]
        plan.join(local_device(resolve_device(config.run.device), plan.topology))
    c = split_batch(config, plan)  # batch.global_size -> accumulation (the saved config keeps it as given)
    main = plan.rank == 0  # under torchrun rank 0 alone writes the run's shared files and prints
    show = (c.monitor.progress if progress is None else progress) and main
    spec = spec or spec_for(c)
    # rank 0 first: it fills caches, the others read them
    data = main_first(lambda: spec.open_data(c, run_dir, show=show))
    loss_fn = spec.loss_fn()  # once the data is open (a workload's own); None: the model returns its loss
    if main:
        data.save(run_dir)
    c, epochs = _resolve_epochs(c, data, plan.data)  # train.epochs -> max_steps, before the schedule is made
    seed_all(c.run.seed)  # torch, random and numpy: a user's model or loss may draw from any of them
    plain = spec.build(c, data)  # the model itself: DDP wraps it, FSDP2 shards it in place
    fp8_plan: dict[str, Any] = {}
    # float8 only where timing says it pays
    if c.precision.mode == "fp8" and c.precision.fp8_layers == "timed":
        micro = c if isinstance(c.batch.micro, int) else c.replace(batch={"micro": 8})  # 'auto': timed at 8
        c, fp8_choice = choose_for_run(
            c,
            plain,
            data.example(micro),
            loss_fn or default_loss,
            run_dir,
            local_device(resolve_device(c.run.device), plan.topology),
        )
        fp8_plan = fp8_choice.to_dict()
        log.info(fp8_choice.line)
    # the units FSDP, activation checkpointing and per-block compile act on
    declare_blocks(plain, spec.blocks(plain))
    # a workload's own; None: AdamW from the optim section, with its schedule
    own_optimizer = spec.optimizer(plain)
    # engine.setup carries the plan out: experts placed on their ranks, the rest wrapped for data parallelism
    t = build_trainable(c, plain, max_steps=c.train.max_steps, optimizer=own_optimizer, plan=plan)
    engine, model, optimizer = t.engine, t.model, t.optimizer
    rank, world = engine.strategy.rank, engine.strategy.world
    # batch.micro = 'auto': search the size (or read this run's cache) before any checkpoint loads
    c, batch_search = resolve_batch_size(
        c,
        engine,
        model,
        optimizer,
        run_dir=run_dir,
        max_micro=data.positions,
        make_batch=data.probe_batch(c, engine.device),
        loss_fn=loss_fn,
    )
    # optim.lr_scaling, before a checkpoint loads
    c, lr_note = _scale_lr(c, batch_search, optimizer, t.scheduler)
    # the config rides along for reference only: a resume reads config.toml
    watch = watch_for(c.best)  # type: ignore[attr-defined]  # early stopping / the best checkpoint
    state = run_state(
        engine,
        model,
        optimizer,
        t.scheduler,
        config=(lambda: to_toml(c), lambda _: None),
        optional={"best": watch} if watch is not None else None,
    )
    resumed_from = _resume(c, run_dir, state, engine, data, world, rank, batch_given) if resume else ""
    first_step_draws = rng_state()  # the generators the first step draws from (a resume's, restored)
    if resume and main:  # the steps after the checkpoint run again: their old records would count twice
        truncate_metrics(run_dir / METRICS_FILE, engine.state.step)
    _warn_long_warmup(c)

    settings = resolve_loader_settings(
        engine.device, c.data.num_workers, c.data.pin_memory, c.data.prefetch_factor
    )
    loader = engine.setup_loader(data.loader(c, settings, engine.state.batches, rank, world))
    val_batches, example = data.val_batches(c, rank, world), data.example(c)
    resolved = {
        "device": str(engine.device),
        "precision": engine.precision.name,
        "compile": engine.options.compile_scope,
        "compile_mode": c.compile.mode,
        "optimizer": (
            f"AdamW ({resolve_implementation(c.optim.implementation, engine.device)})"
            if own_optimizer is None
            else f"{type(own_optimizer).__name__} (the workload's)"
        ),
        "num_workers": settings.num_workers,
        "pin_memory": settings.pin_memory,
        "model_family": spec.name,
        **spec.facts(c, plain),
        "data": data.description,
        "global_batch": c.batch.micro * c.batch.accumulation * world,
        "strategy": engine.strategy.name,
        "world_size": world,
        **data.facts,
    }
    if batch_search is not None:
        resolved["batch_search"] = batch_search.to_dict()
    if fp8_plan:
        resolved["fp8_layers"] = fp8_plan  # summary.md's "fp8 per layer" table
    if lr_note:
        resolved["lr_scaling"] = lr_note

    monitor, jsonl = build_monitor(
        engine,
        plain,
        example,
        # the other ranks measure but write nothing
        monitor_plan(c, run_dir if main else None, progress_steps=c.train.max_steps if show else None),
        loss_fn=loss_fn,
    )
    # reading the example and counting FLOPs (a forward: dropout, a user's augmentation) drew from them
    set_rng_state(first_step_draws)
    hooks = build_hooks(
        monitor,
        # data parallel: the ranks agree on a signal every log_every steps, so they stop together
        stops=[
            StopOnSignal(engine.strategy.any_rank if world > 1 else None, c.monitor.log_every),
            StopAfter(c.train.stop_after_steps),
        ],
        eval_batches=val_batches,
        eval_every=c.train.eval_every,
        loss_fn=loss_fn,
        metrics_fn=spec.metrics_fn(),
        scheduler=t.scheduler,
        experts_model=plain,
        experts_dir=run_dir if main else None,
        epochs=epochs,
        checkpointer=Checkpointer(
            run_dir / CHECKPOINTS,
            c.train.checkpoint_every,
            c.train.keep_last,
            state,  # every rank: ddp/fsdp save together
            before_save=jsonl.flush if jsonl is not None else None,
            async_write=c.train.async_checkpoint,
        ),
        watch=watch,
        patience=c.best.patience,  # type: ignore[attr-defined]
        keep_best=c.best.checkpoint,  # type: ignore[attr-defined]
    )
    return Training(
        c,
        run_dir,
        spec,
        engine,
        model,
        optimizer,
        data,
        loader,
        hooks,
        monitor,
        state,
        resolved,
        resumed_from,
    )


def _resolve_epochs(c: RunConfig, data: RunData, world: int) -> tuple[RunConfig, tuple[int, int] | None]:
    """``train.epochs``: the run's ``max_steps`` (epochs x the data's steps per epoch at the global
    batch) with validation at each epoch's end, and (steps per epoch, epochs) for the epoch log."""
    if not c.train.epochs:
        return c, None
    if not isinstance(c.batch.micro, int):
        raise ConfigError(
            "train.epochs needs a numeric batch.micro (with 'auto' the steps per epoch are not known "
            f"before the search); use {setting('batch.micro', 32)} or train.max_steps"
        )
    per_epoch = data.steps_per_epoch(c, world)
    # said as the field the user set, not as the max_steps it becomes
    if c.train.epochs * per_epoch > MAX_STEPS:
        raise ConfigError(
            f"train.epochs = {c.train.epochs} is too many for this data ({per_epoch} steps per epoch, at most "
            f"{MAX_STEPS} steps in a run); use {setting('train.epochs', MAX_STEPS // per_epoch)} or fewer"
        )
    log.info(
        "train.epochs = %d: %d optimizer steps per epoch, %d in all",
        c.train.epochs,
        per_epoch,
        c.train.epochs * per_epoch,
    )
    return c.replace(train={"max_steps": c.train.epochs * per_epoch, "eval_every": per_epoch}), (
        per_epoch,
        c.train.epochs,
    )


def _resume(
    c: RunConfig,
    run_dir: Path,
    state: RunState,
    engine: Engine,
    data: RunData,
    world: int,
    rank: int,
    batch_given: bool,
) -> str:
    """Load the newest finished checkpoint of ``run_dir`` into ``state`` and set the data position
    after it; returns its name ("" when the run stopped before its first checkpoint). A split-
    invariant data order keeps step s's rows for any split of the global batch, so only a global
    batch changed unasked is refused (:func:`check_resume_batch`)."""
    if not finished_checkpoints(run_dir / CHECKPOINTS):
        log.info(
            "%s has no finished checkpoint (it stopped before its first one): training from step 0", run_dir
        )
        return ""

    def same_batch(path: Path, written_by: int, saved: dict[str, Any]) -> None:  # before anything loads
        # an epoch's steps are counted at the checkpoint's global batch, whatever the command asks
        if c.train.epochs:
            check_epochs_batch(path.name, saved.get("config"), written_by, c, world, rank)
        if data.split_invariant and not batch_given:
            check_resume_batch(path.name, saved.get("config"), written_by, c, world, rank)

    resumed = restore_latest(run_dir / CHECKPOINTS, state, before_load=same_batch)
    saved_world = saved_world_of(resumed) if resumed.is_dir() else 1
    engine.state.batches = data.start_after(engine.state.batches, engine.state.step, c, saved_world, world)
    return resumed.name


def _warn_long_warmup(c: RunConfig) -> None:
    # the default: no news on a short demo
    if c.optim.warmup_steps > c.train.max_steps and c.optim.warmup_steps != OptimConfig.warmup_steps:
        log.warning(
            "optim.warmup_steps = %d is longer than the run (train.max_steps = %d): the learning rate "
            "peaks at %.0f%% of optim.lr; use %s or fewer",
            c.optim.warmup_steps,
            c.train.max_steps,
            100 * c.train.max_steps / c.optim.warmup_steps,
            setting("optim.warmup_steps", c.train.max_steps),
        )


def check_resume_batch(
    checkpoint: str, saved_config: Any, saved_world: int, c: RunConfig, world: int, rank: int = 0
) -> None:
    """Refuse a resume whose global batch (``c``'s micro x accumulation over ``world`` processes)
    is not the one ``checkpoint`` trained with (its saved config's micro x accumulation over the
    ``saved_world`` processes that wrote it): only another world size changes it unasked. The user
    picks: the same global batch (the same rows per step, for any split), or a new one.
    Said by rank 0; the other ranks end quietly. A checkpoint without a readable config passes."""
    if saved_world == world:
        return
    change = _batch_change(saved_config, saved_world, c, world)
    if change is None:
        return
    micro, accumulation, old, new = change
    keep = []
    if (same_micro := _micro_keeping(old, c, world)) is not None:
        keep.append(same_micro)
    if old % (world * c.batch.micro) == 0:
        keep.append(f"{setting('batch.global_size', old)} (by accumulation {old // (world * c.batch.micro)})")
    # the rows of step s come from (seed, s) and the global batch: any split of it keeps them
    kept = f"{old} (the same batches) with {' or '.join(keep)}" if keep else f"{old} with another batch.micro"
    text = (
        f"{checkpoint} was trained at a global batch of {old} ({processes(saved_world)} x batch.micro {micro} x "
        f"accumulation {accumulation}) and this resume would train at {new} ({processes(world)} x {c.batch.micro} x "
        f"{c.batch.accumulation}); keep {kept}, or train at {new} with {setting('batch.micro', c.batch.micro)}"
    )
    raise TurbotrainError(text) if rank == 0 else ReportedByMainRank(text)


def _batch_change(
    saved_config: Any, saved_world: int, c: RunConfig, world: int
) -> tuple[int, int, int, int] | None:
    """(saved micro, saved accumulation, saved global batch, this resume's global batch) when a
    resume of a checkpoint saved by ``saved_world`` processes would train at another global batch;
    None when it would not, or when the checkpoint's batch or this one is unknown ('auto')."""
    saved = _saved_batch(saved_config)
    if saved is None or not isinstance(c.batch.micro, int):
        return None
    micro, accumulation = saved
    old, new = micro * accumulation * saved_world, c.batch.micro * c.batch.accumulation * world
    return None if old == new else (micro, accumulation, old, new)


def _micro_keeping(old: int, c: RunConfig, world: int) -> str | None:
    """The ``batch.micro`` setting that trains at the global batch ``old`` with this resume's
    accumulation over ``world`` processes; None when none does."""
    if old % (world * c.batch.accumulation):
        return None
    return setting("batch.micro", old // (world * c.batch.accumulation))


def _saved_batch(saved_config: Any) -> tuple[int, int] | None:
    """(batch.micro, batch.accumulation) of a checkpoint's saved config; None when it has none
    readable ('auto' never resolved, or a config this version cannot read: nothing to compare)."""
    if not isinstance(saved_config, str):
        return None
    try:
        batch = tomllib.loads(saved_config).get("batch", {})
        return int(batch["micro"]), int(batch.get("accumulation", 1))
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return None


def check_epochs_batch(
    checkpoint: str, saved_config: Any, saved_world: int, c: RunConfig, world: int, rank: int = 0
) -> None:
    """Refuse, before any step, to resume an epochs run (``train.epochs``) at another global batch
    than ``checkpoint`` trained at, asked for or not: its place in its epochs is a step count at
    that batch (epoch ``s // steps_per_epoch``, the samples of step ``s`` from (seed, epoch)), so
    read at another one it would re-enter an epoch already trained (a smaller batch: samples trained
    twice) or leave one early (a larger batch: samples skipped). Names the settings that keep the batch. Said by rank 0; the others end quietly."""
    change = _batch_change(saved_config, saved_world, c, world)
    if change is None:
        return
    micro, accumulation, old, new = change
    keep = []
    if (same_micro := _micro_keeping(old, c, world)) is not None:
        keep.append(same_micro)
    if old % (world * c.batch.micro) == 0:
        keep.append(setting("batch.global_size", old))
    kept = " or ".join(keep) if keep else f"another batch.micro whose global batch is {old}"
    text = (
        f"train.epochs: {checkpoint} was trained at a global batch of {old} ({processes(saved_world)} x batch.micro "
        f"{micro} x accumulation {accumulation}) and its place in the epochs is counted in steps of that batch, so "
        f"this resume at {new} ({processes(world)} x {c.batch.micro} x {c.batch.accumulation}) would lose its place "
        f"(samples trained twice or skipped); resume with {kept}, or start a new run to train at {new}"
    )
    raise TurbotrainError(text) if rank == 0 else ReportedByMainRank(text)


class WriteConfigOnce(Hook):
    """Calls ``write`` at the end of the first step (before that step's checkpoint): a resume
    rewrites the run's config.toml only once it has started, so a resume that fails (an override
    that does not work) leaves the config the run trained with."""

    def __init__(self, write: Callable[[], None]) -> None:
        self.write: Callable[[], None] | None = write

    def on_step_end(self, ctx: FitContext) -> None:
        if self.write is not None:
            write, self.write = self.write, None
            write()


def _scale_lr(
    c: RunConfig, search: Any, optimizer: torch.optim.Optimizer, scheduler: Any
) -> tuple[RunConfig, str]:
    """``optim.lr_scaling``: when the batch finder (``batch.micro = 'auto'``) made the global batch
    differ from the one ``optim.lr`` was tuned for (``optim.lr_batch``, else ``batch.global_size``),
    scale lr and min_lr (config, optimizer and schedule alike). Returns the config and a note
    ("" when nothing changed)."""
    reference = c.optim.lr_batch or c.batch.global_size
    if search is None or not reference:
        return c, ""
    factor = lr_batch_factor(c.optim.lr_scaling, reference, search.global_batch)
    if factor == 1.0:
        return c, ""
    rescale_lr(optimizer, scheduler, factor)
    note = (
        f"{c.optim.lr_scaling}: global batch {search.global_batch} instead of {reference}, "
        f"lr {c.optim.lr:.4g} x {factor:.4g} = {c.optim.lr * factor:.4g}"
    )
    log.info("optim.lr_scaling %s", note)
    return c.replace(optim={"lr": c.optim.lr * factor, "min_lr": c.optim.min_lr * factor}), note


def write_config(config: RunConfig, run_dir: Path, resolved: dict[str, Any]) -> None:
    """config.toml: the config as given, headed by what it resolved to (once start-up has done it)."""
    header = "# turbotrain run config (reload with --preset this-file.toml)\n# resolved: " + (
        ", ".join(
            f"{k}={v}"
            for k, v in resolved.items()
            if k in ("device", "precision", "compile", "optimizer", "num_workers", "vocab_size")
        )
        or "not yet (start-up has not finished)"
    )
    atomic_write(run_dir / CONFIG_FILE, header + "\n" + to_toml(config))


def facts(training: Training, ctx: FitContext | None, status: str, elapsed_s: float) -> dict[str, Any]:
    """What the run knows beyond its metrics, for summary.json: what ran, how long, where it stopped,
    events such as fallbacks, hardware, the optimizations in effect, memory, FLOPs per sample."""
    c, engine, r = training.config, training.engine, training.resolved
    cuda = engine.device.type == "cuda"
    return {
        "run": training.run_dir.name,
        "status": status,
        **run_facts(engine, training.monitor),
        "max_steps": c.train.max_steps,
        "elapsed_s": round(elapsed_s, 3),
        "stop_reason": ctx.stop_reason if ctx else "",
        **watched(training.hooks),  # best: the watched metric's best value, step and checkpoint
        "resumed_from": training.resumed_from,
        "resolved": r,
        "memory": memory_summary(training),
        "optimizations": {
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
        # Linux: KiB
        "host_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        "git": collect_git(),  # the commit the run's code came from (TT_COMMIT where the tree has no .git)
        "config": c.to_dict(),
    }


def plan_run(
    config: RunConfig, topology: Topology | None = None, spec: ModelSpec | None = None
) -> tuple[RunConfig, ParallelPlan]:
    """``config`` checked against the launch, and its parallel plan: resolved once per process,
    without any communication, so every rank finds the same mistake before joining the process
    group (:meth:`ParallelPlan.resolve`: the strategy, the expert degree against the world size and
    the model's experts; weights that cannot fit this machine; the global batch over the data
    dimension, :func:`split_batch`). Join the plan's groups with ``plan.join(device)``. ``spec``:
    the run's model spec when the caller made it already."""
    spec = spec or spec_for(config)
    plan = ParallelPlan.resolve(config.distributed, topology, spec.experts(config))
    _check_weights_fit(config, spec)
    return split_batch(config, plan), plan


def split_batch(config: RunConfig, plan: ParallelPlan) -> RunConfig:
    """``config`` with the accumulation that ``batch.global_size`` asks for over the plan's data
    dimension (global = micro x accumulation x data); unchanged without a global size or with
    ``batch.micro = 'auto'`` (the search decides)."""
    b = config.batch
    if not isinstance(b.micro, int):
        return config
    accumulation = plan.accumulation_for(b.micro, b.global_size, b.accumulation)
    return config if accumulation == b.accumulation else config.replace(batch={"accumulation": accumulation})


def _check_weights_fit(config: RunConfig, spec: ModelSpec) -> None:
    """Sizes each inside their range can still multiply into a model whose weights alone exceed
    this machine's memory (an allocator traceback minutes later): said in one line instead."""
    total, _ = ram_bytes()
    count = spec.weight_count(config)
    if total and 4 * count > total:
        raise ConfigError(
            f"the model config describes at least {count:,} parameters: {4 * count / 2**30:,.1f} "
            f"GiB of float32 weights alone, more than this machine's {total / 2**30:,.1f} GiB of memory; make "
            "model.n_layer, model.d_model, moe.n_experts or moe.expert_hidden smaller"
        )


def train(
    config: RunConfig,
    *,
    resume_dir: Path | None = None,
    progress: bool | None = None,
    run_dir: Path | None = None,
    batch_given: bool = False,
    plan: ParallelPlan | None = None,
    spec: ModelSpec | None = None,
) -> dict[str, Any]:
    """Train ``config`` in a new run directory (``run_dir``, else one named from the config) or
    continue ``resume_dir``; returns the summary. A resume at another world size than the
    checkpoint's that would change the global batch is refused in one line unless ``batch_given``
    (the caller chose the batch for this resume: ``--batch.micro``/``global_size``/``accumulation``).

    A failure still writes summary.json (status "failed: ...") and keeps checkpoints and metrics.
    A run stopped by SIGTERM/SIGINT saves a checkpoint and returns (:func:`stopped_by_signal`);
    before the first step such a signal raises :class:`StoppedBySignal`. A new run that fails
    before its first step leaves no directory behind. Lack of space raises
    :class:`turbotrain.base.atomic.DiskFullError` naming the file and the last intact checkpoint.

    Under torchrun every rank calls it: the config is checked before the process group is
    joined (the same mistake on every rank: :func:`plan_run`, unless the caller passes the
    ``plan`` it resolved and joined, and the ``spec`` it made); rank 0 creates the run directory (its name goes to
    the others), holds its lock and writes every shared file (config, metrics, checkpoints,
    summary); the other ranks train in the same directory and write nothing.
    """
    if plan is None:
        plan = plan_run(config, spec=spec)[1]
        plan.join(local_device(resolve_device(config.run.device), plan.topology))
    new = resume_dir is None
    if resume_dir is not None:
        run_dir = resume_dir
    elif run_dir is None:
        run_dir = decided_by_main(lambda: new_run_dir(config))
    if plan.rank > 0:
        return _train_locked(config, run_dir, plan, spec, new, progress, main=False, batch_given=batch_given)
    with RunLock(run_dir):
        if new and holds_a_run(run_dir):  # another process made it between the check and the lock
            raise already_exists(run_dir)
        try:
            return _train_locked(config, run_dir, plan, spec, new, progress, batch_given=batch_given)
        except BaseException as exc:
            full = _disk_full(exc, run_dir)
            if full is not None:
                raise full from None
            raise


def _train_locked(
    config: RunConfig,
    run_dir: Path,
    plan: ParallelPlan,
    spec: ModelSpec | None,
    new: bool,
    progress: bool | None,
    main: bool = True,
    batch_given: bool = False,
) -> dict[str, Any]:
    """The run in ``run_dir``; ``main`` False (ranks other than 0): the same training, no shared file written."""
    # temp files of writes killed mid-way (checkpoints: the Checkpointer)
    for folder in (run_dir, run_dir / PLOTS_DIR) if main else ():
        clean_stale_temps(folder)
    with held_signals() as signals:
        try:
            signals.on_first(lambda name: stop_startup(name, run_dir, resumable=not new))
            if new and main:  # first of all: a run killed from here on has a config to resume from
                write_config(config, run_dir, {})
            training = build_training(
                config, run_dir, plan, resume=not new, progress=progress, batch_given=batch_given, spec=spec
            )
            if main and new:
                # as given ('auto' stays 'auto'), with what it resolved to
                write_config(config, run_dir, training.resolved)
            elif main:  # a resume's overrides reach config.toml once its first step has trained, never when it fails before
                training.hooks.insert(
                    0, WriteConfigOnce(lambda: write_config(config, run_dir, training.resolved))
                )
            # from here a signal is kept for the loop, which stops after a step (and saves)
            signals.on_first(None)
        except BaseException:
            if new and main:
                # created by this call, under its lock: nothing else is in it
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        return _train_built(training, run_dir, main)


def stop_startup(name: str, run_dir: Path | None, resumable: bool) -> None:
    """What the first SIGTERM/SIGINT does during start-up: raise :class:`StoppedBySignal`."""
    raise StoppedBySignal(name, run_dir, resumable)


def _train_built(training: Training, run_dir: Path, main: bool) -> dict[str, Any]:
    """Train the built run to its end (or a stop) and write its summary."""
    if training.engine.state.step >= training.config.train.max_steps:
        # A resume of a finished run: nothing to train, so nothing to log again (a final record
        # of this invocation would repeat the last step's); the summary comes from the metrics.
        training.monitor.close()
        if main:
            c = training.config
            more = (
                ("train.epochs", 2 * c.train.epochs)
                if c.train.epochs
                else ("train.max_steps", 2 * c.train.max_steps)
            )
            log.info(
                "%s is complete (step %d of %d): nothing to train; to train on, resume with a larger %s, e.g. %s",
                run_dir,
                training.engine.state.step,
                c.train.max_steps,
                more[0],
                setting(*more),
            )
        if main:  # what killed saves left, which the Checkpointer's start (never reached here) removes
            clean_stale_temps(run_dir / CHECKPOINTS)
            clean_unfinished(run_dir / CHECKPOINTS)
        if not main:
            return facts(training, None, "completed", 0.0)
        return write_summary(
            run_dir, facts(training, None, "completed", 0.0), read_metrics(run_dir / METRICS_FILE)[0]
        )
    start = time.perf_counter()

    def finish(ctx: FitContext | None, status: str) -> dict[str, Any]:
        known = facts(training, ctx, status, time.perf_counter() - start)
        return write_summary(run_dir, known, training.monitor.records) if main else known

    try:
        ctx = training.run()
    except BaseException as exc:
        # the disk is full: the error that says so is the one to raise
        with contextlib.suppress(DiskFullError):
            finish(None, f"failed: {type(exc).__name__}: {exc}")
        raise
    return finish(ctx, "stopped" if ctx.should_stop else "completed")


def _disk_full(exc: BaseException, run_dir: Path) -> DiskFullError | None:
    """``exc`` as one DiskFullError naming the file and the run's last intact checkpoint, when a
    lack of space caused it (through the atomic writer, or an append such as metrics.jsonl)."""
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
