"""Training stall per checkpoint: steps that write a checkpoint against steps that do not, with the
checkpoint written synchronously (``train.async_checkpoint = false``, the behaviour before issue 25
item 5) and in the background (``true``: the step copies the state to host memory, a thread writes it).

Contenders, each in its own process (rounds alternate the order, so drift in machine load hits all):

- ``none``: ``fit()`` with no checkpoint (the baseline for the background write's cost);
- ``sync``: the Checkpointer every ``--every`` steps, ``async_write=False``;
- ``async``: the same, ``async_write=True``;
- ``remote``: ``async`` with the checkpoints mirrored to ``--remote`` (``run.remote``: a
  :class:`~turbotrain.loop.checkpoint.remote.RemoteMirror` uploading in its own thread; ``moto``:
  a moto S3 server started here on localhost, the bucket made with boto3).

Same preset model (``gpt-tiny`` on CPU, ``gpt2-small`` with ``--model gpt2-small``), seed, synthetic
token batches and AdamW in every process; the Engine's defaults for the device (CPU: fp32; CUDA:
auto precision), compile off. A timing hook after the Checkpointer reads the host clock at every
step's end (on CUDA after a synchronize: the benchmark's own sync point, not the library's), so a
step's time includes its hooks, the checkpoint's included. The first ``--warmup`` steps (the first
checkpoint among them: it allocates the host buffers the next ones reuse) are excluded and the
first checkpoint step is reported on its own. The final checkpoint ``fit()`` writes at its end is not
timed. Figures (medians over each contender's processes of per-process medians):

- ``step_ms``: a step that does not checkpoint;
- ``checkpoint_step_ms``: a step that does; ``stall_ms`` = checkpoint step - plain step (how long
  training stops for a checkpoint);
- ``cost_per_checkpoint_ms``: (the timed steps' total time - as many of the same process's median
  plain steps) / checkpoints: the stall plus what the background write takes from the steps it
  overlaps (CPU cores, the GIL, memory bandwidth), so nothing is hidden by moving it off the step.
  Within one process, as the stall: ``none``'s step (another process) is a reference only, as
  processes on a loaded machine differ by more than a checkpoint costs.

    python benchmarks/checkpoint_stall.py --out benchmarks/results/cpu/checkpoint_stall.json
    python benchmarks/checkpoint_stall.py --contenders async,remote --remote moto --rounds 3
    python benchmarks/checkpoint_stall.py --model gpt2-small --every 50 --steps 200 --warmup 60 --rounds 1 \\
        --out benchmarks/results/<gpu>/checkpoint_stall.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONTENDERS = ("none", "sync", "async", "remote")
# gpt-tiny is byte-level; gpt2-small padded to a multiple of 64
VOCAB = {
    "gpt-tiny": 256,
    "gpt2-small": 50304,
}


def measure(args: argparse.Namespace) -> dict:
    """Every step's time (ms) of contender ``args.variant`` in this process."""
    import torch

    from turbotrain import Engine, fit, load_config
    from turbotrain.loop.checkpoint import Checkpointer, RunState, checkpoint_path, rng_state, set_rng_state
    from turbotrain.loop.hooks import FitContext, Hook
    from turbotrain.parts.models.registry import build_model

    if args.threads:
        torch.set_num_threads(args.threads)
    c = load_config(args.model, {"compile": {"scope": "off"}, "run": {"device": args.device}})
    engine = Engine(c)
    torch.manual_seed(0)
    model = build_model(c, VOCAB[args.model])
    cuda = engine.device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda or None)
    model, optimizer, _ = engine.setup(model, optimizer)
    micro, block = args.micro or c.batch.micro, c.model.block_size
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(VOCAB[args.model], (micro, block + 1), generator=g) for _ in range(4)]
    total = args.warmup + args.steps

    def batches():
        for i in range(total):
            x = rows[i % len(rows)]
            yield x[:, :-1], x[:, 1:]

    class Clock(Hook):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_fit_start(self, ctx: FitContext) -> None:
            self.ends.append(time.perf_counter())

        def on_step_end(self, ctx: FitContext) -> None:
            if cuda:
                torch.cuda.synchronize()  # the benchmark's sync point: the step's device work is in its time
            self.ends.append(time.perf_counter())

    clock = Clock()
    hooks: list[Hook] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        state = RunState(engine=engine, model=model, optimizer=optimizer, rng=(rng_state, set_rng_state))
        state.strategy = engine.strategy
        ckpts, mirror = Path(folder) / "checkpoints", None
        if args.variant != "none":
            hooks.append(Checkpointer(ckpts, args.every, 2, state, async_write=args.variant != "sync"))
        if args.variant == "remote":
            from turbotrain.base.storage import Store
            from turbotrain.loop.checkpoint.remote import MirrorHook, RemoteMirror

            store = Store(f"{args.remote}/{Path(folder).name}")
            store.probe()
            mirror = RemoteMirror(store, Path(folder), 2)
            hooks.append(MirrorHook(mirror))
        fit(engine, model, optimizer, batches(), max_steps=total, hooks=[*hooks, clock])
        missing = mirror.close() if mirror is not None else []
        size = checkpoint_path(ckpts, total).stat().st_size if hooks else 0
    step_ms = [1000 * (b - a) for a, b in zip(clock.ends, clock.ends[1:])]  # step_ms[i] is step i + 1
    return {
        "variant": args.variant,
        "step_ms": step_ms,
        "not_uploaded": missing,
        "checkpoint_mb": size / 2**20,
        "loss": float(engine.last_loss),
        "device": str(engine.device),
        "precision": engine.precision.name,
        "micro": micro,
        "block": block,
    }


