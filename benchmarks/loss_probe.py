"""The language-model loss three ways at one shape: ``full`` (logits, then cross-entropy),
``chunked`` (turbotrain's) and ``fused`` (torch's linear_cross_entropy, where the installed torch
has it): forward + backward ms (median) and the allocator's peak over the inputs, in bf16 autocast.

    python benchmarks/loss_probe.py --tokens 16384 --d 768 --vocab 50304 --out loss.json   # W1's head on a GPU
    python benchmarks/loss_probe.py --tokens 2048 --d 128 --vocab 256 --out loss.json     # CPU: tensor bytes counted

On CPU the peak is counted by the dispatch-level tracker (tools/memory/stats.TensorMemoryTracker).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from turbotrain.parts.models.loss import (
    FUSED_AVAILABLE,
    FUSED_MISSING,
    chunked_cross_entropy,
    fused_cross_entropy,
)
from turbotrain.tools.memory.stats import TensorMemoryTracker


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16 * 1024)
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    h = torch.randn(args.tokens, args.d, device=device, requires_grad=True)
    w = (torch.randn(args.vocab, args.d, device=device) * 0.02).requires_grad_()
    t = torch.randint(args.vocab, (args.tokens,), device=device)
    ways = {
        "full": lambda: F.cross_entropy((h @ w.t()).float(), t),
        "chunked": lambda: chunked_cross_entropy(h, w, t),
    }
    if FUSED_AVAILABLE:
        ways["fused"] = lambda: fused_cross_entropy(h, w, t)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = {}
    for name, fn in ways.items():

        def step() -> float:
            h.grad = w.grad = None
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = fn()
            loss.backward()
            return float(loss)  # host read: once per timed call, outside the comparison's kernels

        step()
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss = step()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            with TensorMemoryTracker() as tracker:
                tracker.add([h, w, t])
                base = tracker.current
                loss = step()
            peak = tracker.peak - base
        times = []
        for _ in range(args.repeats):
            sync()  # host-device sync point: timing only
            t0 = time.perf_counter()
            step()
            sync()  # host-device sync point: timing only
            times.append((time.perf_counter() - t0) * 1000)
        rows[name] = {"ms": statistics.median(times), "peak_mib": peak / 2**20, "loss": loss}
        print(f"{name}: {rows[name]['ms']:.2f} ms, peak {rows[name]['peak_mib']:.0f} MiB, loss {loss:.4f}")
    if not FUSED_AVAILABLE:
        print(FUSED_MISSING)
    doc = {
        "shape": vars(args) | {"out": str(args.out)},
        "rows": rows,
        "fused_available": FUSED_AVAILABLE,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
