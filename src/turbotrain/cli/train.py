"""``turbotrain train``: train a preset on the built-in corpus or your data.

Exit status: 0 trained (to max_steps, or to stop_after_steps); 2 a mistake to fix, said in one
line; 75 stopped by SIGTERM or SIGINT with everything saved (a checkpoint at the step it stopped,
or nothing trained yet): continue with ``--resume``; 130 a second Ctrl-C interrupted it at once
(the last periodic checkpoint is intact); 1 a bug, with its traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..config import describe, load_config, parse_overrides
from ..errors import ConfigError
from ..report import write_report
from ..rundir import find_run_dir, new_run_dir, resume_config, run_name
from ..runlock import RunLock
from ..training import StoppedBySignal, stopped_by_signal, train
from .report import print_report

EXIT_STOPPED = 75  # sysexits' EX_TEMPFAIL: "try again later", here: continue with --resume


def default_preset() -> str:
    """gpt2-small on a GPU, gpt-tiny (a few minutes) on CPU."""
    return "gpt2-small" if torch.cuda.is_available() else "gpt-tiny"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help="train a model (default: a GPT on the built-in corpus)",
        description="Train a GPT. Any config field can be set with --section.key=value "
        "(see --help-config), e.g. --train.max_steps=300 --precision.mode=bf16-mixed.",
    )
    p.add_argument("--preset", help="preset name (gpt-tiny, gpt2-small, gpt2-medium) or a .toml path; "
                   "default: gpt2-small on a GPU, gpt-tiny on CPU")
    p.add_argument("--data", help="a .bin token file, a text file or a folder (default: built-in corpus)")
    p.add_argument("--resume", nargs="?", const="", default=None, metavar="RUN",
                   help="continue a run from its latest checkpoint: a run name or directory "
                   "(default: --run.name, else the latest run)")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    p.add_argument("--help-config", action="store_true", help="list every config field with its default and meaning")
    p.epilog = (f"exit status: 0 trained; 2 a mistake to fix (one line says what); {EXIT_STOPPED} stopped by SIGTERM/SIGINT "
                "with everything saved, continue with --resume; 130 interrupted by a second Ctrl-C")
    p.set_defaults(command=main_train, accepts_overrides=True)
    return p


def main_train(args: argparse.Namespace, extra: list[str]) -> int:
    if args.help_config:
        print(describe())
        return 0
    overrides = parse_overrides(extra)
    if args.data is not None:
        overrides.setdefault("data", {})["path"] = args.data
    if args.no_progress:
        overrides.setdefault("monitor", {})["progress"] = "false"
    if args.resume is not None:
        if args.resume and "name" in overrides.get("run", {}):
            raise ConfigError("name the run to resume once: --resume RUN or --resume --run.name NAME, not both")
        base = load_config(args.preset or default_preset(), overrides)
        run_dir = find_run_dir(base.run.out_dir, args.resume or overrides.get("run", {}).get("name", ""))
        config = resume_config(run_dir, overrides)
        print(f"resuming {run_dir}")
    else:
        config = load_config(args.preset or default_preset(), overrides)
        config = config.replace(run={"name": run_name(config)})  # an automatic name, fixed once
        run_dir = new_run_dir(config)
    # The run's lock for the whole command (train() takes it too): no other process trains in
    # the run while this one trains it or writes its report.
    with RunLock(run_dir):
        try:
            summary = train(config, resume_dir=run_dir if args.resume is not None else None)
        except StoppedBySignal as exc:
            print(f"turbotrain train: {exc}", file=sys.stderr)
            return EXIT_STOPPED
        _print_summary(summary, run_dir)
        print_report(write_report(run_dir))  # plots + summary.md, as `turbotrain report RUN` would
    if stopped_by_signal(summary):
        print(f"turbotrain train: {summary['stop_reason']} stopped the run at step {summary['steps']}, checkpoint saved; "
              f"continue with `turbotrain train --resume {run_dir}`", file=sys.stderr)
        return EXIT_STOPPED
    return 0


def _print_summary(summary: dict, run_dir: Path) -> None:
    r = summary["resolved"]
    rate = summary.get("tokens_per_s_median")
    lines = [
        f"run {run_dir}: {summary['status']} at step {summary['steps']}/{summary['max_steps']}"
        + (f" ({summary['stop_reason']})" if summary.get("stop_reason") else ""),
        f"  {r['device']} | {r['precision']} | compile {r['compile']} | {r['optimizer']} | {r['params']:,} params",
    ]
    if summary.get("final_val_loss") is not None:
        train_loss = summary.get("final_train_loss")
        lines.append(f"  val loss {summary['final_val_loss']:.4f} at step {summary['final_val_step']}"
                     + (f" | train loss {train_loss:.4f}" if train_loss is not None else ""))
    if rate:
        first = summary.get("first_step_s")  # None when this invocation trained no step (a finished run resumed)
        lines.append(f"  {rate:,.0f} tokens/s (median)" + (f" | first step {first:.2f} s" if first is not None else "")
                     + f" | {summary['elapsed_s']:.1f} s total")
    for e in summary.get("events", []):
        lines.append(f"  event at step {e['step']}: {e['kind']}: {e['detail']}")
    print("\n".join(lines))
