"""Assemble a whole training run from a RunConfig: data, model, optimizer, engine, hooks.

This is the one place that reads the config for a run; ``fit()`` then receives built objects.
A run directory holds ``config.toml``, ``metrics.jsonl``, ``checkpoints/`` and ``summary.json``.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .checkpoint import Checkpointer, load_latest, rng_state, set_rng_state
from .config import RunConfig, load_config, to_toml
from .data import TokenSource, TokenWindows, build_loader, check_vocab, fixed_batches, open_tokens, resolve_loader_settings
from .doctor import collect_hardware
from .engine import Engine
from .errors import TurbotrainError
from .hooks import Evaluate, FitContext, Hook, StopAfter, StopOnSignal
from .loop import fit
from .memory import memory_summary, resolve_batch_size
from .models.build import build_model
from .models.gpt import GPT
from .monitor import JsonlSink, MfuProbe, Monitor, ProgressSink, TensorBoardSink, build_probes
from .optim import build_scheduler, optimizer_from_config, resolve_implementation
from .report import summarize_records

log = logging.getLogger(__name__)

CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, CHECKPOINTS = "config.toml", "metrics.jsonl", "summary.json", "checkpoints"


def new_run_dir(config: RunConfig) -> Path:
    """A fresh run directory; refuses to reuse one that already holds a run."""
    name = config.run.name or f"{config.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = Path(config.run.out_dir) / name
    try:
        if path.exists() and any(path.iterdir()):
            raise TurbotrainError(f"run directory {path} already exists; pass --resume to continue it or choose another --run.name")
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # out_dir is a file, not writable, ...
        raise TurbotrainError(f"cannot create run directory {path} ({exc.strerror}); choose another --run.out_dir") from None
    return path


def find_run_dir(out_dir: str, name: str = "") -> Path:
    """The named run, or the most recently modified run under ``out_dir`` that has a config."""
    if name:
        path = Path(out_dir) / name
        if not (path / CONFIG_FILE).is_file():
            path = Path(name)  # a path given directly
        if not (path / CONFIG_FILE).is_file():
            raise TurbotrainError(f"no run named {name!r} in {out_dir}/ and no run directory at that path "
                                  f"(no {CONFIG_FILE}); check the name given to --resume or --run.name")
        return path
    runs = [p for p in Path(out_dir).glob("*") if (p / CONFIG_FILE).is_file()]
    if not runs:
        raise TurbotrainError(f"no run to resume in {out_dir}/; start one with `turbotrain train`")
    return max(runs, key=lambda p: (p / CONFIG_FILE).stat().st_mtime)


def resume_config(run_dir: Path, overrides: Any = ()) -> RunConfig:
    """The run's saved config with ``overrides`` applied (for example a longer max_steps)."""
    return load_config(str(run_dir / CONFIG_FILE), overrides)


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
    resolved: dict[str, Any] = field(default_factory=dict)
    resumed_from: str = ""

    def run(self) -> FitContext:
        return fit(self.engine, self.model, self.optimizer, self.loader, max_steps=self.config.train.max_steps, hooks=self.hooks)


