"""``turbotrain doctor``: environment report, checks with fixes, optional speed probes."""

from __future__ import annotations

import argparse
import json

from ..doctor import build_report, format_report


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "doctor",
        help="report the environment and check the setup (paste the output into bug reports)",
        description="Versions, devices and checks with fixes. Exit code 0 even when checks warn; "
        "--probe adds short matmul and copy measurements beside the datasheet figures.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--probe", action="store_true", help="measure matmul TFLOP/s and copy GB/s (a few seconds)")
    p.set_defaults(command=main_doctor)
    return p


def main_doctor(args: argparse.Namespace, extra: list[str]) -> int:
    report = build_report(probe=args.probe)
    print(json.dumps(report, indent=2, default=str) if args.json else format_report(report))
    return 0
