"""Short measured runs of a preset or your workload with given settings: what ``profile`` and
``tune`` are made of. A preset's loader hands out whole optimizer steps that the engine cuts into
micro-batches, so every run trains on the same samples in the same order whatever its micro-batch:
runs differ only in arithmetic, and their losses compare (loss parity)."""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.profiler import record_function
from torch.utils.data import DataLoader

from ..base.atomic import atomic_write
from ..base.batch import batch_size, move_to
from ..base.config import RunConfig, audience, flat, load_config  # noqa: F401 (flat: turbotrain.measure.flat)
from ..base.errors import TurbotrainError
from ..base.process import run_process
from ..base.rundir import workload_label
from ..base.seeds import rng_state, set_rng_state
from ..core.assembly import build_trainable
from ..core.compile_guard import collect_compile_counts, ranked_reasons
from ..core.engine import Engine, LossFn, default_loss
from ..core.meter.clock import StepClock
from ..loop.fit import fit
from ..loop.hooks import FitContext, Hook, HookList
from ..loop.monitor import MfuProbe, Monitor
from ..loop.run_hooks import MonitorPlan, build_monitor, monitor_plan
from ..parts.data import TokenWindows, build_loader, fixed_batches, resolve_loader_settings
from ..parts.hardware import precision_key, tf32_enabled
from ..parts.workload import Workload, copy_workload, load_workload, loader_summary, rebuild_loader
from ..tools.memory import StepTrial
from .prepare import prepare_config
from .regime import PROBE_STEPS, Timeline
from .training import assemble

DATA_LABEL = "turbotrain::data_wait"  # profiler ranges: the host blocked on the loader ...
FORWARD_LABEL = "turbotrain::forward"  # ... and the forward pass (the loss function)
HOOK_LABEL = "turbotrain::hook::"  # + the hook's class name (profile wraps hooks in it)
PARITY_BATCHES = 4  # fixed held-out batches the parity loss is computed on
PARITY_BATCH = 8  # samples per parity batch (presets): the same windows whatever the micro-batch

Overrides = dict[str, dict[str, Any]]


def merge(*layers: Mapping[str, Mapping[str, Any]] | None) -> Overrides:
    """Nested ``{section: {key: value}}`` dicts merged, later wins."""
    out: Overrides = {}
    for layer in layers:
        for section, values in (layer or {}).items():
            out.setdefault(section, {}).update(values)
    return out


