"""What several subcommands share, each defined once: their options (a command lists its options as
``{flag: help}`` or ``{flag: {add_argument keywords}}``; ``add_options`` fills in the type, default
and metavar the flag has everywhere), the workload they run and their checks and live log."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ..app.measure import Target
from ..app.prepare import default_preset
from ..base.config import parse_overrides
from ..base.errors import ConfigError

Options = dict[str, str | dict[str, Any]]  # flag: help, or flag: add_argument keywords

SHARED: dict[str, dict[str, Any]] = {
    "--json": {"action": "store_true"},
    "--model": {"metavar": "FILE.py:FUNC"},
    "--seed": {"type": int, "default": 0},
    "--threads": {"type": int, "default": 0},
    "--warmup": {"type": int},
    "--steps": {"type": int},
    "--out-dir": {"default": "runs", "help": "where runs live (default runs/)"},
    "run_dir": {"nargs": "?", "default": ""},
}

# --preset and --model: what profile, tune and memory run (with --section.key=value overrides)
TARGET_OPTIONS: Options = {
    "--preset": "preset name or .toml path (default: gpt2-small on a GPU, gpt-tiny on CPU; "
    "with --model: the config defaults, or this preset's settings for your model)",
    "--model": "your workload: FUNC() returns turbotrain.Workload("
    "model=..., train_loader=...) or a dict with those keys (package.module:FUNC works too)",
}


def add_options(p: argparse.ArgumentParser, options: Options) -> None:
    """``p.add_argument`` for each flag: its SHARED keywords, then the command's own."""
    for flag, spec in options.items():
        own = spec if isinstance(spec, dict) else {"help": spec}
        p.add_argument(flag, **{**SHARED.get(flag, {}), **own})


def switch(help: str) -> dict[str, Any]:
    return {"action": "store_true", "help": help}


def number(default: float, help: str, **more: Any) -> dict[str, Any]:
    """A flag that takes a number of ``default``'s type (int or float)."""
    return {"type": type(default), "default": default, "help": help, **more}


def choice(choices: tuple[str, ...], help: str) -> dict[str, Any]:
    """A flag that takes one of ``choices``, the first by default."""
    return {"choices": choices, "default": choices[0], "help": help}


def add_command(
    subparsers: argparse._SubParsersAction,
    run: Callable[[argparse.Namespace, list[str]], int],
    help: str,
    *tables: Options,
    description: str | None = None,
    epilog: str | None = None,
    overrides: bool = False,
) -> argparse.ArgumentParser:
    """The subcommand ``run`` runs (``main_train``: ``train``); ``overrides``: takes --section.key=value."""
    p = subparsers.add_parser(
        run.__name__.removeprefix("main_"), help=help, description=description, epilog=epilog
    )
    for table in tables:
        add_options(p, table)
    p.set_defaults(command=run, **({"accepts_overrides": True} if overrides else {}))
    return p


def target_of(args: argparse.Namespace, extra: list[str]) -> Target:
    """The Target the arguments name: --model, else --preset (default: the device's preset)."""
    return Target(
        preset=args.preset or (None if args.model else default_preset()),
        model=args.model,
        overrides=parse_overrides(extra),
    )


def check_at_least(args: argparse.Namespace, **lows: int) -> None:
    """``name=lowest`` for each flag: a one-line error for the first whose value is below its bound."""
    for name, low in lows.items():
        value = getattr(args, name)
        if value < low:
            raise ConfigError(f"--{name.replace('_', '-')} = {value} must be at least {low}")


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
