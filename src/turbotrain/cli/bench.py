"""``turbotrain bench``: measure turbotrain against plain PyTorch, Accelerate and Lightning, and
the effect of each precision and optimization, on this machine."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..app.bench.autobatch import find_workload_batch
from ..app.bench.contenders import CONTENDERS, DEFAULT_ORDER
from ..app.bench.inference import SCHEMA as INFERENCE_SCHEMA
from ..app.bench.inference import benchmark_inference, inference_target, render_inference
from ..app.bench.results import ReportWriter, build_document, write_document
from ..app.bench.suite import BenchOptions, run_ablation, run_compare, run_precision_matrix
from ..app.bench.tables import render_report
from ..app.bench.to_loss import ToLossOptions, parse_contender, render_to_loss, run_to_loss
from ..app.bench.workloads import custom_workload, expand, resolve_workload, workload_names
from ..app.measure import merge
from ..app.prepare import default_preset
from ..base.atomic import atomic_write
from ..base.config import comma_list, parse_overrides
from ..base.errors import TurbotrainError
from ..base.process import exit_on_sigterm
from .options import Options, add_command, check_at_least, choice, number, switch

HELP = "benchmark contenders side by side, the precision matrix or the optimization ablation"
DESCRIPTION = (
    "Each row runs in its own process on the same model, data, seed and batch; warm-up and "
    "compilation are excluded from throughput and reported as time to first step."
)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    tables = (_what_options(), RUN_OPTIONS, TO_LOSS_OPTIONS, OUTPUT_OPTIONS)
    return add_command(subparsers, main_bench, HELP, *tables, description=DESCRIPTION, overrides=True)


def _what_options() -> Options:
    """What a bench measures: the workload or model, the reports, their rows."""
    return {
        "--workload": f"one of: {', '.join(workload_names())}; default: gpt2-small on a GPU, gpt-tiny on CPU",
        "--model": "your own model instead of a workload: FUNC() returns turbotrain.Workload(model=..., "
        "train_loader=...) (or a dict); every row calls it again, seeded, and trains it with the bench recipe",
        "--compare": switch("contenders side by side (the default when no --matrix)"),
        "--matrix": {
            "action": "append",
            "choices": ("precision", "ablation"),
            "default": [],
            "help": "precision matrix or optimization ablation (repeatable)",
        },
        "--rows": {
            "default": "",
            "help": "with one --matrix: comma-separated rows to run, beside their reference rows (fp32; each "
            "ablation ladder's base); default: every row",
        },
        "--contenders": {
            "default": ",".join(DEFAULT_ORDER),
            "help": f"comma-separated subset of {', '.join(CONTENDERS)} (CUDA-only ones are left out on CPU)",
        },
    }


def _batch_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--batch = {text!r}: give a whole number of samples or auto"
        ) from None


# How each row runs: device, batch, steps, processes, compilation.
RUN_OPTIONS: Options = {
    "--device": {"choices": ("auto", "cuda", "cpu"), "default": "auto"},
    "--batch": {
        "type": _batch_arg,
        "metavar": "N|auto",
        "help": "global batch in samples (default: the workload's for this device); auto: the largest "
        "that turbotrain's defaults fit, found by the batch finder in its own process and then used "
        "by every row (a row that needs more memory at that size fails with out-of-memory)",
    },
    "--warmup": "untimed warm-up steps, including compilation (default: the workload's)",
    "--steps": "timed steps (default: the workload's)",
    "--seed": {},
    "--auto-planned-steps": number(
        10_000, "the run length the turbotrain-auto row's measured choice decides for (default 10000)"
    ),
    "--repeat": number(
        1, "processes per row, run round-robin; the run with the median step time is reported (default 1)"
    ),
    "--threads": "CPU threads per row process (OMP_NUM_THREADS); 0 = torch's default. On a shared CPU, 1 "
    "keeps timings stable (no thread barriers stalled by other processes)",
    "--timeout-s": number(900.0, "per-row time limit in seconds (default 900)"),
    "--handtuned-compile": choice(
        ("auto", "on", "off"), "torch.compile in the hand-tuned contender (auto: on for CUDA, off for CPU)"
    ),
    "--compile-cache": choice(
        ("cold", "shared"),
        "cold: a fresh torch.compile cache per row, so time to first step is fair (default); "
        "shared: rows reuse each other's compilations (faster; time to first step becomes a lower bound)",
    ),
    "--profile": {
        "metavar": "DIR",
        "help": "compare: profile a few turbotrain steps after its timed window; trace and op table to DIR",
    },
}

TO_LOSS_OPTIONS: Options = {
    "--to-loss": {
        "type": float,
        "metavar": "LOSS",
        "help": "time to a target validation loss: each --versus contender (config settings on --workload's "
        "preset; --section.key=value for all) trains with --seeds seeds, each run in its own process, until "
        "the loss on fixed held-out batches is <= LOSS; the table has wall time and tokens to target with "
        "their seed spread, and a verdict whether the difference exceeds it",
    },
    "--versus": {
        "action": "append",
        "default": [],
        "metavar": "NAME:section.key=value[,...]",
        "help": "--to-loss: a contender (give two or more), e.g. lr2e-3:optim.lr=2e-3",
    },
    "--seeds": number(3, "--to-loss: seeds per contender (default 3)"),
    "--tokens": number(0, "--to-loss: token budget per run (default 0: none)"),
    "--max-steps": number(300, "--to-loss: optimizer steps per run at most (default 300)"),
    "--eval-every": number(10, "--to-loss: steps between validation losses (default 10)"),
}

OUTPUT_OPTIONS: Options = {
    "--inference": switch(
        "evaluation throughput: the forward (and loss) of --workload's preset model (random tokens) or "
        "--model's eval_loader under inference_mode, with the precision and compile of --section.key=value "
        "(--rows fp32,bf16-mixed: one row per precision); --steps timed batches after --warmup"
    ),
    "--out": "write <workload>-<kind>.json and .md here",
    "--work-dir": "keep per-row specs, logs and data here (default: a temporary folder, removed)",
}


def main_bench(args: argparse.Namespace, extra: list[str]) -> int:
    if args.to_loss is not None or args.versus:
        return main_to_loss(args, extra)
    if args.inference:
        return main_inference(args, extra)
    if extra:
        raise TurbotrainError(f"--section.key=value settings ({' '.join(extra)}) apply to --to-loss only")
    device, names = _device_and_names(args)
    kinds = (["compare"] if args.compare or not args.matrix else []) + list(dict.fromkeys(args.matrix))
    contenders, rows = comma_list(args.contenders), comma_list(args.rows)
    if rows and len(set(args.matrix)) != 1:
        raise TurbotrainError(
            "--rows picks rows of one --matrix (precision or ablation) at a time; "
            "--compare takes --contenders"
        )
    command = _command(args)
    exit_on_sigterm()  # so a running row is ended too (see process.run_process)
    outcomes: list[dict[str, Any]] = []  # every row of every report: did any measure?
    same = (
        "seed",
        "timeout_s",
        "handtuned_compile",
        "repeat",
        "compile_cache",
        "threads",
        "auto_planned_steps",
    )
    with _work_dir(args, "bench") as folder:
        profile_dir = Path(args.profile) if args.profile else None
        opts = BenchOptions(
            device, Path(folder), profile_dir=profile_dir, **{k: getattr(args, k) for k in same}
        )
        runners: dict[str, Callable[[Any], dict[str, Any]]] = {
            "compare": lambda w: run_compare(w, opts, contenders),
            "precision": lambda w: run_precision_matrix(w, opts, rows),
            "ablation": lambda w: run_ablation(w, opts, rows),
        }
        for name in names:
            outcomes += _bench_workload(args, name, opts, [runners[kind] for kind in kinds], command)
    return _exit_code(outcomes)


def _work_dir(args: argparse.Namespace, kind: str) -> contextlib.AbstractContextManager[str]:
    """``--work-dir``, kept; else a temporary folder, removed afterwards."""
    if args.work_dir:
        return contextlib.nullcontext(args.work_dir)
    return tempfile.TemporaryDirectory(prefix=f"turbotrain-{kind}-", ignore_cleanup_errors=True)


def _overrides(args: argparse.Namespace, extra: list[str]) -> dict[str, dict[str, str]]:
    """The --section.key=value settings, with --device as run.device."""
    overrides = parse_overrides(extra)
    if args.device != "auto":
        overrides.setdefault("run", {})["device"] = args.device
    return overrides


def _device_and_names(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The device and the workloads (names, or the --model) of a bench, each mistake one line."""
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise TurbotrainError("--device cuda but no CUDA GPU is visible to torch; use --device cpu or auto")
    if args.model and args.workload:
        raise TurbotrainError("give --workload NAME or --model FILE.py:FUNC, not both")
    if args.model and args.batch == "auto":
        raise TurbotrainError(
            "--batch auto searches the built-in workloads only; with --model give --batch N (samples per batch)"
        )
    if args.threads < 0:
        raise TurbotrainError(f"--threads = {args.threads} must be 0 (default) or more")
    check_at_least(args, repeat=1)
    workload_arg = args.workload or ("gpt2-small" if device == "cuda" else "gpt-tiny")
    return device, [args.model] if args.model else expand(workload_arg)