@dataclass(frozen=True)
class Target:
    """What to run: ``preset`` (a name or .toml path) or ``model`` (FILE.py:FUNC), and the
    user's fixed ``overrides``."""

    preset: str | None = None
    model: str | None = None
    overrides: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # a live one (Python callers, in-process runs only)
    workload: Workload | None = field(default=None, compare=False)

    @property
    def is_workload(self) -> bool:
        return bool(self.model) or self.workload is not None

    @property
    def label(self) -> str:
        if self.workload is not None and not self.model:
            return type(self.workload.model).__name__
        if self.model:
            return workload_label(self.model)  # the file's name, as train names its runs
        preset = self.preset or "gpt-tiny"
        return Path(preset).stem if preset.endswith(".toml") else preset

    def config(self, changes: Mapping[str, Mapping[str, Any]] | None = None) -> RunConfig:
        """The run's config: the preset (a workload's may be None: the defaults) + overrides + ``changes``."""
        return load_config(
            self.preset or (None if self.is_workload else "gpt-tiny"), merge(self.overrides, changes)
        )

    def explicit(self, changes: Mapping[str, Mapping[str, Any]] | None, key: str) -> Any:
        """The value of ``section.key`` set by the overrides or ``changes`` (None when unset)."""
        section, _, name = key.partition(".")
        return merge(self.overrides, changes).get(section, {}).get(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "model": self.model,
            "overrides": {k: dict(v) for k, v in self.overrides.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Target:
        return cls(data.get("preset"), data.get("model"), data.get("overrides") or {})


def run_child(
    module: str,
    folder: Path,
    spec: Mapping[str, Any],
    env: dict[str, str],
    timeout_s: float,
    *args: str,
    poll: Callable[[], bool] | None = None,
) -> tuple[int | None, dict[str, Any] | None, list[str]]:
    """``python -m module *args --spec spec.json --result result.json`` in ``folder`` (output to
    log.txt; the child's side is :func:`child_main`): (exit code, None when stopped; its result or
    None; the command)."""
    folder.mkdir(parents=True, exist_ok=True)
    spec_path, result = folder / "spec.json", folder / "result.json"
    result.unlink(missing_ok=True)
    spec_path.write_text(json.dumps(spec, indent=1, default=str))
    cmd = [sys.executable, "-m", module, *args, "--spec", str(spec_path), "--result", str(result)]
    code = run_process(cmd, folder / "log.txt", env, timeout_s, poll=poll)
    return code, json.loads(result.read_text()) if result.is_file() else None, cmd


def child_main(
    argv: Sequence[str] | None,
    description: str,
    work: Callable[[dict[str, Any], argparse.Namespace], dict[str, Any]],
    *names: str,
) -> int:
    """A child process of :func:`run_child`: ``names`` (positional, or a required ``--option``),
    ``--spec`` and ``--result``; ``work(spec, args)``'s result, with ``process_s``, written
    atomically as JSON. Exit 1 when its ``status`` is "failed"."""
    parser = argparse.ArgumentParser(description=description)
    for name in (*names, "--spec", "--result"):
        if name.startswith("--"):
            parser.add_argument(name, required=True)
        else:
            parser.add_argument(name)
    args = parser.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    start = time.perf_counter()
    with audience("cli"):  # its messages reach the parent's command line: flags, not dicts
        result = work(spec, args)
    result["process_s"] = time.perf_counter() - start
    atomic_write(args.result, json.dumps(result, indent=1, default=str) + "\n")
    return 1 if result.get("status") == "failed" else 0


class DataWait:
    """Iterate ``loader`` (epoch after epoch when ``endless``), adding up the host time blocked
    in ``next()`` (``seconds``) and marking it as a profiler range."""

    def __init__(self, loader: Iterable[Any], endless: bool = False) -> None:
        self.loader, self.endless, self.seconds, self.batches = loader, endless, 0.0, 0

    def __iter__(self) -> Iterator[Any]:
        while True:
            it = iter(self.loader)
            started = False
            while True:
                t0 = time.perf_counter()
                with record_function(DATA_LABEL):
                    try:
                        batch = next(it)
                    except StopIteration:
                        break
                self.seconds += time.perf_counter() - t0
                self.batches += 1
                started = True
                yield batch
            if not (self.endless and started):
                return

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)


class Labelled(HookList):
    """``hook`` with its per-step work marked as a profiler range (``HOOK_LABEL`` + its class)."""

    def __init__(self, hook: Hook) -> None:
        super().__init__([hook])
        self.label = HOOK_LABEL + type(hook).__name__

    def on_step_end(self, ctx: FitContext) -> None:
        with record_function(self.label):
            super().on_step_end(ctx)


def labelled(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` with its call (the forward pass) marked as a profiler range."""

    def forward(model: nn.Module, batch: Any) -> Any:
        with record_function(FORWARD_LABEL):
            return loss_fn(model, batch)

    return forward


@dataclass
class Built:
    """A run assembled and set up, not yet trained."""

    target: Target
    config: RunConfig
    engine: Engine
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loader: Iterable[Any]  # on the device (engine.setup_loader over ``data``)
    data: DataWait
    loss_fn: LossFn  # the forward, labelled
    monitor: Monitor
    make_batch: Callable[[int], Any]  # a batch of a given micro-batch on the device (memory measurement)
    micro: int  # samples per forward/backward
    parity_batches: list[Any]
    loader_info: dict[str, Any]
    run_dir: Path
    workload: Workload | None = None
    batch_search: dict[str, Any] | None = None  # the batch finder's answer (preset with batch.micro = auto)
    files: list[Any] = field(default_factory=list)  # what holds the run's token files open: closed by release

    @property
    def throughput_unit(self) -> str:
        return "tokens/s" if self.workload is None else "samples/s"

    @property
    def _mfu(self) -> MfuProbe | None:
        return next((p for p in self.monitor.probes if isinstance(p, MfuProbe)), None)

    @property
    def flops_per_sample(self) -> float | None:
        return self._mfu.flops_per_sample if self._mfu else None

    @property
    def peak_tflops(self) -> float | None:
        return self._mfu.peak_tflops(self.engine.precision.mfu_peak()) if self._mfu else None


def build(target: Target, changes: Mapping[str, Mapping[str, Any]] | None, run_dir: Path) -> Built:
    """Assemble ``target`` with ``changes`` in ``run_dir``, prepared as every run is; only what a
    measured run uses (no checkpoints, evaluation or run loader)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    config = target.config(merge(changes, {"monitor": {"progress": False}}))
    if target.is_workload:
        return _build_workload(target, changes, config, run_dir)
    run = prepare_config(config, run_dir)
    a, spec = assemble(run, show=False), run.spec
    config, engine, source = a.config, a.trainable.engine, a.data.source  # type: ignore[attr-defined]
    draws = rng_state()  # counting FLOPs runs a forward: the steps draw from the generators as a run's do
    monitor, _ = build_monitor(
        engine, a.plain, a.data.example(config), monitor_plan(config, run_dir), loss_fn=a.loss_fn
    )
    set_rng_state(draws)
    settings = resolve_loader_settings(
        engine.device, config.data.num_workers, config.data.pin_memory, config.data.prefetch_factor
    )
    micro, accumulation = int(config.batch.micro), config.batch.accumulation
    # whole optimizer steps, cut by the engine: the same samples whatever the micro-batch (loss parity)
    block = spec.seq_len(config)
    assert block is not None  # not a workload: a language model's token rows
    train = TokenWindows(source.train, block)
    data = DataWait(build_loader(train, micro * accumulation, config.run.seed, settings))
    engine.set_accumulation(1)
    engine.set_split(accumulation)
    parity, val = _preset_parity(source, block, config.run.seed)
    batch = spec.random_batch(
        config, spec.vocab_size(config) or source.vocab_size, engine.device, seed=config.run.seed
    )
    return Built(
        target=target,
        config=config,
        engine=engine,
        model=a.trainable.model,
        optimizer=a.trainable.optimizer,
        loader=engine.setup_loader(data),
        data=data,
        loss_fn=labelled(default_loss),
        monitor=monitor,
        make_batch=batch,
        micro=micro,
        parity_batches=parity,
        loader_info=_loader_info(config, engine, settings, micro, f"DataLoader over {source.description}"),
        run_dir=run_dir,
        batch_search=a.batch_search.to_dict() if a.batch_search is not None else None,
        files=[train, a.data, *val],
    )


def _preset_parity(source: Any, block: int, seed: int) -> tuple[list[Any], list[TokenWindows]]:
    """The fixed held-out batches of a preset's validation tokens (none when too few), and their windows."""
    if len(source.val) <= block + 1:
        return [], []
    val = TokenWindows(source.val, block)
    return fixed_batches(val, PARITY_BATCH, PARITY_BATCHES, seed=seed + 1), [val]


def _loader_info(config: RunConfig, engine: Engine, loader: Any, micro: int, what: str) -> dict[str, Any]:
    """How the run's batches are loaded (``loader``: a DataLoader or the resolved loader settings)."""
    workers = getattr(loader, "num_workers", None)
    return {
        "num_workers": workers,
        "pin_memory": getattr(loader, "pin_memory", None),
        "prefetch_factor": getattr(loader, "prefetch_factor", None) if workers else None,
        "device_prefetch": config.data.device_prefetch and engine.device.type == "cuda",
        "batch_size": micro,
        "loader": what,
    }


def _workload_loader(
    loader: Any, target: Target, changes: Mapping[str, Mapping[str, Any]] | None, seed: int
) -> Any:
    """The workload's train_loader with the run's ``data.num_workers`` and ``batch.micro`` (when
    set), shuffled from a seeded generator: the same samples whatever the settings."""
    workers, micro = target.explicit(changes, "data.num_workers"), target.explicit(changes, "batch.micro")
    if isinstance(loader, DataLoader):
        return rebuild_loader(
            loader,
            num_workers=None if workers is None or int(workers) < 0 else int(workers),
            batch_size=None if micro is None else int(micro),
            seed=seed,
        )
    if (workers is not None and int(workers) >= 0) or micro is not None:
        return rebuild_loader(loader, num_workers=0)  # refused with a one-line reason: not a DataLoader
    return loader


def _build_workload(
    target: Target, changes: Mapping[str, Mapping[str, Any]] | None, config: RunConfig, run_dir: Path
) -> Built:
    if target.workload is not None:
        w = copy_workload(target.workload)
    else:
        w = load_workload(target.model or "", seed=config.run.seed)
    loader = _workload_loader(w.train_loader, target, changes, config.run.seed)
    loss_fn = w.loss_fn or default_loss
    data = DataWait(loader, endless=True)
    # prepared as every run is; its micro-batch is the loader's, so the config trains as given
    plan = prepare_config(config, run_dir, workload=w).plan
    # the workload's own optimizer when it has one (setup returns the optimizer it is given)
    t = build_trainable(config, w.model, loader=data, optimizer=w.optimizer, plan=plan)
    engine, device_loader = t.engine, t.loader
    assert device_loader is not None
    first = next(iter(loader), None)
    if first is None:  # an empty loader: one line, not a bare StopIteration
        raise TurbotrainError(f"--model {target.model or 'workload'}: train_loader yielded no batch")
    example = move_to(first, engine.device)
    held_out = w.eval_loader if w.eval_loader is not None else ()
    parity = [move_to(b, engine.device) for b, _ in zip(held_out, range(PARITY_BATCHES))] or [example]
    watch = MonitorPlan(config.monitor.log_every, run_dir, nvml=config.monitor.nvml)
    monitor, _ = build_monitor(engine, t.model, example, watch, loss_fn=loss_fn)
    info = _loader_info(config, engine, loader, batch_size(example), loader_summary(loader))
    return Built(
        target=target,
        config=config,
        engine=engine,
        model=t.model,
        optimizer=t.optimizer,
        loader=device_loader,
        data=data,
        loss_fn=labelled(loss_fn),
        monitor=monitor,
        make_batch=lambda _micro: example,
        micro=batch_size(example),
        parity_batches=parity,
        loader_info=info,
        run_dir=run_dir,
        workload=w,
    )


def compile_counters() -> dict[str, int]:
    """torch.compile's frames compiled and graph breaks so far in this process (0 without dynamo)."""
    counts = collect_compile_counts()
    return {"compiled_frames": counts.frames, "graph_breaks": counts.graph_breaks}


def graph_break_reasons(limit: int = 3) -> list[str]:
    """``"3x reason"`` for the most frequent graph-break reasons (empty without dynamo)."""
    return ranked_reasons(collect_compile_counts().break_reasons, limit)


def measure_memory(built: Built) -> int:
    """Peak bytes of one training step at the run's micro-batch, as the batch finder measures it
    (CUDA allocator peak; elsewhere the tensors' bytes), in eager mode (no compilation). The
    model, optimizer and RNG are restored afterwards. Raises torch.OutOfMemoryError."""
    raw = built.workload.loss_fn if built.workload is not None else None
    with StepTrial(built.engine, built.model, built.optimizer, built.make_batch, raw) as trial:
        return trial(built.micro).peak_bytes


@dataclass(eq=False)  # a hook: compared by identity
class _Measure(Hook):
    """Marks every optimizer step on the clock; notes the counters at the end of the warm-up;
    every ``window`` timed steps reports the window's throughput (host clock) to ``on_window``;
    stops the loop after ``total`` steps."""

    built: Built
    clock: StepClock
    warmup: int
    steps: int
    total: int
    window: int
    on_window: Callable[[int, float], None] | None
    on_warm: Callable[[dict[str, Any]], None] | None
    at_warm: dict[str, Any] = field(default_factory=dict)
    at_end: dict[str, Any] = field(default_factory=dict)
    _mark: tuple[float, int] = (0.0, 0)

    KEYS: ClassVar[dict[str, str]] = {"tokens/s": "tokens", "samples/s": "samples"}

    def _count(self) -> dict[str, Any]:
        s = self.built.engine.state
        return {
            "t": time.perf_counter(),
            "samples": s.samples,
            "tokens": s.tokens,
            "data_s": self.built.data.seconds,
            **compile_counters(),
        }

    def on_step_end(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        if step <= self.warmup + self.steps:
            self.clock.mark(ctx.engine.last_loss)
        if step == self.warmup:
            self.at_warm = self._count()
            self._mark = (self.at_warm["t"], self.at_warm[self.KEYS[self.built.throughput_unit]])
            if self.built.engine.device.type == "cuda":
                self.at_warm["peak_bytes"] = torch.cuda.max_memory_allocated(self.built.engine.device)
            if self.on_warm is not None:
                self.on_warm(self.at_warm)
        elif (
            step > self.warmup and self.window and self.on_window and (step - self.warmup) % self.window == 0
        ):
            self.built.engine.synchronize()  # host-device sync point: once per window, for the pruner's figure
            now, count = time.perf_counter(), getattr(ctx.engine.state, self.KEYS[self.built.throughput_unit])
            self.on_window(
                (step - self.warmup) // self.window, (count - self._mark[1]) / max(now - self._mark[0], 1e-9)
            )
            self._mark = (now, count)
        if step == self.warmup + self.steps:
            self.clock.finish()  # one synchronize: the timed window ends here
            self.at_end = self._count()
        if step >= self.total:
            ctx.request_stop("measured")


def run(
    built: Built,
    warmup: int,
    steps: int,
    *,
    extra_steps: int = 0,
    hooks: Iterable[Hook] = (),
    window: int = 0,
    on_window: Callable[[int, float], None] | None = None,
    on_warm: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train ``warmup`` + ``steps`` (+ ``extra_steps``) optimizer steps; the timed ones' figures."""
    engine = built.engine
    clock = StepClock(engine.device, warmup, steps)
    total = warmup + steps + extra_steps
    measure = _Measure(built, clock, warmup, steps, total, window, on_window, on_warm)
    clock.start()
    t0 = time.perf_counter()
    every, b = [measure, Labelled(built.monitor), *hooks], built
    fit(engine, b.model, b.optimizer, b.loader, max_steps=total, hooks=every, loss_fn=b.loss_fn)
    wall_s = time.perf_counter() - t0
    out = _figures(built, clock.finish(), measure.at_warm, measure.at_end, (warmup, steps, wall_s))
    if engine.device.type == "cuda":
        out["peak_bytes"] = int(torch.cuda.max_memory_allocated(engine.device))
    flops = built.flops_per_sample
    if flops:
        out["tflops"] = flops * out["samples_per_s"] / 1e12
        peak = built.peak_tflops
        if peak:
            out["mfu"] = out["tflops"] / peak
    out["parity_loss"] = parity_loss(built)
    return out


def _figures(
    built: Built,
    figures: dict[str, Any],
    warm: dict[str, Any],
    end: dict[str, Any],
    run: tuple[int, int, float],
) -> dict[str, Any]:
    """The figures from the clock's and the counters; ``run``: (warm-up, timed steps, wall s)."""
    engine, (warmup, steps, wall_s) = built.engine, run
    step_s = figures["step_ms_median"] / 1000
    samples = (end["samples"] - warm["samples"]) / steps
    tokens = (end["tokens"] - warm["tokens"]) / steps
    return {
        "steps": steps,
        "warmup": warmup,
        "step_ms_median": figures["step_ms_median"],
        "step_ms": figures["step_ms"],
        "step_ms_spread": figures["step_ms_spread"],
        "samples_per_step": samples,
        "tokens_per_step": tokens,
        "samples_per_s": samples / step_s,
        "tokens_per_s": tokens / step_s if tokens else None,
        "throughput": (tokens if built.throughput_unit == "tokens/s" else samples) / step_s,
        "throughput_unit": built.throughput_unit,
        "first_step_s": figures["time_to_first_step_s"],
        "data_wait_ms_per_step": 1000 * (end["data_s"] - warm["data_s"]) / steps,
        "recompiles_after_warmup": end["compiled_frames"] - warm["compiled_frames"],
        "graph_breaks": end["graph_breaks"],
        "compiled": engine.options.compile_scope != "off",
        "final_loss": figures["final_loss"],
        "wall_s": wall_s,
        "precision": engine.precision.name,
        "math_precision": precision_key(
            engine.precision.mfu_peak(), tf32=engine.device.type == "cuda" and tf32_enabled()
        ),
        "micro": built.micro,
        "accumulation": engine.accumulation,
    }


def parity_loss(built: Built) -> float | None:
    """Mean loss on the fixed held-out batches, eagerly (a compiled model is not recompiled for
    evaluation); None when there are none."""
    if not built.parity_batches:
        return None
    return built.engine.evaluate(built.model, built.parity_batches, built.loss_fn)  # eager inside


def release(built: Built) -> None:
    """Drop the run's loader workers and memory and close its token files."""
    built.monitor.close()
    for f in built.files:
        f.close()
    built.loader = built.data = None  # type: ignore[assignment]
    gc.collect()
    if built.engine.device.type == "cuda":
        torch.cuda.empty_cache()


def measure_once(
    target: Target,
    changes: Mapping[str, Mapping[str, Any]] | None,
    run_dir: Path,
    warmup: int,
    steps: int,
    memory: bool = False,
    timeline: bool = False,
) -> dict[str, Any]:
    """One measured run in this process (:func:`build`, :func:`run`, :func:`release`). ``timeline``:
    on CUDA the regime's device timeline over :data:`PROBE_STEPS` more steps, and ``peak_tflops``."""
    built = build(target, changes, run_dir)
    try:
        cuda = built.engine.device.type == "cuda"
        peak = measure_memory(built) if memory and not cuda else None
        probe, watch = Timeline(after=warmup + steps), timeline and cuda
        out = run(
            built, warmup, steps, extra_steps=PROBE_STEPS if watch else 0, hooks=[probe] if watch else []
        )
        if peak is not None:
            out["peak_bytes"] = peak
        if timeline:
            out.update(probe.figures(), peak_tflops=built.peak_tflops)
        return out
    finally:
        release(built)