def summarize(run: dict, args: argparse.Namespace) -> dict:
    """One process's figures: medians of plain and checkpoint steps after the warm-up."""
    timed = [(i + 1, ms) for i, ms in enumerate(run["step_ms"]) if i + 1 > args.warmup]
    saving = run["variant"] != "none"
    saves = [ms for s, ms in timed if saving and s % args.every == 0]
    plain = [ms for s, ms in timed if not (saving and s % args.every == 0)]
    out = {
        "step_ms": statistics.median(plain),
        "checkpoints": len(saves),
        "total_ms": sum(ms for _, ms in timed),
        "steps": len(timed),
    }
    if saves:
        out["checkpoint_step_ms"] = statistics.median(saves)
        out["stall_ms"] = out["checkpoint_step_ms"] - out["step_ms"]
        first = [ms for i, ms in enumerate(run["step_ms"]) if (i + 1) % args.every == 0]
        out["first_checkpoint_step_ms"] = first[0] if first else None
        out["cost_per_checkpoint_ms"] = (out["total_ms"] - out["step_ms"] * len(timed)) / len(saves)
    return out


def _launch(variant: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--variant",
        variant,
        "--result",
        str(out),
        "--model",
        args.model,
        "--device",
        args.device,
        "--every",
        str(args.every),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--micro",
        str(args.micro),
        "--threads",
        str(args.threads),
    ]
    if args.dir:
        cmd += ["--dir", args.dir]
    if args.remote:
        cmd += ["--remote", args.remote]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def _moto(args: argparse.Namespace) -> subprocess.Popen:
    """A moto S3 server on a free localhost port, its bucket made; ``args.remote`` and the AWS
    variables (inherited by the contenders) point at it."""
    import socket

    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        ["moto_server", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
    )
    for _ in range(100):
        try:
            boto3.client("s3").create_bucket(Bucket="turbotrain-bench")
            break
        except Exception:  # noqa: BLE001 - not listening yet
            time.sleep(0.2)
    args.remote = "s3://turbotrain-bench/stall"
    return server


