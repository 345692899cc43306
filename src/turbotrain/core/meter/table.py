"""Measured rows as a markdown table (printed to the terminal and written next to the JSON):
bench's reports, tune's trials, profile's verification, fp8's layer timing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def render_table(rows: list[Any], columns: list[tuple[str, Callable[[Any], str]]]) -> str:
    """Markdown table: ``columns`` are (header, row -> cell text)."""
    head = "| " + " | ".join(h for h, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = [
        "| " + " | ".join(str(get(r)).replace("|", "\\|").replace("\n", " ") for _, get in columns) + " |"
        for r in rows
    ]
    return "\n".join([head, rule, *body])
