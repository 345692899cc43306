"""Per-step cost of DDP and FSDP2 against one process (tiny GPT, CPU, gloo, 1 thread per process).

Contenders, each in its own process(es), rounds interleaved so drift in machine load hits all:

- ``single-micro``: one process with the per-rank micro-batch (the work each rank does);
- ``ddp`` and ``fsdp``: 2 processes under torchrun, each with that micro-batch (twice the global batch);
- ``single-global``: one process with the global batch of the 2-process runs (the same math).

The overhead of a strategy is its median step time over ``single-micro``'s: the same work per
process, plus the wrapping and the communication (gradient all-reduce; FSDP2's all-gathers and
reduce-scatters). Against ``single-global`` the ratio is the speed-up of data parallelism on this
machine. Warm-up steps are excluded; each process reports the median of several timed windows
(rank 0's, after a barrier, so both ranks start a window together).

    python benchmarks/distributed_overhead.py --rounds 3 --out benchmarks/results/cpu/distributed_overhead.json
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

WARMUP_STEPS = 10
WINDOW_STEPS = 10
WINDOWS = 5
MICRO = 8  # per process
# the DESIGN's CPU tiny GPT
MODEL = {
    "vocab_size": 256,
    "n_layer": 4,
    "n_head": 4,
    "d_model": 128,
    "block_size": 64,
}


def measure(variant: str) -> dict:
    """Median step time (ms) of ``variant`` in this process (rank 0's answer under torchrun)."""
    import torch
    import torch.distributed as dist

    from turbotrain import Engine
    from turbotrain.parts.models.gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[local_rank % len(cores)]})  # one core each, no migrations
    strategy = {"ddp": "ddp", "fsdp": "fsdp"}.get(variant, "single")
    micro = 2 * MICRO if variant == "single-global" else MICRO
    engine = Engine(
        {"run": {"device": "cpu"}, "distributed": {"strategy": strategy}, "precision": {"mode": "fp32"}}
    )
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    model, optimizer, _ = engine.setup(model, optimizer)
    rank = engine.strategy.rank

    def rows(r: int) -> list[torch.Tensor]:  # rank r's micro-batches
        g = torch.Generator().manual_seed(1 + r)
        return [
            torch.randint(MODEL["vocab_size"], (MICRO, MODEL["block_size"] + 1), generator=g)
            for _ in range(8)
        ]

    # single-global trains on both ranks' rows at once: its final loss is the 2-process runs' (parity check)
    batches = (
        [torch.cat(pair) for pair in zip(rows(0), rows(1))] if variant == "single-global" else rows(rank)
    )

    def run(n: int) -> float:
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()  # CPU and gloo: the step has finished when the call returns
        for i in range(n):
            x = batches[i % len(batches)]
            with engine.autocast():
                loss = model(x[:, :-1], x[:, 1:])
            engine.backward(loss)
            engine.step(optimizer)
        return time.perf_counter() - start

    run(WARMUP_STEPS)
    windows_ms = [1000 * run(WINDOW_STEPS) / WINDOW_STEPS for _ in range(WINDOWS)]
    loss = float(engine.last_loss)
    if dist.is_initialized():
        dist.destroy_process_group()
    return {
        "variant": variant,
        "rank": rank,
        "step_ms": statistics.median(windows_ms),
        "windows_ms": windows_ms,
        "loss": loss,
        "micro": micro,
    }


def _launch(variant: str, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    me = [__file__, "--variant", variant, "--result", str(out)]
    if variant in ("ddp", "fsdp"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *me]
    else:
        cmd = [sys.executable, *me]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="processes per contender, interleaved")
    p.add_argument("--out", help="write the result JSON here")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        result = measure(args.variant)
        if result["rank"] == 0:
            Path(args.result).write_text(json.dumps(result))
        return
    import tempfile

    import torch

    from turbotrain.base.version import collect_git

    contenders = ("single-micro", "ddp", "fsdp", "single-global")
    runs: dict[str, list[dict]] = {c: [] for c in contenders}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for c in contenders:
                runs[c].append(_launch(c, Path(tmp) / f"{c}-{i}.json"))
    med = {c: statistics.median(r["step_ms"] for r in runs[c]) for c in contenders}
    base, glob = med["single-micro"], med["single-global"]
    tokens = MICRO * MODEL["block_size"]
    result = {
        "benchmark": "per-step overhead of DDP and FSDP2 (2 gloo processes) against one process",
        "workload": f"GPT {MODEL}, fp32, AdamW foreach, micro-batch {MICRO} per process, 1 thread per process on its own core",
        "step_ms": med,
        "overhead_ms": {s: med[s] - base for s in ("ddp", "fsdp")},
        "overhead_pct": {s: 100 * (med[s] / base - 1) for s in ("ddp", "fsdp")},
        "speedup_vs_one_process_same_global_batch": {s: glob / med[s] for s in ("ddp", "fsdp")},
        "tokens_per_s": {
            "single-micro": tokens / base * 1000,
            "single-global": 2 * tokens / glob * 1000,
            **{s: 2 * tokens / med[s] * 1000 for s in ("ddp", "fsdp")},
        },
        "final_loss": {c: runs[c][0]["loss"] for c in contenders},
        "runs": runs,
        "env": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "backend": "gloo",
        },
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "git": collect_git(),
        "protocol": f"{WARMUP_STEPS} warm-up steps excluded, median of {WINDOWS} windows of {WINDOW_STEPS} steps per process, "
        f"median over {args.rounds} interleaved rounds",
    }
    for s in ("ddp", "fsdp"):
        print(
            f"{s}: {med[s]:.2f} ms/step vs one process with the same micro-batch {base:.2f} ms "
            f"(+{result['overhead_ms'][s]:.2f} ms, {result['overhead_pct'][s]:+.1f}%); "
            f"x{result['speedup_vs_one_process_same_global_batch'][s]:.2f} vs one process with the global batch ({glob:.2f} ms)"
        )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