def _bench_workload(
    args: argparse.Namespace,
    name: str,
    opts: BenchOptions,
    runners: list[Callable[[Any], dict[str, Any]]],
    command: str,
) -> list[dict[str, Any]]:
    """Each report of one workload (after its --batch auto search), printed and written; their rows."""
    batch, search = args.batch, None
    if batch == "auto":
        print(f"{name}: searching the batch size (--batch auto) ...", file=sys.stderr, flush=True)
        search = find_workload_batch(name, opts, keep_log=bool(args.work_dir))
        print(f"{name}: {search['summary']}", file=sys.stderr, flush=True)
        batch = search["micro"]
    if args.out:  # the document after every finished row: a bench stopped at a limit keeps its rows
        extra = {"batch_search": search} if search is not None else None
        opts.progress = ReportWriter(Path(args.out), command, list(sys.orig_argv), extra)
    make = custom_workload if args.model else resolve_workload
    w = make(name, opts.device, batch_size=batch, warmup_steps=args.warmup, timed_steps=args.steps)
    rows: list[dict[str, Any]] = []
    for runner in runners:
        try:
            report = runner(w)
        except ValueError as exc:
            raise TurbotrainError(str(exc)) from None
        if search is not None:
            report["batch_search"] = search
        rows += report.get("rows", [])
        doc = build_document(report, command, list(sys.orig_argv))
        print(render_report(doc), flush=True)
        if args.out:
            json_path, md_path = write_document(doc, Path(args.out))
            print(f"wrote {json_path} and {md_path}\n", flush=True)
    return rows


