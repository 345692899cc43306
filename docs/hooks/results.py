"""MkDocs hook: ``reference/results.md``, every committed result of ``benchmarks/results/`` as tables with
the command that made it, generated from the files there at build time (never a copy):

- a result's ``.md`` (what ``turbotrain bench --out`` and the benchmark scripts write beside their JSON) as it is,
  its headings as bold lines under the file's own;
- a ``.json`` with no ``.md`` beside it: its top-level figures as a table and its ``command``.

Logs and raw traces (``.log``, ``.txt``, ``.gz``) are not shown; their paths are listed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
_LINK = re.compile(r"(?<!!)\[([^\]]+)\]\((?!https?://)([^)]+)\)")


def _markdown(path: Path) -> str:
    """A result's markdown, its headings as bold lines (the page's contents list the files, not their
    headings) and its relative links as paths (the site holds no copy of the results folder)."""
    text = re.sub(r"^#{1,6} (.+)$", r"**\1**", path.read_text(), flags=re.M)
    return _LINK.sub(lambda m: m[1] if m[1].strip("`") == m[2] else f"{m[1]} (`{m[2]}`)", text)


def _cell(value: Any) -> str:
    text = f"{value:,.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _json(path: Path) -> str:
    """A JSON result's top-level figures (numbers, strings, booleans) as a table, then its command."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        return f"A list of {len(data)} entries."
    command = data.get("command") or data.get("commands")
    rows = [
        f"| `{key}` | {_cell(value)} |"
        for key, value in data.items()
        if key not in ("command", "commands")
        and isinstance(value, (int, float, str, bool))
        and len(str(value)) < 200
    ]
    nested = [key for key, value in data.items() if isinstance(value, (dict, list))]
    out = ["| figure | value |", "|---|---|", *rows] if rows else []
    if nested:
        out += ["", "Nested in the file: " + ", ".join(f"`{k}`" for k in nested) + "."]
    if command:
        commands = command if isinstance(command, list) else [command]
        out += ["", "Command:", "", "```bash", *map(str, commands), "```"]
    return "\n".join(out)


def results_reference() -> str:
    """Markdown: each results folder, its result files in order, each under its path."""
    out = [
        "# Benchmark results",
        "",
        "Every committed result in `benchmarks/results/`, generated from the files at build time: a result's "
        "markdown as written beside its JSON (with the command that made it), or a JSON's top-level figures. "
        "`benchmarks/README.md` says how to reproduce each; the headline figures are on the home page.",
    ]
    skipped = []
    for folder in sorted({p.parent for p in RESULTS.rglob("*") if p.is_file()}):
        files = sorted(p for p in folder.iterdir() if p.is_file())
        shown = [
            p
            for p in files
            if p.suffix == ".md" or (p.suffix == ".json" and not p.with_suffix(".md").exists())
        ]
        skipped += [p for p in files if p not in shown]
        if not shown:
            continue
        out += ["", f"## `{folder.relative_to(ROOT)}/`"]
        for path in shown:
            body = _markdown(path) if path.suffix == ".md" else _json(path)
            out += ["", f"### `{path.name}`", "", body.strip()]
    if skipped:
        out += ["", "## Logs and raw files", "", *(f"- `{p.relative_to(ROOT)}`" for p in skipped)]
    return "\n".join(out) + "\n"


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "reference/results.md", content=results_reference()))
    return files
