"""The docs site's generated reference pages (issue 49 item 4) list what the code defines: the config
reference every field ``turbotrain train --help-config`` lists, with the same defaults and ranges; the CLI
reference every subcommand and flag of the parsers. Fast: no site build, only the hook's functions."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from turbotrain.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("mkdocs", reason="the docs hook builds mkdocs File objects: pip install -e '.[docs]'")


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "docs_reference_hook", ROOT / "docs" / "hooks" / "reference.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(markdown: str) -> list[list[str]]:
    """The table rows of a page (header and rule rows left out), cells unescaped and stripped."""
    rows = []
    for line in markdown.splitlines():
        if line.startswith("| ") and not line.startswith(("| Field |", "| Flag |")):
            cells = re.split(r"(?<!\\)\|", line.strip()[1:-1])
            rows.append([c.strip().replace("\\|", "|") for c in cells])
    return rows


def test_config_reference_lists_every_help_config_field_with_its_default_and_range(capsys):
    assert main(["train", "--help-config"]) == 0
    listed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  --")]
    rows = {
        key.strip("`"): (default.strip("`"), allowed)
        for key, _, default, allowed, _ in _rows(_hook().config_reference())
    }
    keys = [re.match(r"  (--[a-z0-9_.]+)=", line).group(1) for line in listed]
    assert keys == list(rows), "the reference lists the fields --help-config lists, in its order"
    assert len(keys) > 50
    for line, key in zip(listed, keys, strict=True):
        default, allowed = rows[key]
        assert line.startswith(f"  {key}={default}: "), (line, default)
        if allowed.startswith("one of: "):
            assert f"({allowed})" in line, (line, allowed)
        elif allowed:
            assert f"(range {allowed})" in line, (line, allowed)
        else:
            assert "(range [" not in line and "(one of: " not in line, line


def _commands(
    parser: argparse.ArgumentParser, prog: str = "turbotrain"
) -> dict[str, argparse.ArgumentParser]:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[f"{prog} {name}"] = sub
                out.update(_commands(sub, f"{prog} {name}"))
    return out


def test_cli_reference_lists_every_subcommand_and_flag_of_the_parsers():
    page = _hook().cli_reference()
    sections = dict(re.findall(r"^## `([^`]+)`\n(.*?)(?=^## |\Z)", page, flags=re.M | re.S))
    commands = _commands(build_parser())
    assert {"turbotrain train", "turbotrain bench", "turbotrain tune"} <= set(commands)
    assert set(sections) == set(commands)
    for prog, parser in commands.items():
        flags = {
            f
            for row in _rows(sections[prog])
            for f in re.findall(r"--?[a-zA-Z][\w-]*", row[0].split(" {")[0])
        }
        wanted = {
            s for a in parser._actions if not isinstance(a, argparse._HelpAction) for s in a.option_strings
        }
        assert wanted and wanted <= flags, (prog, wanted - flags)
