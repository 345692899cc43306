"""Measured rows as a markdown table (printed to the terminal and written next to the JSON):
bench's reports, tune's trials, profile's verification, fp8's layer timing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

DASH = "—"  # a figure a row does not have


def figure(value: float | None, form: str, unit: str = "", missing: str = DASH) -> str:
    """``value`` in ``form`` (then ``unit``), or ``missing`` when there is none."""
    return missing if value is None else f"{format(value, form)}{unit}"


def render_table(rows: list[Any], columns: list[tuple[str, Callable[[Any], str]]]) -> str:
    """Markdown table: ``columns`` are (header, row -> cell text)."""
    head = "| " + " | ".join(h for h, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = [
        "| " + " | ".join(str(get(r)).replace("|", "\\|").replace("\n", " ") for _, get in columns) + " |"
        for r in rows
    ]
    return "\n".join([head, rule, *body])
