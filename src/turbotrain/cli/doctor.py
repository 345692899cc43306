"""``turbotrain doctor``: environment report, checks with fixes, optional speed probes."""

from __future__ import annotations

import argparse
import json

import torch

from ..app.choose.session import doctor_regime
from ..app.doctor import build_report, format_report
from ..app.precision_check import check_precisions, format_check, load_target
from ..app.profile.syncs import format_syncs, locate_workload_syncs
from .options import Options, add_command, switch

HELP = "report the environment and check the setup (paste the output into bug reports)"
DESCRIPTION = (
    "Versions, devices and checks with fixes. Exit code 0 even when checks warn; "
    "--probe adds short matmul and copy measurements beside the datasheet figures."
)
OPTIONS: Options = {
    "--json": "print one JSON object instead of text",
    "--probe": switch("measure matmul TFLOP/s and copy GB/s (a few seconds)"),
    "--model": "also check your model in each precision: one forward/backward per precision on one "
    "batch of its train_loader, NaN/inf and the loss against fp32, and whether the precision auto "
    "picks is sound (exit code 1 when it is not)",
    "--preset": "the same check for a preset's model (on random tokens)",
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(subparsers, main_doctor, HELP, OPTIONS, description=DESCRIPTION)


def main_doctor(args: argparse.Namespace, extra: list[str]) -> int:
    # a bad --model: one line, first
    target = load_target(args.model, args.preset) if args.model or args.preset else None
    report = build_report(probe=args.probe)
    text = format_report(report)
    if target is not None:
        report["precision_check"] = check_precisions(target)
        text += "\n\n" + format_check(report["precision_check"])
        report["regime"] = doctor_regime(args.preset, args.model)  # app/regime.py: one probe on CUDA
        text += "\n\n### Regime\n- [INFO] " + report["regime"]["line"]  # a check line, as the report's others
        report["syncs"] = locate_workload_syncs(target, "cuda" if torch.cuda.is_available() else "cpu")
        text += "\n\n## host-device syncs in a training step (eager, fp32)\n" + "\n".join(
            format_syncs(report["syncs"])
        )
    print(json.dumps(report, indent=2, default=str) if args.json else text)
    return 1 if target is not None and not report["precision_check"]["verdict"]["sound"] else 0
