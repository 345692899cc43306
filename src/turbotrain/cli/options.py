"""The options several subcommands take, each defined once: a command lists its options as
``{flag: help}`` (or ``{flag: {add_argument keywords}}``) and ``add_options`` fills in the
type, default and metavar the flag has everywhere."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

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


def add_options(p: argparse.ArgumentParser, options: Options) -> None:
    """``p.add_argument`` for each flag: its SHARED keywords, then the command's own."""
    for flag, spec in options.items():
        own = spec if isinstance(spec, dict) else {"help": spec}
        p.add_argument(flag, **{**SHARED.get(flag, {}), **own})


def switch(help: str) -> dict[str, Any]:
    return {"action": "store_true", "help": help}


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
