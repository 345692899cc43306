"""Cost of monitoring: the tiny-MLP CPU workload through fit() with monitoring on vs off.

"on" is what ``turbotrain train`` attaches: the Monitor hook at the default ``log_every`` with its
probes (MFU from FLOPs counted once; memory and NVML would be added on CUDA), the metrics.jsonl sink
and the progress sink (plain lines, as when stderr is not a terminal). "off" is the same fit()
without it.

The tiny MLP is overhead-bound (about 1.5 ms per step), so a per-step cost shows. Everything runs
in ONE long fit() on ONE model: a timing hook cuts it into windows of ``--steps`` steps and
forwards the steps of every other window to the Monitor (order on/off, off/on alternating by round,
so drift hits both). Two separate processes or two separate models differ by more than the effect
(memory layout alone moves this workload by +-5-10% between processes); one model, one set of sinks
opened once (as in a real run), and adjacent windows leave only the monitoring. The first rounds
are warm-up and discarded. Reported: the median window time per variant, the median of the
per-round on/off ratios (paired), and the Monitor's own cost per step timed without training.

    python benchmarks/monitor_overhead.py --out benchmarks/results/cpu/monitor_overhead.json
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console

from turbotrain import Engine, fit
from turbotrain.app.doctor import collect_env
from turbotrain.base.config import MonitorConfig
from turbotrain.loop.hooks import FitContext, Hook
from turbotrain.loop.monitor import JsonlSink, Monitor, ProgressSink, build_probes
from turbotrain.parts.models.mlp import TinyMLP, synthetic_batches

DEFAULT_LOG_EVERY = MonitorConfig().log_every


class Setup:
    """The engine, model, batches and (once-built) monitor both variants share."""

    def __init__(self, log_every: int, workdir: Path) -> None:
        torch.manual_seed(0)
        self.log_every, self.workdir = log_every, workdir
        self.engine = Engine({"run": {"device": "cpu"}, "monitor": {"log_every": log_every}})
        model = TinyMLP()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.model, self.optimizer, _ = self.engine.setup(model, optimizer)
        self.batches = synthetic_batches(32, batch_size=64)
        self.probes = build_probes(
            self.engine.device,
            model=self.model,
            example_batch=self.batches[0],
            precision=self.engine.precision.name,
        )

    def monitor(self, name: str) -> Monitor:
        sinks = [
            JsonlSink(self.workdir / f"{name}.jsonl"),
            ProgressSink(10**9, self.engine.state.step, console=Console(file=io.StringIO())),
        ]
        return Monitor(self.log_every, sinks, self.probes)


class AlternateWindows(Hook):
    """Times windows of ``steps`` optimizer steps inside one fit(); the monitor sees the steps of
    the "on" windows only. Rounds alternate the order (off, on) / (on, off)."""

    def __init__(self, monitor: Monitor, steps: int) -> None:
        self.monitor, self.steps = monitor, steps
        self.times: dict[str, list[float]] = {"off": [], "on": []}
        self.window = 0

    def _label(self) -> str:
        round_, second = divmod(self.window, 2)
        return "on" if (round_ % 2 == 0) == bool(second) else "off"

    def on_fit_start(self, ctx: FitContext) -> None:
        self.monitor.on_fit_start(ctx)
        self.start_step = ctx.engine.state.step
        self.mark = time.perf_counter()

    def on_step_end(self, ctx: FitContext) -> None:
        label = self._label()
        if label == "on":
            self.monitor.on_step_end(ctx)
        if (ctx.engine.state.step - self.start_step) % self.steps == 0:
            now = time.perf_counter()  # CPU: no device queue to synchronize
            self.times[label].append(now - self.mark)
            self.mark = now
            self.window += 1

    def on_fit_end(self, ctx: FitContext) -> None:
        self.records_in_windows = len(self.monitor.records)  # before the final record on_fit_end adds
        self.monitor.on_fit_end(ctx)


def isolated_monitor_us_per_step(setup: Setup, steps: int = 20_000) -> float:
    """The Monitor's own cost per step (amortised over its logging steps), timed without
    training: the engine's step counter is advanced by hand. Immune to load on the machine, but
    blind to what the training step does to the caches."""
    engine = setup.engine
    monitor = setup.monitor("isolated")
    ctx = FitContext(engine, setup.model, setup.optimizer, max_steps=10**9)
    monitor.on_fit_start(ctx)
    state = engine.state
    start = time.perf_counter()
    for _ in range(steps):
        state.step += 1
        state.samples += 64
        monitor.on_step_end(ctx)
    elapsed = time.perf_counter() - start
    monitor.close()
    return 1e6 * elapsed / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per timed window")
    p.add_argument("--rounds", type=int, default=301, help="timed windows per variant")
    p.add_argument("--warmup", type=int, default=10, help="discarded windows per variant")
    p.add_argument(
        "--log-every",
        type=int,
        default=DEFAULT_LOG_EVERY,
        help="monitor.log_every (default: the config default)",
    )
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as the Engine does on CPU, for both variants
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})  # one core, no migrations
    with tempfile.TemporaryDirectory() as tmp:
        setup = Setup(args.log_every, Path(tmp))
        timer = AlternateWindows(setup.monitor("on"), args.steps)
        windows = 2 * (args.warmup + args.rounds)
        loader = setup.engine.setup_loader(itertools.cycle(setup.batches))
        fit(setup.engine, setup.model, setup.optimizer, loader, max_steps=windows * args.steps, hooks=[timer])
        times = {k: v[args.warmup :] for k, v in timer.times.items()}
        records = timer.records_in_windows
        isolated_us = isolated_monitor_us_per_step(setup)
    ms = {k: 1000 * statistics.median(v) / args.steps for k, v in times.items()}
    ratios = [on / off for on, off in zip(times["on"], times["off"])]
    result = {
        "benchmark": "monitor_overhead",
        "workload": "TinyMLP(d_in=256, width=256, depth=3) batch 64, AdamW, fit(), CPU, 1 torch thread",
        "log_every": args.log_every,
        "steps_per_window": args.steps,
        "rounds": args.rounds,
        "records_per_on_window": records / (args.warmup + args.rounds),
        "step_ms_median": ms,
        "overhead_pct_of_medians": 100 * (ms["on"] / ms["off"] - 1),
        "overhead_pct_paired_median": 100 * (statistics.median(ratios) - 1),
        "paired_ratio_min_max": [min(ratios), max(ratios)],
        "overhead_pct_of_fastest_windows": 100 * (min(times["on"]) / min(times["off"]) - 1),
        "monitor_us_per_step_isolated": isolated_us,
        "overhead_pct_isolated": 100 * isolated_us / (1000 * ms["off"]),
        "command": " ".join(["python", *sys.argv]),
        "env": collect_env(),
    }
    print(
        f"tiny MLP, CPU, 1 thread, {args.steps} steps x {args.rounds} interleaved windows, log_every={args.log_every}"
    )
    print(f"  monitoring off: {ms['off']:.4f} ms/step   on: {ms['on']:.4f} ms/step")
    print(
        f"  overhead: {result['overhead_pct_paired_median']:+.2f}% (median of paired ratios), "
        f"{result['overhead_pct_of_medians']:+.2f}% (ratio of medians); "
        f"{result['overhead_pct_of_fastest_windows']:+.2f}% (fastest windows); "
        f"paired range {100 * (min(ratios) - 1):+.1f}% .. {100 * (max(ratios) - 1):+.1f}%"
    )
    print(
        f"  the Monitor alone: {isolated_us:.2f} us/step (amortised, timed without training) = "
        f"{result['overhead_pct_isolated']:.2f}% of an unmonitored step"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
