"""Per-step framework overhead: turbotrain's Engine against a hand-written loop (tiny MLP, CPU).

The tiny MLP is overhead-bound, so any per-step cost the Engine adds shows. Each variant runs in
its own process, pinned to one thread; rounds alternate hand/engine so drift in machine load hits
both; each process reports the median of several timed windows after a warm-up.

    python benchmarks/overhead.py --rounds 10 --out benchmarks/results/cpu/overhead.json
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
    from turbotrain.models.mlp import TinyMLP, synthetic_batches

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

    else:
        engine = Engine({"run": {"device": "cpu"}, "optim": {"grad_clip": 0.0}})
        model, optimizer, _ = engine.setup(model, optimizer)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            with engine.autocast():
                loss = model(x, y)
            engine.backward(loss)
            engine.step(optimizer)

    def run(n: int) -> float:
        start = time.perf_counter()  # CPU: no device queue to synchronize
        for i in range(n):
            step(*batches[i % len(batches)])
        return time.perf_counter() - start

    run(WARMUP_STEPS)
    windows_ms = [1000 * run(WINDOW_STEPS) / WINDOW_STEPS for _ in range(WINDOWS)]
    with torch.no_grad():
        loss = float(model(*batches[0]))
    return {"variant": variant, "step_ms": statistics.median(windows_ms), "windows_ms": windows_ms, "loss": loss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10, help="processes per variant, interleaved")
    p.add_argument("--out", help="write the result JSON here")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant)))
        return
    runs: dict[str, list[dict]] = {"hand": [], "engine": []}
    for _ in range(args.rounds):
        for variant in runs:
            out = subprocess.run([sys.executable, __file__, "--variant", variant], capture_output=True, text=True, check=True)
            runs[variant].append(json.loads(out.stdout))
    hand = statistics.median(r["step_ms"] for r in runs["hand"])
    engine = statistics.median(r["step_ms"] for r in runs["engine"])
    # Each round runs both variants back to back; the median of the per-round ratios cancels
    # slow drifts in machine speed that the medians of absolute times still carry.
    paired = statistics.median(e["step_ms"] / h["step_ms"] for h, e in zip(runs["hand"], runs["engine"]))
    import torch

    result = {
        "benchmark": "engine per-step overhead vs hand-written loop",
        "workload": "TinyMLP(d_in=256, width=256, depth=3), batch 64, AdamW foreach, fp32, 1 thread",
        "hand_step_ms": hand,
        "engine_step_ms": engine,
        "overhead_pct": 100 * (engine / hand - 1),
        "overhead_pct_paired": 100 * (paired - 1),
        "overhead_us": 1000 * (engine - hand),
        "loss_hand": runs["hand"][0]["loss"],
        "loss_engine": runs["engine"][0]["loss"],
        "runs": runs,
        "env": {"python": platform.python_version(), "torch": torch.__version__, "cpu": platform.processor() or platform.machine()},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    print(f"hand-written {hand:.3f} ms/step | Engine {engine:.3f} ms/step | overhead {result['overhead_pct']:+.2f}% "
          f"(paired rounds {result['overhead_pct_paired']:+.2f}%) "
          f"({result['overhead_us']:+.1f} us/step) | final loss {result['loss_hand']:.5f} vs {result['loss_engine']:.5f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
