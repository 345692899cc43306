"""Assemble a whole training run from a RunConfig: data, model, optimizer, engine, hooks.

This is the one place that reads the config for a run; ``fit()`` then receives built objects.
The files it leaves in the run directory are named in :mod:`turbotrain.rundir`; its summary.json
is written through :mod:`turbotrain.report`, which adds the figures from the metrics.
"""

from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .assembly import build_trainable
from .atomic import atomic_write
from .checkpoint import Checkpointer, RunState, restore_latest, run_state
from .config import RunConfig, to_toml
from .data import TokenSource, TokenWindows, build_loader, check_vocab, fixed_batches, open_tokens, resolve_loader_settings
from .doctor import collect_hardware
from .engine import Engine
from .hooks import Evaluate, FitContext, Hook, StopAfter, StopOnSignal
from .loop import fit
from .memory import memory_summary, resolve_batch_size
from .models.build import build_model
from .models.gpt import GPT
from .monitor import JsonlSink, MfuProbe, Monitor, ProgressSink, TensorBoardSink, build_probes
from .optim import resolve_implementation
from .report import write_summary
from .rundir import CHECKPOINTS, CONFIG_FILE, METRICS_FILE, TENSORBOARD_DIR, new_run_dir


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


def build_training(config: RunConfig, run_dir: Path, *, resume: bool = False, progress: bool | None = None) -> Training:
    """Build the data, model, optimizer, engine and hooks for ``config`` in ``run_dir``."""
    c = config
    source = open_tokens(c.data.path, val_fraction=c.data.val_fraction, cache_dir=c.data.cache_dir)
    train_windows = TokenWindows(source.train, c.model.block_size)
    val_windows = TokenWindows(source.val, c.model.block_size) if len(source.val) > c.model.block_size else None

    torch.manual_seed(c.run.seed)
    model = build_model(c.model, source.vocab_size)
    check_vocab(source, model.cfg.vocab_size)
    t = build_trainable(c, model, max_steps=c.train.max_steps)
    engine, model, optimizer = t.engine, t.model, t.optimizer
    # batch.micro = 'auto': search the size (or read this run's cache) before any checkpoint loads
    c, batch_search = resolve_batch_size(c, engine, model, optimizer, run_dir=run_dir, max_micro=train_windows.positions)
    # the config rides along for reference only: a resume reads config.toml
    state = run_state(engine, model, optimizer, t.scheduler, config=(lambda: to_toml(c), lambda _: None))
    resumed_from = restore_latest(run_dir / CHECKPOINTS, state).name if resume else ""

    settings = resolve_loader_settings(engine.device, c.data.num_workers, c.data.pin_memory, c.data.prefetch_factor)
    loader = build_loader(train_windows, c.batch.micro, c.run.seed, settings, start=engine.state.batches)
    loader = engine.setup_loader(loader)
    val_batches = fixed_batches(val_windows, c.batch.micro, c.train.eval_batches, seed=c.run.seed + 1) if val_windows else []

    resolved = {
        "device": str(engine.device),
        "precision": engine.precision.name,
        "compile": engine.options.compile_scope,
        "compile_mode": c.compile.mode,
        "optimizer": f"AdamW ({resolve_implementation(c.optim.implementation, engine.device)})",
        "attention": "sdpa is_causal" if c.model.attention == "sdpa" else "sdpa + cached mask",
        "num_workers": settings.num_workers,
        "pin_memory": settings.pin_memory,
        "vocab_size": model.cfg.vocab_size,
        "params": model.num_params(non_embedding=False),
        "data": source.description,
        "global_batch": c.batch.micro * c.batch.accumulation,
    }
    if batch_search is not None:
        resolved["batch_search"] = batch_search.to_dict()

    show = c.monitor.progress if progress is None else progress
    sinks: list[Any] = [JsonlSink(run_dir / METRICS_FILE)]
    if c.monitor.tensorboard:
        sinks.append(TensorBoardSink(run_dir / TENSORBOARD_DIR))
    if show:
        sinks.append(ProgressSink(c.train.max_steps, engine.state.step))
    probes = build_probes(  # memory + NVML on CUDA; MFU from FLOPs per sample, counted once here
        engine.device, model=model, example_batch=fixed_batches(train_windows, c.batch.micro, 1, seed=c.run.seed)[0],
        precision=engine.precision.name, nvml_enabled=c.monitor.nvml, autocast=engine.autocast,
    )
    monitor = Monitor(c.monitor.log_every, sinks, probes)
    # Hooks run in this order at every event, and the order matters:
    # - the stop hooks only raise ctx.should_stop, which the loop reads after all hooks have run;
    # - Evaluate before Monitor: the record the Monitor writes for a step carries the validation
    #   loss Evaluate has just put in ctx.metrics (at the end too: final evaluation, then final record);
    # - Checkpointer last: its time is in ctx.side_s before the next window starts, and at the end
    #   the final record is written and the sinks closed before the save, so a failed save
    #   (a full disk) loses no metrics.
    hooks: list[Hook] = [
        StopOnSignal(),
        StopAfter(c.train.stop_after_steps),
        Evaluate(val_batches, c.train.eval_every),
        monitor,
        Checkpointer(run_dir / CHECKPOINTS, c.train.checkpoint_every, c.train.keep_last, state),
    ]
    return Training(c, run_dir, engine, model, optimizer, source, loader, hooks, monitor, state, resolved, resumed_from)


