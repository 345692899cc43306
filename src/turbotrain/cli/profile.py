"""``turbotrain profile``: a profiled run of a preset or your model, the bottleneck, and ranked
recommendations (``--verify``: each measured against the baseline, only the helpful ones kept)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator

from ..app.measure import Target
from ..app.prepare import default_preset
from ..app.profile import ProfileOptions, profile_target, render
from ..base.config import parse_overrides
from ..base.errors import ConfigError
from .options import Options, add_command, switch

HELP = "why training is slow: the step's time split, syncs, the bottleneck and (verified) advice"
DESCRIPTION = (
    "Train a few steps of a preset or your model (--model FILE.py:FUNC) through turbotrain, profile "
    "them with torch.profiler and name the bottleneck with ranked, exact changes. Any config field can be set "
    "with --section.key=value, as for train. Files go to a run folder (trace.json.gz, profile.json, profile.md)."
)
# --preset and --model: what profile, tune and memory run (with --section.key=value overrides)
TARGET_OPTIONS: Options = {
    "--preset": "preset name or .toml path (default: gpt2-small on a GPU, gpt-tiny on CPU; "
    "with --model: the config defaults, or this preset's settings for your model)",
    "--model": "your workload: FUNC() returns turbotrain.Workload("
    "model=..., train_loader=...) or a dict with those keys (package.module:FUNC works too)",
}
OPTIONS: Options = {
    "--steps": {"default": 5, "help": "profiled steps (default 5)"},
    "--warmup": {"default": 5, "help": "untimed warm-up steps, compilation included (default 5)"},
    "--timed": {
        "type": int,
        "default": 20,
        "help": "unprofiled timed steps for the throughput figures (default 20)",
    },
    "--verify": switch(
        "apply each recommended setting in its own short run and keep only those measurably faster than the baseline"
    ),
    "--repeats": {"type": int, "default": 3, "help": "--verify: interleaved runs per variant (default 3)"},
    "--verify-steps": {
        "type": int,
        "default": 10,
        "help": "--verify: timed steps per run (default 10, after 3 warm-up)",
    },
    "--json": "print the report as JSON instead of text",
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    tables = (TARGET_OPTIONS, OPTIONS)
    return add_command(subparsers, main_profile, HELP, *tables, description=DESCRIPTION, overrides=True)


def target_of(args: argparse.Namespace, extra: list[str]) -> Target:
    """The Target the arguments name: --model, else --preset (default: the device's preset)."""
    return Target(
        preset=args.preset or (None if args.model else default_preset()),
        model=args.model,
        overrides=parse_overrides(extra),
    )


def check_at_least(*checks: tuple[str, int, int]) -> None:
    """(flag, value, lowest allowed) for each: a one-line error for the first below its bound."""
    for flag, value, low in checks:
        if value < low:
            raise ConfigError(f"{flag} = {value} must be at least {low}")


def main_profile(args: argparse.Namespace, extra: list[str]) -> int:
    check_at_least(
        ("--steps", args.steps, 1),
        ("--warmup", args.warmup, 1),
        ("--timed", args.timed, 2),
        ("--repeats", args.repeats, 1),
        ("--verify-steps", args.verify_steps, 2),
    )
    target = target_of(args, extra)
    options = ProfileOptions(
        args.warmup, args.timed, args.steps, args.verify, args.repeats, verify_steps=args.verify_steps
    )
    with live_log() as log:
        doc = profile_target(target, options, log=log)
    print(json.dumps(doc, indent=1, default=str) if args.json else render(doc))
    # Ctrl-C: what ran is reported, then 130
    return 130 if (doc.get("verify") or {}).get("interrupted") else 0


@contextlib.contextmanager
def live_log() -> Iterator[Callable[..., None]]:
    """``log(line, transient=False)`` on stderr: on a terminal a transient line replaces the live
    status line; otherwise lines are printed and transient ones dropped."""
    from rich.console import Console  # on first use: ``turbotrain --help`` and other commands skip rich

    console = Console(stderr=True)
    if not console.is_terminal:

        def plain(line: str, transient: bool = False) -> None:
            if not transient:
                print(line, file=sys.stderr, flush=True)

        yield plain
        return
    with console.status("starting") as status:

        def log(line: str, transient: bool = False) -> None:
            if not transient:
                console.print(line)
            status.update(line)

        yield log
