"""What a periodic ``torch.cuda.empty_cache()`` costs a training step (the README's memory section
says why turbotrain does not call it): a preset's GPT trained in bf16 autocast, eager, with and
without ``empty_cache()`` after every optimizer step, the two interleaved in blocks of steps;
median step ms of each and the ratio, as JSON. CUDA only (one line and exit 0 elsewhere).

    python benchmarks/empty_cache_cost.py --preset gpt2-small --micro 8 --steps 30 --out empty_cache.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from turbotrain.base.config import load_config
from turbotrain.parts.models.registry import build_model
from turbotrain.tools.memory import token_batches
from turbotrain.tools.memory.stats import default_vocab_size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-small")
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant (after 5 warm-up)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("empty_cache_cost: CUDA only (the caching allocator is CUDA's); nothing measured")
        return 0
    device = torch.device("cuda")
    config = load_config(args.preset)
    vocab = default_vocab_size(config)
    model = build_model(config, vocab).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = token_batches(vocab, config.model.block_size, device)(args.micro)

    def step(empty: bool) -> float:
        torch.cuda.synchronize()  # host-device sync point: timing only
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if empty:
            torch.cuda.empty_cache()
        torch.cuda.synchronize()  # host-device sync point: timing only
        return (time.perf_counter() - t0) * 1000

    for _ in range(5):
        step(False)
    times: dict[str, list[float]] = {"plain": [], "empty_cache": []}
    for block in range(args.steps // 5):
        for name in ("plain", "empty_cache") if block % 2 == 0 else ("empty_cache", "plain"):
            times[name] += [step(name == "empty_cache") for _ in range(5)]
    med = {k: statistics.median(v) for k, v in times.items()}
    doc = {
        "preset": args.preset,
        "micro": args.micro,
        "step_ms_median": med,
        "slowdown": med["empty_cache"] / med["plain"],
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
    }
    print(json.dumps(doc))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