def write_config(config: RunConfig, run_dir: Path, resolved: dict[str, Any]) -> None:
    header = "# turbotrain run config (reload with --preset this-file.toml)\n# resolved: " + ", ".join(
        f"{k}={v}" for k, v in resolved.items() if k in ("device", "precision", "compile", "optimizer", "num_workers", "vocab_size")
    )
    atomic_write(run_dir / CONFIG_FILE, header + "\n" + to_toml(config))


def facts(training: Training, ctx: FitContext | None, status: str, elapsed_s: float) -> dict[str, Any]:
    """What the run knows beyond its metrics, for summary.json: what ran, how long, where it stopped,
    events such as fallbacks, hardware, the optimizations in effect, memory, FLOPs per sample."""
    c, engine, r = training.config, training.engine, training.resolved
    cuda = engine.device.type == "cuda"
    mfu = next((p for p in training.monitor.probes if isinstance(p, MfuProbe)), None)
    return {
        "run": training.run_dir.name,
        "status": status,
        "steps": engine.state.step,
        "max_steps": c.train.max_steps,
        "tokens": engine.state.tokens,
        "elapsed_s": round(elapsed_s, 3),
        "first_step_s": training.monitor.first_step_s,
        "stop_reason": ctx.stop_reason if ctx else "",
        "resumed_from": training.resumed_from,
        "resolved": r,
        "events": [asdict(e) for e in engine.events],
        "memory": memory_summary(training),
        "hardware": collect_hardware(engine.device),
        "optimizations": {
            "precision": engine.precision.name,  # after any fallback
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
        "flops_per_sample": mfu.flops_per_sample if mfu else None,
        "flops_source": mfu.source if mfu else None,
        "peak_tflops": mfu.peak_tflops(engine.precision.name) if mfu else None,
        "host_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),  # Linux: KiB
        "config": c.to_dict(),
    }


def train(config: RunConfig, *, resume_dir: Path | None = None, progress: bool | None = None) -> dict[str, Any]:
    """Train ``config`` in a new run directory (or continue ``resume_dir``); returns the summary.

    A failure still writes summary.json (status "failed: ...") and keeps checkpoints and metrics.
    """
    run_dir = resume_dir if resume_dir is not None else new_run_dir(config)
    try:
        training = build_training(config, run_dir, resume=resume_dir is not None, progress=progress)
    except BaseException:
        if resume_dir is None and not any(run_dir.iterdir()):
            run_dir.rmdir()  # a run that never started leaves no empty directory behind
        raise
    write_config(config, run_dir, training.resolved)
    start = time.perf_counter()

    def finish(ctx: FitContext | None, status: str) -> dict[str, Any]:
        return write_summary(run_dir, facts(training, ctx, status, time.perf_counter() - start), training.monitor.records)

    try:
        ctx = training.run()
    except BaseException as exc:
        finish(None, f"failed: {type(exc).__name__}: {exc}")
        raise
    return finish(ctx, "stopped" if ctx.should_stop else "completed")
