"""``turbotrain`` command line: one module and one parser function per subcommand."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from collections.abc import Sequence

from ..base.config import audience
from ..base.errors import LOG_FORMAT, TurbotrainError, format_warning
from ..base.version import __version__
from ..core.main_rank import ReportedByAnotherRank, announce_reported
from . import bench, doctor, profile, report, sample, train, tune
from . import memory as memory_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="turbotrain", description="Fast PyTorch training by default, measured."
    )
    parser.add_argument("--version", action="version", version=f"turbotrain {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in (train, sample, doctor, report, memory_cmd, bench, profile, tune):  # in the help's order
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point. User mistakes (TurbotrainError) print one line and exit with code 2. Output
    piped into a reader that stops early (``| head``) ends quietly with 141, as SIGPIPE would."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    warnings.simplefilter("default", UserWarning)
    previous_format, warnings.formatwarning = warnings.formatwarning, format_warning
    try:
        code = _run(argv)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        # what is still buffered goes nowhere at exit, not into a traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader left
    finally:
        warnings.formatwarning = previous_format


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if extra and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what reproduces the run (bench's results)
    name = args.command.__name__.removeprefix("main_")  # main_train -> train
    try:
        with audience("cli"):  # errors name flags (--section.key=value)
            return int(args.command(args, extra) or 0)
    except ReportedByAnotherRank:
        return 0  # under torchrun: the rank that found the error says it
    except TurbotrainError as exc:
        # under torchrun: the other ranks end quietly, not as if this one were lost
        announce_reported(str(exc))
        print(f"turbotrain {name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"turbotrain {name}: interrupted", file=sys.stderr)
        return 130
