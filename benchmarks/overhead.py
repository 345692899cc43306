"""Per-step framework overhead: turbotrain's Engine against a hand-written loop (tiny MLP, CPU).

The tiny MLP is overhead-bound, so any per-step cost the Engine adds shows. Each variant runs in
its own process, pinned to one thread; rounds alternate hand/engine so drift in machine load hits
both; each process reports the median of several timed windows after a warm-up.

    python benchmarks/overhead.py --rounds 10 --out benchmarks/results/cpu/overhead.json

Two commits of turbotrain, interleaved on the same machine: ``--base-src`` runs the BASE variant
from another checkout's ``src`` folder (e.g. ``mkdir /tmp/base && git archive 1eb9180 src | tar -x
-C /tmp/base``), the TEST variant from this one:

    python benchmarks/overhead.py --pair fit,fit --base-src /tmp/base/src --rounds 10
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

WARMUP_STEPS = 100
WINDOW_STEPS = 300
WINDOWS = 9


def measure(variant: str) -> dict:
    """Median step time (ms) of ``variant`` over timed windows, in this process."""
    import torch

    from turbotrain import Engine
    from turbotrain.parts.models.mlp import TinyMLP, synthetic_batches

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # the Engine sets it on CPU; the hand loop too, so only overhead differs
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})  # one core, no migrations
    torch.manual_seed(0)
    model = TinyMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    batches = synthetic_batches(32, batch_size=64)

    if variant == "hand":

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            loss = model(x, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    elif variant == "engine":
        engine = Engine({"run": {"device": "cpu"}})  # the defaults: no clipping, auto precision (fp32 on CPU)
        model, optimizer, _ = engine.setup(model, optimizer)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            with engine.autocast():
                loss = model(x, y)
            engine.backward(loss)
            engine.step(optimizer)

    else:
        return {"variant": variant, **_measure_fit(variant, model, optimizer, batches)}

    def run(n: int) -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()  # CPU: no device queue to synchronize
        for i in range(n):
            step(*batches[i % len(batches)])
        return time.perf_counter() - start, time.process_time() - cpu

    run(WARMUP_STEPS)
    timed = [run(WINDOW_STEPS) for _ in range(WINDOWS)]
    windows_ms = [1000 * wall / WINDOW_STEPS for wall, _ in timed]
    cpu_ms = [1000 * cpu / WINDOW_STEPS for _, cpu in timed]
    with torch.no_grad():
        loss = float(model(*batches[0]))
    return {
        "variant": variant,
        "step_ms": statistics.median(windows_ms),
        "cpu_step_ms": statistics.median(cpu_ms),
        "windows_ms": windows_ms,
        "loss": loss,
    }


def _measure_fit(variant: str, model, optimizer, batches) -> dict:  # type: ignore[no-untyped-def]
    """Windows of one long fit() call, timed by a hook both variants carry."""
    import io
    import itertools
    import tempfile

    from rich.console import Console

    from turbotrain import Engine, fit
    from turbotrain.base.config import MonitorConfig
    from turbotrain.loop.hooks import Hook
    from turbotrain.loop.monitor import JsonlSink, Monitor, ProgressSink, build_probes

    engine = Engine({"run": {"device": "cpu"}})
    model, optimizer, loader = engine.setup(model, optimizer, itertools.cycle(batches))
    marks: list[tuple[float, float]] = []

    class Clock(Hook):
        def on_step_end(self, ctx) -> None:  # type: ignore[no-untyped-def]
            step = ctx.engine.state.step
            if step >= WARMUP_STEPS and (step - WARMUP_STEPS) % WINDOW_STEPS == 0:
                marks.append((time.perf_counter(), time.process_time()))

    hooks: list[Hook] = []
    tmp = tempfile.TemporaryDirectory()
    if variant == "fit-monitor":
        log_every = MonitorConfig().log_every
        sinks = [
            JsonlSink(Path(tmp.name) / "metrics.jsonl"),
            ProgressSink(10**9, 0, console=Console(file=io.StringIO())),
        ]
        probes = build_probes(
            engine.device, model=model, example_batch=batches[0], precision=engine.precision.name
        )
        hooks.append(Monitor(log_every, sinks, probes))
    elif variant != "fit":
        raise SystemExit(f"unknown variant {variant!r}")
    fit(
        engine,
        model,
        optimizer,
        loader,
        max_steps=WARMUP_STEPS + WINDOWS * WINDOW_STEPS,
        hooks=[*hooks, Clock()],
    )
    tmp.cleanup()
    windows_ms = [1000 * (b[0] - a[0]) / WINDOW_STEPS for a, b in zip(marks, marks[1:])]
    cpu_ms = [1000 * (b[1] - a[1]) / WINDOW_STEPS for a, b in zip(marks, marks[1:])]
    import torch

    with torch.no_grad():
        loss = float(model(*batches[0]))
    return {
        "step_ms": statistics.median(windows_ms),
        "cpu_step_ms": statistics.median(cpu_ms),
        "windows_ms": windows_ms,
        "loss": loss,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10, help="processes per variant, interleaved")
    p.add_argument(
        "--pair", default="hand,engine", help="BASE,TEST variants (hand, engine, fit, fit-monitor)"
    )
    p.add_argument("--out", help="write the result JSON here")
    p.add_argument(
        "--base-src", help="run the BASE variant with this folder first on PYTHONPATH (another commit's src/)"
    )
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant)))
        return
    base_name, test_name = args.pair.split(",")
    src = str(Path(__file__).resolve().parents[1] / "src")
    paths = {"base": args.base_src or src, "test": src}
    runs: dict[str, list[dict]] = {"base": [], "test": []}
    for _ in range(args.rounds):
        for role, variant in (("base", base_name), ("test", test_name)):
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join([paths[role], os.environ.get("PYTHONPATH", "")]),
            }
            out = subprocess.run(
                [sys.executable, __file__, "--variant", variant],
                capture_output=True,
                text=True,
                check=True,
                env=env,
            )
            runs[role].append(json.loads(out.stdout))
    if args.base_src:
        base_name, test_name = f"{base_name}@base", f"{test_name}@head"
    runs = {base_name: runs["base"], test_name: runs["test"]}
    base = statistics.median(r["step_ms"] for r in runs[base_name])
    test = statistics.median(r["step_ms"] for r in runs[test_name])
    # Each round runs both variants back to back; the median of the per-round ratios cancels
    # slow drifts in machine speed that the medians of absolute times still carry.
    paired = statistics.median(t["step_ms"] / b["step_ms"] for b, t in zip(runs[base_name], runs[test_name]))
    # The process's CPU time per step: on a shared machine wall time also counts the time other
    # processes held the core; CPU time counts only this process's own work (the overhead asked).
    base_cpu = statistics.median(r["cpu_step_ms"] for r in runs[base_name])
    test_cpu = statistics.median(r["cpu_step_ms"] for r in runs[test_name])
    paired_cpu = statistics.median(
        t["cpu_step_ms"] / b["cpu_step_ms"] for b, t in zip(runs[base_name], runs[test_name])
    )
    import torch

    from turbotrain.base.version import collect_git

    result = {
        "benchmark": f"per-step overhead of {test_name} over {base_name}",
        "workload": "TinyMLP(d_in=256, width=256, depth=3), batch 64, AdamW foreach, fp32, 1 thread on a pinned core",
        "base": base_name,
        "base_src": args.base_src,
        "test": test_name,
        f"{base_name}_step_ms": base,
        f"{test_name}_step_ms": test,
        "overhead_pct": 100 * (test / base - 1),
        "overhead_pct_paired": 100 * (paired - 1),
        "overhead_us": 1000 * (test - base),
        f"{base_name}_cpu_step_ms": base_cpu,
        f"{test_name}_cpu_step_ms": test_cpu,
        "cpu_overhead_pct": 100 * (test_cpu / base_cpu - 1),
        "cpu_overhead_pct_paired": 100 * (paired_cpu - 1),
        f"loss_{base_name}": runs[base_name][0]["loss"],
        f"loss_{test_name}": runs[test_name][0]["loss"],
        "runs": runs,
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
        },
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git": collect_git(),
    }
    print(
        f"{base_name} {base:.3f} ms/step | {test_name} {test:.3f} ms/step | overhead {result['overhead_pct']:+.2f}% "
        f"(paired rounds {result['overhead_pct_paired']:+.2f}%) ({result['overhead_us']:+.1f} us/step) | "
        f"final loss {result[f'loss_{base_name}']:.5f} vs {result[f'loss_{test_name}']:.5f}"
    )
    print(
        f"process CPU time: {base_name} {base_cpu:.3f} ms/step | {test_name} {test_cpu:.3f} ms/step | "
        f"overhead {result['cpu_overhead_pct']:+.2f}% (paired rounds {result['cpu_overhead_pct_paired']:+.2f}%)"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
