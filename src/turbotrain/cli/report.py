"""``turbotrain report RUN``: plots and a performance summary from a run directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..app.report import ReportResult, write_report
from ..base.rundir import PLOTS_DIR, SUMMARY_FILE, SUMMARY_MD, find_run_dir
from .options import Options, add_command

HELP = "write PNG plots, summary.md and summary.json for a run"
DESCRIPTION = (
    "Reads metrics.jsonl, config.toml and summary.json in a run directory and writes plots/*.png (loss, "
    "learning rate, throughput, MFU, memory, GPU utilisation), summary.md and summary.json."
)
OPTIONS: Options = {
    "run_dir": "run directory, or a run name under --out-dir (default: the latest run)",
    "--out-dir": {},
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(subparsers, main_report, HELP, OPTIONS, description=DESCRIPTION)


def main_report(args: argparse.Namespace, extra: list[str]) -> int:
    if not args.run_dir:
        path = find_run_dir(args.out_dir)  # the latest run
    elif not Path(args.run_dir).is_dir() and (Path(args.out_dir) / args.run_dir).is_dir():
        path = Path(args.out_dir) / args.run_dir  # a run name
    else:
        path = Path(args.run_dir)  # write_report says so if it does not exist
    print_report(write_report(path))
    return 0


def print_report(result: ReportResult) -> None:
    """What was written and what was not, one line each."""
    plots = ", ".join(Path(p).name for p in result.plots) or "none"
    print(
        f"report {result.run_dir}: {SUMMARY_MD}, {SUMMARY_FILE}; plots in {result.run_dir / PLOTS_DIR}: {plots}"
    )
    for line in result.problems + result.skipped:
        print(f"  note: {line}")