def build_training(config: RunConfig, run_dir: Path, *, resume: bool = False, progress: bool | None = None) -> Training:
    """Build the data, model, optimizer, engine and hooks for ``config`` in ``run_dir``."""
    c = config
    engine = Engine(c)
    source = open_tokens(c.data.path, val_fraction=c.data.val_fraction, cache_dir=c.data.cache_dir)
    train_windows = TokenWindows(source.train, c.model.block_size)
    val_windows = TokenWindows(source.val, c.model.block_size) if len(source.val) > c.model.block_size else None

    torch.manual_seed(c.run.seed)
    model = build_model(c.model, source.vocab_size)
    check_vocab(source, model.cfg.vocab_size)
    optimizer = optimizer_from_config(model, engine.device, c.optim)
    scheduler = build_scheduler(
        optimizer,
        schedule=c.optim.schedule,
        warmup_steps=c.optim.warmup_steps,
        max_steps=c.train.max_steps,
        lr=c.optim.lr,
        min_lr=c.optim.min_lr,
    )
    model, optimizer, _ = engine.setup(model, optimizer, scheduler=scheduler)
    # batch.micro = 'auto': search the size (or read this run's cache) before any checkpoint loads
    c, batch_search = resolve_batch_size(c, engine, model, optimizer, run_dir=run_dir, max_micro=train_windows.positions)

    resumed_from = ""
    if resume:
        path, payload = load_latest(run_dir / CHECKPOINTS)
        engine.load_state_dict(payload["engine"], optimizer)  # first: a precision fallback recasts the weights
        try:
            model.load_state_dict(payload["model"])
            optimizer.load_state_dict(payload["optimizer"])
        except (RuntimeError, ValueError) as exc:  # shapes or parameter groups changed by overrides
            detail = " ".join(str(exc).split())[:300]
            raise TurbotrainError(
                f"{path.name} does not fit the model this config builds ({detail}); "
                "resume without overrides that change --model.* settings"
            ) from None
        scheduler.load_state_dict(payload["scheduler"])
        set_rng_state(payload["rng"])
        resumed_from = path.name

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

    def payload(ctx: FitContext) -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "engine": engine.state_dict(),
            "rng": rng_state(),
            "config": to_toml(c),
        }

    show = c.monitor.progress if progress is None else progress
    sinks: list[Any] = [JsonlSink(run_dir / METRICS_FILE)]
    if c.monitor.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if show:
        sinks.append(ProgressSink(c.train.max_steps, engine.state.step))
    probes = build_probes(  # memory + NVML on CUDA; MFU from FLOPs per sample, counted once here
        engine.device, model=model, example_batch=fixed_batches(train_windows, c.batch.micro, 1, seed=c.run.seed)[0],
        precision=engine.precision.name, nvml_enabled=c.monitor.nvml, autocast=engine.autocast,
    )
    monitor = Monitor(c.monitor.log_every, sinks, probes)
    hooks: list[Hook] = [
        StopOnSignal(),
        StopAfter(c.train.stop_after_steps),
        Evaluate(val_batches, c.train.eval_every),
        monitor,
        Checkpointer(run_dir / CHECKPOINTS, c.train.checkpoint_every, c.train.keep_last, payload),
    ]
    return Training(c, run_dir, engine, model, optimizer, source, loader, hooks, monitor, resolved, resumed_from)


def write_config(config: RunConfig, run_dir: Path, resolved: dict[str, Any]) -> None:
    header = "# turbotrain run config (reload with --preset this-file.toml)\n# resolved: " + ", ".join(
        f"{k}={v}" for k, v in resolved.items() if k in ("device", "precision", "compile", "optimizer", "num_workers", "vocab_size")
    )
    tmp = run_dir / f".{CONFIG_FILE}.tmp"
    tmp.write_text(header + "\n" + to_toml(config))
    os.replace(tmp, run_dir / CONFIG_FILE)


def summarize(training: Training, ctx: FitContext | None, status: str, elapsed_s: float) -> dict[str, Any]:
    """summary.json: what ran, how fast, the final losses, and events such as fallbacks."""
    records = training.monitor.records
    rates = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
    losses = [r["loss"] for r in records if r.get("loss") is not None]
    vals = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    engine = training.engine
    summary = {
        "run": training.run_dir.name,
        "status": status,
        "steps": engine.state.step,
        "max_steps": training.config.train.max_steps,
        "tokens": engine.state.tokens,
        "elapsed_s": round(elapsed_s, 3),
        "first_step_s": training.monitor.first_step_s,
        "tokens_per_s_median": statistics.median(rates) if rates else None,
        "final_train_loss": losses[-1] if losses else None,
        "final_val_loss": vals[-1][1] if vals else None,
        "final_val_step": vals[-1][0] if vals else None,
        "stop_reason": ctx.stop_reason if ctx else "",
        "resumed_from": training.resumed_from,
        "resolved": training.resolved,
        "events": [asdict(e) for e in engine.events],
        "memory": memory_summary(training),
    }
    summary.update({k: v for k, v in summarize_records(records).items() if k not in summary})
    summary.update(_performance_context(training))
    tmp = training.run_dir / f".{SUMMARY_FILE}.tmp"
    tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    os.replace(tmp, training.run_dir / SUMMARY_FILE)
    return summary


def _performance_context(training: Training) -> dict[str, Any]:
    """Hardware, the optimizations in effect, FLOPs per sample and host memory, for the summary."""
    c, engine, r = training.config, training.engine, training.resolved
    cuda = engine.device.type == "cuda"
    mfu = next((p for p in training.monitor.probes if isinstance(p, MfuProbe)), None)
    return {
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
    ctx = None
    try:
        ctx = training.run()
    except BaseException as exc:
        summarize(training, ctx, f"failed: {type(exc).__name__}: {exc}", time.perf_counter() - start)
        raise
    return summarize(training, ctx, "stopped" if ctx.should_stop else "completed", time.perf_counter() - start)