def main_inference(args: argparse.Namespace, extra: list[str]) -> int:
    """``--inference``: evaluation throughput (app/bench/inference.py), one row per --rows precision."""
    overrides = _overrides(args, extra)
    if args.threads:
        torch.set_num_threads(args.threads)  # in this process: the forward runs here
    preset = None if args.model else (args.workload or default_preset())
    batch = args.batch if isinstance(args.batch, int) else None
    model, batches, loss_fn, label = inference_target(preset, args.model, overrides, batch)
    modes: list[str | None] = [*comma_list(args.rows)] or [None]
    configs = [merge(overrides, {"precision": {"mode": m}} if m else None) for m in modes]
    timing: dict[str, Any] = {"loss_fn": loss_fn, "iterations": args.steps or 20, "warmup": args.warmup or 3}
    rows = [{"label": label, **benchmark_inference(model, batches, config=c, **timing)} for c in configs]
    doc = {
        "schema": INFERENCE_SCHEMA,
        "kind": "inference",
        "rows": rows,
        "overrides": overrides,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "load_avg_1m": os.getloadavg()[0],  # a shared CPU's other work slows every row
        "command": _command(args),
    }
    _emit(args.out, f"{Path(label.partition(':')[0]).stem}-inference", doc, render_inference(doc))
    return 0


def _emit(out_dir: str | None, stem: str, doc: dict[str, Any], text: str) -> None:
    """Print ``text``; with ``--out``, write it and ``doc`` as ``<stem>.md`` and ``<stem>.json`` there."""
    print(text, flush=True)
    if not out_dir:
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / f"{stem}.json", json.dumps(doc, indent=1, default=str) + "\n")
    atomic_write(
        out / f"{stem}.md", text + (f"\n\nCommand: `{doc['command']}`\n" if doc.get("command") else "\n")
    )
    print(f"wrote {out / stem}.json and .md", flush=True)


def main_to_loss(args: argparse.Namespace, extra: list[str]) -> int:
    """``--to-loss``: time and tokens to a target loss over seeds (app/bench/to_loss.py)."""
    if args.model:
        raise TurbotrainError(
            "--to-loss runs a preset (--workload NAME); --model workloads are not supported yet"
        )
    try:
        contenders = dict(parse_contender(text) for text in args.versus)
    except ValueError as exc:
        raise TurbotrainError(str(exc)) from None
    if len(contenders) < 2:
        raise TurbotrainError(
            "--to-loss compares contenders: give two or more --versus NAME:section.key=value"
        )
    check_at_least(args, seeds=1, max_steps=1, eval_every=1)
    same = {k: getattr(args, k) for k in ("max_steps", "eval_every", "threads", "timeout_s")}
    with _work_dir(args, "to-loss") as folder:
        opts = ToLossOptions(
            contenders=contenders,
            preset=args.workload or default_preset(),
            overrides=_overrides(args, extra),
            target_loss=args.to_loss,
            max_tokens=args.tokens,
            seeds=tuple(range(args.seed, args.seed + args.seeds)),
            work_dir=Path(folder),
            **same,
        )
        exit_on_sigterm()
        doc = run_to_loss(opts, log=lambda line: print(line, file=sys.stderr, flush=True))
    doc["command"] = _command(args)
    _emit(args.out, f"{opts.preset}-to-loss", doc, render_to_loss(doc))
    return 0 if any(r["reached"] for r in doc["rows"]) or args.to_loss is None else 1


def _exit_code(rows: list[dict[str, Any]]) -> int:
    """0 when a row measured something; 1 (with one line saying why) when every row failed or
    was skipped: a script must not read a table of failures as a benchmark."""
    if not rows or any(r.get("status") == "ok" for r in rows):
        return 0
    reasons = "; ".join(
        f"{r.get('row') or r.get('contender')}: {r.get('status')} ({' '.join(str(r.get('reason', '')).split())[:120]})"
        for r in rows[:4]
    ) + ("; ..." if len(rows) > 4 else "")
    print(
        f"turbotrain bench: every row failed or was skipped, nothing was measured ({reasons})",
        file=sys.stderr,
    )
    return 1


def _command(args: argparse.Namespace) -> str:
    """The command line that ran (or, called in-process, would run) this bench."""
    return "turbotrain " + shlex.join(args.argv)
