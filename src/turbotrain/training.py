"""Assemble a whole training run from a RunConfig: data, model, optimizer, engine, hooks.

This is the one place that reads the config for a run; ``fit()`` then receives built objects.
The files it leaves in the run directory are named in :mod:`turbotrain.rundir`; its summary.json
is written through :mod:`turbotrain.report`, which adds the figures from the metrics.

Nothing lost, nothing overwritten: the run directory is locked for as long as ``train()`` works
in it (:mod:`turbotrain.runlock`); ``config.toml`` is written before anything else, so a run
killed at any moment can be resumed (from step 0 when no checkpoint was saved yet); a resume
drops the metrics of steps it will run again, and rewrites ``config.toml`` (its overrides) only once
its first step has trained; SIGTERM/SIGINT are handled from the start to the end
(:mod:`turbotrain.signals`): during start-up they end it cleanly (:class:`StoppedBySignal`), during
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .assembly import build_trainable
from .atomic import DiskFullError, atomic_write, clean_stale_temps, disk_full_cause
from .checkpoint import Checkpointer, RunState, finished_checkpoints, latest_verified, restore_latest, run_state
from .config import RunConfig, setting, to_toml
from .data import TokenSource, TokenWindows, build_loader, check_vocab, fixed_batches, open_tokens, resolve_loader_settings
from .data.tokenizer import save_run_tokenizer
from .distributed import ReportedByMainRank, Topology, decided_by_main, join_process_group, local_device, main_first, resolve_strategy
from .engine import Engine, resolve_device
from .models.moe import parallel as expert_parallel
from .experts_monitor import experts_hooks
from .hardware import ram_bytes
from .errors import ConfigError, TurbotrainError
from .hooks import Evaluate, FitContext, Hook, StopAfter, StopOnSignal
from .loop import fit
from .memory import memory_summary, resolve_batch_size
from .models.build import build_model
from .models.gpt import GPT
from .monitor import JsonlSink, Monitor, ProgressSink, TensorBoardSink, build_probes
from .data.batching import build_budget_data, processes, resume_start
from .lr_plateau import ObservePlateau
from .optim import PlateauLR, lr_batch_factor, resolve_implementation, rescale_lr
from .report import read_metrics, write_summary
from .rundir import (
    CHECKPOINTS,
    CONFIG_FILE,
    METRICS_FILE,
    PLOTS_DIR,
    TENSORBOARD_DIR,
    TOKENIZER_FILE,
    already_exists,
    holds_a_run,
    new_run_dir,
    truncate_metrics,
)
from .runlock import RunLock
from .signals import held as held_signals
from .sharded import clean_unfinished, saved_world
from .tracking import run_facts

log = logging.getLogger(__name__)

SIGNAL_REASON = "signal "  # how StopOnSignal's stop_reason starts ("signal SIGTERM")


class StoppedBySignal(KeyboardInterrupt):
    """SIGTERM or SIGINT arrived before the first step: nothing was trained, nothing is lost.
    A KeyboardInterrupt, so no ``except Exception`` on the way can swallow it. ``run_dir`` is
    None when the run was not found or named yet."""

    def __init__(self, signame: str, run_dir: Path | None, resumable: bool) -> None:
        self.signame, self.run_dir, self.resumable = signame, run_dir, resumable
        then = f"continue with --resume {run_dir or ''}".rstrip() if resumable else "nothing was written; start it again"
        super().__init__(f"stopped by {signame} during start-up, before the first step; {then}")


def stopped_by_signal(summary: dict[str, Any]) -> bool:
    """Whether a run ended early because of SIGTERM/SIGINT (its final checkpoint is saved)."""
    return summary.get("status") == "stopped" and str(summary.get("stop_reason", "")).startswith(SIGNAL_REASON)


@dataclass
class Training:
    """Everything a run needs, built and resolved; ``run()`` trains it."""

    config: RunConfig
    run_dir: Path
    engine: Engine
    model: GPT
    optimizer: torch.optim.Optimizer
    source: TokenSource
    loader: Any
    hooks: list[Hook]
    monitor: Monitor
    state: RunState  # what checkpoints save and a resume loads
    resolved: dict[str, Any] = field(default_factory=dict)
    resumed_from: str = ""

    def run(self) -> FitContext:
        return fit(self.engine, self.model, self.optimizer, self.loader, max_steps=self.config.train.max_steps, hooks=self.hooks)


def build_training(config: RunConfig, run_dir: Path, *, resume: bool = False, progress: bool | None = None,
                   batch_given: bool = False) -> Training:
    """Build the data, model, optimizer, engine and hooks for ``config`` in ``run_dir``. A resume
    at another world size that would change the global batch is refused unless ``batch_given``
    (the resume names the batch itself: :func:`check_resume_batch`)."""
    topology = Topology.from_env()
    c = check_launch(config, topology)  # batch.global_size -> accumulation (the saved config keeps it as given)
    main = topology.rank == 0  # under torchrun rank 0 alone writes the run's shared files and prints
    show = (c.monitor.progress if progress is None else progress) and main
    source = main_first(lambda: open_tokens(  # rank 0 first: it fills the token cache, the others read it
        c.data.path, val_fraction=c.data.val_fraction, cache_dir=c.data.cache_dir, progress=show,
        tokenizer=c.data.tokenizer, vocab_size=c.model.vocab_size, saved_tokenizer=run_dir / TOKENIZER_FILE))
    if main:
        save_run_tokenizer(source.tokenizer, run_dir)  # what `turbotrain sample` decodes with
    train_windows = TokenWindows(source.train, c.model.block_size)
    val_windows = TokenWindows(source.val, c.model.block_size) if len(source.val) > c.model.block_size else None

    torch.manual_seed(c.run.seed)
    model = build_model(c.model, source.vocab_size)
    check_vocab(source, model.cfg.vocab_size)
    expert_parallel.apply(c, model)  # MoE: keep this rank's experts, before the optimizer sees the parameters
    t = build_trainable(c, model, max_steps=c.train.max_steps)
    plain = model  # the GPT itself: DDP wraps it, FSDP2 shards it in place
    engine, model, optimizer = t.engine, t.model, t.optimizer
    expert_parallel.attach_optimizer(plain, optimizer)  # MoE: checkpoints hold every expert's optimizer state
    engine.set_grad_norm(expert_parallel.grad_norm(plain))  # expert parallel: clip by the norm over every rank's experts
    rank, world = engine.strategy.rank, engine.strategy.world
    # batch.micro = 'auto': search the size (or read this run's cache) before any checkpoint loads
    c, batch_search = resolve_batch_size(c, engine, model, optimizer, run_dir=run_dir, max_micro=train_windows.positions)
    c, lr_note = _scale_lr(c, batch_search, optimizer, t.scheduler)  # optim.lr_scaling, before a checkpoint loads
    # the config rides along for reference only: a resume reads config.toml
    state = run_state(engine, model, optimizer, t.scheduler, config=(lambda: to_toml(c), lambda _: None))
    resumed_from = ""
    if resume and finished_checkpoints(run_dir / CHECKPOINTS):
        def same_batch(path: Path, written_by: int, saved: dict[str, Any]) -> None:  # before anything loads
            if c.data.batching == "windows" and not batch_given:
                check_resume_batch(path.name, saved.get("config"), written_by, c, world, rank)

        resumed = restore_latest(run_dir / CHECKPOINTS, state, before_load=same_batch)
        resumed_from = resumed.name
        # The data position in this run's batches: windows draw step s's rows from (seed, s) for
        # any split; token batching keeps its stream only with the same batches per step.
        if c.data.batching == "tokens":
            engine.state.batches = resume_start(engine.state.batches, engine.state.step,
                                                saved_world(resumed) if resumed.is_dir() else 1, world, c.batch.accumulation)
        else:
            engine.state.batches = engine.state.step * c.batch.accumulation
    elif resume:
        log.info("%s has no finished checkpoint (it stopped before its first one): training from step 0", run_dir)
    if resume and main:  # the steps after the checkpoint run again: their old records would count twice
        truncate_metrics(run_dir / METRICS_FILE, engine.state.step)
    if c.optim.warmup_steps > c.train.max_steps:
        log.warning("optim.warmup_steps = %d is longer than the run (train.max_steps = %d): the learning rate "
                    "peaks at %.0f%% of optim.lr; use %s or fewer", c.optim.warmup_steps, c.train.max_steps,
                    100 * c.train.max_steps / c.optim.warmup_steps, setting("optim.warmup_steps", c.train.max_steps))

    settings = resolve_loader_settings(engine.device, c.data.num_workers, c.data.pin_memory, c.data.prefetch_factor)
    if c.data.batching == "tokens":  # documents kept apart, batches by token budget
        budget = build_budget_data(
            c.data.path, source, c.model.block_size, c.batch.max_tokens or c.batch.micro * c.model.block_size, c.run.seed,
            settings, start=engine.state.batches, eval_batches=c.train.eval_batches * c.batch.accumulation,
            rank=rank, world=world,  # validation: eval_batches x accumulation x world stream batches, for any split
        )
        loader, val_batches, example = budget.loader, budget.val_batches, budget.example
    else:  # step s: micro x accumulation x world rows from (seed, s); this rank its chunks of them
        budget = None
        loader = build_loader(train_windows, c.batch.micro, c.run.seed, settings, start=engine.state.batches, rank=rank,
                              world=world, accumulation=c.batch.accumulation)
        val_batches = fixed_batches(val_windows, c.batch.micro, c.train.eval_batches, seed=c.run.seed + 1, rank=rank,
                                    world=world, accumulation=c.batch.accumulation) if val_windows else []
        example = fixed_batches(train_windows, c.batch.micro, 1, seed=c.run.seed)[0]
    loader = engine.setup_loader(loader)

    resolved = {
        "device": str(engine.device),
        "precision": engine.precision.name,
        "compile": engine.options.compile_scope,
        "compile_mode": c.compile.mode,
        "optimizer": f"AdamW ({resolve_implementation(c.optim.implementation, engine.device)})",
        "attention": "sdpa is_causal" if c.model.attention == "sdpa" else "sdpa + cached mask",
        "num_workers": settings.num_workers,
        "pin_memory": settings.pin_memory,
        "vocab_size": plain.cfg.vocab_size,
        "params": getattr(plain, "num_total_params", plain.num_params)(non_embedding=False),  # MoE: every expert
        **({"active_params": plain.num_active_params(non_embedding=False)} if hasattr(plain, "num_active_params") else {}),
        "data": source.description,
        "global_batch": c.batch.micro * c.batch.accumulation * world,
        "strategy": engine.strategy.name,
        "world_size": world,
    }
    if batch_search is not None:
        resolved["batch_search"] = batch_search.to_dict()
    if lr_note:
        resolved["lr_scaling"] = lr_note
    if budget is not None:
        resolved["batching"] = budget.description

    jsonl = JsonlSink(run_dir / METRICS_FILE) if main else None
    sinks: list[Any] = [jsonl] if jsonl is not None else []  # the other ranks measure but write nothing
    if c.monitor.tensorboard and main:
        sinks.append(TensorBoardSink(run_dir / TENSORBOARD_DIR))
    if show:
        sinks.append(ProgressSink(c.train.max_steps, engine.state.step))
    probes = build_probes(  # memory + NVML on CUDA; MFU from FLOPs per sample, counted once here
        engine.device, model=plain, example_batch=example,
        precision=engine.precision.name, nvml_enabled=c.monitor.nvml, autocast=engine.autocast, devices=world,
    )
    monitor = Monitor(c.monitor.log_every, sinks, probes, world=world)
    # Hooks run in this order at every event, and the order matters:
    # - the stop hooks only raise ctx.should_stop, which the loop reads after all hooks have run;
    # - Evaluate before Monitor: the record the Monitor writes for a step carries the validation
    #   loss Evaluate has just put in ctx.metrics (at the end too: final evaluation, then final record);
    # - Checkpointer last: its time is in ctx.side_s before the next window starts, and at the end
    #   the final record is written and the sinks closed before the save, so a failed save
    #   (a full disk) loses no metrics.
    # - data parallel: the ranks agree on a signal every log_every steps, so they stop together.
    hooks: list[Hook] = [
        StopOnSignal(engine.strategy.any_rank if world > 1 else None, c.monitor.log_every),
        StopAfter(c.train.stop_after_steps),
        Evaluate(val_batches, c.train.eval_every),
        *([ObservePlateau(t.scheduler)] if isinstance(t.scheduler, PlateauLR) else []),  # the loss Evaluate read
        *experts_hooks(plain, c.monitor.log_every, run_dir if main else None),  # MoE: tokens per expert
        monitor,
        Checkpointer(run_dir / CHECKPOINTS, c.train.checkpoint_every, c.train.keep_last, state,  # every rank: ddp/fsdp save together
                     before_save=jsonl.flush if jsonl is not None else None),
    ]
    return Training(c, run_dir, engine, model, optimizer, source, loader, hooks, monitor, state, resolved, resumed_from)


def check_resume_batch(checkpoint: str, saved_config: Any, saved_world: int, c: RunConfig, world: int, rank: int = 0) -> None:
    """Refuse a resume whose global batch (``c``'s micro x accumulation over ``world`` processes)
    is not the one ``checkpoint`` trained with (its saved config's micro x accumulation over the
    ``saved_world`` processes that wrote it): only another world size changes it unasked. The user
    picks: the same global batch (the same rows per step, for any split), or a new one.
    Said by rank 0; the other ranks end quietly. A checkpoint without a readable config passes."""
    if saved_world == world or not isinstance(saved_config, str):
        return
    try:
        batch = tomllib.loads(saved_config).get("batch", {})
        micro, accumulation = int(batch["micro"]), int(batch.get("accumulation", 1))
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return  # 'auto' never resolved, or a config this version cannot read: nothing to compare
    if not isinstance(c.batch.micro, int):
        return
    old, new = micro * accumulation * saved_world, c.batch.micro * c.batch.accumulation * world
    if old == new:
        return

    keep = []
    if old % (world * c.batch.accumulation) == 0:
        keep.append(setting('batch.micro', old // (world * c.batch.accumulation)))
    if old % (world * c.batch.micro) == 0:
        keep.append(f"{setting('batch.global_size', old)} (by accumulation {old // (world * c.batch.micro)})")
    # the rows of step s come from (seed, s) and the global batch: any split of it keeps them
    kept = f"{old} (the same batches) with {' or '.join(keep)}" if keep else f"{old} with another batch.micro"
    text = (f"{checkpoint} was trained at a global batch of {old} ({processes(saved_world)} x batch.micro {micro} x "
            f"accumulation {accumulation}) and this resume would train at {new} ({processes(world)} x {c.batch.micro} x "
            f"{c.batch.accumulation}); keep {kept}, or train at {new} with {setting('batch.micro', c.batch.micro)}")
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


def _scale_lr(c: RunConfig, search: Any, optimizer: torch.optim.Optimizer, scheduler: Any) -> tuple[RunConfig, str]:
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
    note = (f"{c.optim.lr_scaling}: global batch {search.global_batch} instead of {reference}, "
            f"lr {c.optim.lr:.4g} x {factor:.4g} = {c.optim.lr * factor:.4g}")
    log.info("optim.lr_scaling %s", note)
    return c.replace(optim={"lr": c.optim.lr * factor, "min_lr": c.optim.min_lr * factor}), note


def write_config(config: RunConfig, run_dir: Path, resolved: dict[str, Any]) -> None:
    """config.toml: the config as given, headed by what it resolved to (once start-up has done it)."""
    header = "# turbotrain run config (reload with --preset this-file.toml)\n# resolved: " + (", ".join(
        f"{k}={v}" for k, v in resolved.items() if k in ("device", "precision", "compile", "optimizer", "num_workers", "vocab_size")
    ) or "not yet (start-up has not finished)")
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
        "resumed_from": training.resumed_from,
        "resolved": r,
        "memory": memory_summary(training),
        "optimizations": {
            "precision": engine.precision.name,  # after any fallback
            **engine.precision.summary(),  # fp8: recipe, the converted layers, those kept in bf16 and why
            "tf32": c.precision.tf32 and cuda,
            "cudnn_benchmark": c.precision.cudnn_benchmark and cuda,
            "compile": r.get("compile") if r.get("compile") == "off" else f"{r.get('compile')} ({c.compile.mode})",
            "optimizer": r.get("optimizer"),
            "attention": r.get("attention"),
            "activation_checkpointing": c.memory.checkpointing,
            "micro_batch x accumulation": f"{c.batch.micro} x {c.batch.accumulation}",
            "data": f"{r.get('num_workers')} workers, pin_memory {r.get('pin_memory')}, "
                    f"device prefetch {c.data.device_prefetch and cuda}",
        },
        "host_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),  # Linux: KiB
        "config": c.to_dict(),
    }


def check_launch(config: RunConfig, topology: Topology) -> RunConfig:
    """``config`` checked against the launch (the strategy, expert parallelism, the global batch
    over ``world`` ranks) without any communication, so every rank finds the same mistake before joining the
    process group; with ``batch.global_size`` and a numeric ``batch.micro`` the accumulation
    follows (global = micro x accumulation x world)."""
    resolve_strategy(config.distributed, topology)
    expert_parallel.check_config(config, topology.world)
    _check_weights_fit(config)
    b = config.batch
    if b.global_size > 0 and isinstance(b.micro, int):
        per_step = b.micro * topology.world
        if b.global_size % per_step:
            lower = max(per_step, b.global_size // per_step * per_step)
            raise ConfigError(
                f"batch.global_size = {b.global_size} does not divide by batch.micro x world = {b.micro} x {topology.world}"
                f" = {per_step}; use {setting('batch.global_size', lower)} (a multiple of {per_step}) or another batch.micro")
        accumulation = b.global_size // per_step
        if b.accumulation not in (1, accumulation):
            raise ConfigError(
                f"batch.accumulation = {b.accumulation} contradicts batch.global_size = {b.global_size} = batch.micro x "
                f"accumulation x world = {b.micro} x {accumulation} x {topology.world}; set one of them")
        config = config.replace(batch={"accumulation": accumulation})
    return config


def weight_count(m: Any) -> int:
    """A lower bound on the parameters of the model section ``m`` describes (the embeddings of at
    least 256 tokens, attention, MLPs or every expert's MLP): the model is built in float32 on the
    host before anything moves it or spreads its experts."""
    d, vocab = m.d_model, max(m.vocab_size, 256)
    hidden = m.expert_hidden or 4 * d
    moe = m.n_layer // m.moe_every if m.arch == "moe" else 0
    return vocab * d + m.block_size * d + m.n_layer * 4 * d * d + (m.n_layer - moe) * 8 * d * d + moe * m.n_experts * 2 * d * hidden


def _check_weights_fit(config: RunConfig) -> None:
    """Sizes each inside their range can still multiply into a model whose weights alone exceed
    this machine's memory (an allocator traceback minutes later): said in one line instead."""
    total, _ = ram_bytes()
    need = 4 * weight_count(config.model)
    if total and need > total:
        raise ConfigError(f"the model section describes at least {weight_count(config.model):,} parameters: {need / 2**30:,.1f} "
                          f"GiB of float32 weights alone, more than this machine's {total / 2**30:,.1f} GiB of memory; make "
                          "model.n_layer, model.d_model, model.n_experts or model.expert_hidden smaller")


def train(config: RunConfig, *, resume_dir: Path | None = None, progress: bool | None = None,
          run_dir: Path | None = None, batch_given: bool = False) -> dict[str, Any]:
    """Train ``config`` in a new run directory (``run_dir``, else one named from the config) or
    continue ``resume_dir``; returns the summary. A resume at another world size than the
    checkpoint's that would change the global batch is refused in one line unless ``batch_given``
    (the caller chose the batch for this resume: ``--batch.micro``/``global_size``/``accumulation``).

    A failure still writes summary.json (status "failed: ...") and keeps checkpoints and metrics.
    A run stopped by SIGTERM/SIGINT saves a checkpoint and returns (:func:`stopped_by_signal`);
    before the first step such a signal raises :class:`StoppedBySignal`. A new run that fails
    before its first step leaves no directory behind. Lack of space raises
    :class:`turbotrain.atomic.DiskFullError` naming the file and the last intact checkpoint.

    Under torchrun every rank calls it: the config is checked before the process group is
    joined (the same mistake on every rank); rank 0 creates the run directory (its name goes to
    the others), holds its lock and writes every shared file (config, metrics, checkpoints,
    summary); the other ranks train in the same directory and write nothing.
    """
    topology = Topology.from_env()
    check_launch(config, topology)
    join_process_group(config.distributed, local_device(resolve_device(config.run.device), topology), topology)
    new = resume_dir is None
    if resume_dir is not None:
        run_dir = resume_dir
    elif run_dir is None:
        run_dir = decided_by_main(lambda: new_run_dir(config))
    if topology.rank > 0:
        return _train_locked(config, run_dir, new, progress, main=False, batch_given=batch_given)
    with RunLock(run_dir):
        if new and holds_a_run(run_dir):  # another process made it between the check and the lock
            raise already_exists(run_dir)
        try:
            return _train_locked(config, run_dir, new, progress, batch_given=batch_given)
        except BaseException as exc:
            full = _disk_full(exc, run_dir)
            if full is not None:
                raise full from None
            raise


def _train_locked(config: RunConfig, run_dir: Path, new: bool, progress: bool | None, main: bool = True,
                  batch_given: bool = False) -> dict[str, Any]:
    """The run in ``run_dir``; ``main`` False (ranks other than 0): the same training, no shared file written."""
    for folder in (run_dir, run_dir / PLOTS_DIR) if main else ():  # temp files of writes killed mid-way (checkpoints: the Checkpointer)
        clean_stale_temps(folder)
    with held_signals() as signals:
        try:
            signals.on_first(lambda name: stop_startup(name, run_dir, resumable=not new))
            if new and main:  # first of all: a run killed from here on has a config to resume from
                write_config(config, run_dir, {})
            training = build_training(config, run_dir, resume=not new, progress=progress, batch_given=batch_given)
            if main and new:
                write_config(config, run_dir, training.resolved)  # as given ('auto' stays 'auto'), with what it resolved to
            elif main:  # a resume's overrides reach config.toml once its first step has trained, never when it fails before
                training.hooks.insert(0, WriteConfigOnce(lambda: write_config(config, run_dir, training.resolved)))
            signals.on_first(None)  # from here a signal is kept for the loop, which stops after a step (and saves)
        except BaseException:
            if new and main:
                shutil.rmtree(run_dir, ignore_errors=True)  # created by this call, under its lock: nothing else is in it
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
        if main:  # what killed saves left, which the Checkpointer's start (never reached here) removes
            clean_stale_temps(run_dir / CHECKPOINTS)
            clean_unfinished(run_dir / CHECKPOINTS)
        if not main:
            return facts(training, None, "completed", 0.0)
        return write_summary(run_dir, facts(training, None, "completed", 0.0), read_metrics(run_dir / METRICS_FILE)[0])
    start = time.perf_counter()

    def finish(ctx: FitContext | None, status: str) -> dict[str, Any]:
        known = facts(training, ctx, status, time.perf_counter() - start)
        return write_summary(run_dir, known, training.monitor.records) if main else known

    try:
        ctx = training.run()
    except BaseException as exc:
        with contextlib.suppress(DiskFullError):  # the disk is full: the error that says so is the one to raise
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
        full = DiskFullError(cause.filename or f"the files of run {run_dir}", cause.strerror or "no space left")
    last = latest_verified(run_dir / CHECKPOINTS)
    if last is None:
        return full.with_note("no checkpoint was saved yet")
    return full.with_note(f"the last intact checkpoint is {last}; continue with --resume once there is space")
