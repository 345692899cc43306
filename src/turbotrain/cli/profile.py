"""``turbotrain profile``: a profiled run of a preset or your model, the bottleneck, and ranked
recommendations (``--verify``: each measured against the baseline, only the helpful ones kept)."""

from __future__ import annotations

import argparse
import json

from ..app.profile import ProfileOptions, profile_target, render
from .options import TARGET_OPTIONS, Options, add_command, check_at_least, live_log, number, switch, target_of

HELP = "why training is slow: the step's time split, syncs, the bottleneck and (verified) advice"
DESCRIPTION = (
    "Train a few steps of a preset or your model (--model FILE.py:FUNC) through turbotrain, profile "
    "them with torch.profiler and name the bottleneck with ranked, exact changes. Any config field can be set "
    "with --section.key=value, as for train. Files go to a run folder (trace.json.gz, profile.json, profile.md)."
)
OPTIONS: Options = {
    "--steps": {"default": 5, "help": "profiled steps (default 5)"},
    "--warmup": {"default": 5, "help": "untimed warm-up steps, compilation included (default 5)"},
    "--timed": number(20, "unprofiled timed steps for the throughput figures (default 20)"),
    "--verify": switch(
        "apply each recommended setting in its own short run and keep only those measurably faster than the baseline"
    ),
    "--repeats": number(3, "--verify: interleaved runs per variant (default 3)"),
    "--verify-steps": number(10, "--verify: timed steps per run (default 10, after 3 warm-up)"),
    "--json": "print the report as JSON instead of text",
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    tables = (TARGET_OPTIONS, OPTIONS)
    return add_command(subparsers, main_profile, HELP, *tables, description=DESCRIPTION, overrides=True)


def main_profile(args: argparse.Namespace, extra: list[str]) -> int:
    check_at_least(args, steps=1, warmup=1, timed=2, repeats=1, verify_steps=2)
    target = target_of(args, extra)
    options = ProfileOptions(
        args.warmup, args.timed, args.steps, args.verify, args.repeats, verify_steps=args.verify_steps
    )
    with live_log() as log:
        doc = profile_target(target, options, log=log)
    print(json.dumps(doc, indent=1, default=str) if args.json else render(doc))
    # Ctrl-C: what ran is reported, then 130
    return 130 if (doc.get("verify") or {}).get("interrupted") else 0