def _markdown(result: dict) -> str:
    med = result["median"]
    lines = [
        f"# Checkpoint stall: {result['workload']}",
        "",
        f"{result['protocol']}",
        "",
        "| checkpoint write | step ms (no checkpoint) | checkpoint step ms | stall per checkpoint ms | "
        "cost per checkpoint ms (stall + slower overlapped steps) | first checkpoint step ms |",
        "|---|---|---|---|---|---|",
    ]
    for v, m in med.items():

        def f(key: str) -> str:
            return f"{m[key]:.1f}" if m.get(key) is not None else "-"

        lines.append(
            f"| {v} | {f('step_ms')} | {f('checkpoint_step_ms')} | {f('stall_ms')} | "
            f"{f('cost_per_checkpoint_ms')} | {f('first_checkpoint_step_ms')} |"
        )
    load = result.get("load_avg_1m_5m_15m") or {}
    said = (
        f" Load average (1, 5, 15 min) at the start {load['start']}, at the end {load['end']}: other jobs shared "
        "the CPU."
        if load
        else ""
    )
    lines += [
        "",
        f"Checkpoint size: {result['checkpoint_mb']:.1f} MiB. Command: `{result['command']}`.{said}",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-tiny", choices=sorted(VOCAB), help="preset whose model trains")
    p.add_argument("--device", default="auto", help="run.device (auto: cuda when available)")
    p.add_argument("--every", type=int, default=5, help="steps between checkpoints")
    p.add_argument("--steps", type=int, default=60, help="timed steps per process")
    p.add_argument(
        "--warmup", type=int, default=12, help="steps before the timed ones (the first checkpoint among them)"
    )
    p.add_argument("--micro", type=int, default=0, help="micro-batch (0: the preset's)")
    p.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads per process (0: torch's default)"
    )
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="which of none,sync,async to run")
    p.add_argument("--rounds", type=int, default=3, help="processes per contender, interleaved")
    p.add_argument("--dir", default=None, help="where the checkpoints are written (default: the temp folder)")
    p.add_argument(
        "--remote", default="", help="the remote contender's store URI ('moto': a local moto server)"
    )
    p.add_argument("--out", help="write the result JSON here (and a .md beside it)")
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        Path(args.result).write_text(json.dumps(measure(args)))
        return
    contenders = tuple(v for v in CONTENDERS if v in args.contenders.split(","))
    server = _moto(args) if args.remote == "moto" else None
    load_start = [
        round(x, 1) for x in os.getloadavg()
    ]  # a shared CPU's other work slows every process: said with the figures
    runs: dict[str, list[dict]] = {v: [] for v in contenders}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.rounds):
                for v in contenders if i % 2 == 0 else contenders[::-1]:
                    runs[v].append(_launch(v, args, Path(tmp) / f"{v}-{i}.json"))
                    print(f"round {i + 1}/{args.rounds} {v}: done", file=sys.stderr)
    finally:  # a contender that fails (SystemExit) leaves no moto server behind
        if server is not None:
            server.kill()
    per_run = {v: [summarize(r, args) for r in runs[v]] for v in contenders}
    median = {
        v: {
            k: statistics.median(s[k] for s in per_run[v])
            for k in per_run[v][0]
            if all(s.get(k) is not None for s in per_run[v])
        }
        for v in contenders
    }
    first = runs[contenders[0]][0]
    from turbotrain.app.doctor import collect_env

    result = {
        "benchmark": "checkpoint_stall",
        "workload": f"{args.model} (micro {first['micro']} x {first['block']} tokens), {first['device']}, "
        f"{first['precision']}, compile off, {args.threads or 'default'} CPU thread(s), AdamW, a checkpoint every {args.every} steps (keep 2)",
        "protocol": f"each contender in its own process, {args.rounds} round(s) alternating the order; {args.warmup} "
        f"warm-up steps excluded; {args.steps} timed steps per process; medians of per-process medians",
        "checkpoint_mb": first["checkpoint_mb"],
        "median": median,
        "stall_reduction_ms": (
            median["sync"]["stall_ms"] - median["async"]["stall_ms"]
            if {"sync", "async"} <= set(median)
            else None
        ),
        "not_uploaded": {v: [r.get("not_uploaded", []) for r in runs[v]] for v in contenders},
        "per_run": per_run,
        "step_ms_per_run": {v: [r["step_ms"] for r in runs[v]] for v in contenders},
        "final_loss": {v: [r["loss"] for r in runs[v]] for v in contenders},
        "command": " ".join(["python", "benchmarks/checkpoint_stall.py", *sys.argv[1:]]),
        "load_avg_1m_5m_15m": {"start": load_start, "end": [round(x, 1) for x in os.getloadavg()]},
        "env": collect_env(),
    }
    for v in contenders:
        m = median[v]
        if "stall_ms" not in m:
            continue
        print(
            f"{v}: step {m['step_ms']:.1f} ms, checkpoint step {m['checkpoint_step_ms']:.1f} ms, stall "
            f"{m['stall_ms']:.1f} ms, cost per checkpoint {m.get('cost_per_checkpoint_ms', float('nan')):.1f} ms"
        )
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=str) + "\n")
        out.with_suffix(".md").write_text(_markdown(result))


if __name__ == "__main__":
    main()
