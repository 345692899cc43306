"""Metrics records (``metrics.jsonl``, one JSON object a line), read back through here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Records from a metrics.jsonl, skipping (and naming) lines that are not whole JSON records."""
    records: list[dict[str, Any]] = []
    problems: list[str] = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            where = "the last line" if number == len(lines) else f"line {number}"
            problems.append(
                f"{path.name}: {where} is cut off or not JSON ({line[:40]!r}...); skipped it (a crashed run?)"
            )
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            problems.append(f"{path.name}: line {number} has no integer 'step'; skipped it")
            continue
        records.append(record)
    return records, problems


def key_values(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) for each record with a number (not a bool) at ``key``."""
    return [
        (r["step"], float(r[key]))
        for r in records
        if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
    ]


def numbers(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric values (not ``step``, not bools, no text): what a tracker logs as metrics."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


NOT_METRICS = ("val_loss", "val_step")


def metric_keys(records: list[dict[str, Any]]) -> list[str]:
    """The ``val_*`` metrics besides the loss and ``engine.log``'s ``train_*``, in first-seen order."""
    keys: dict[str, None] = {}
    for r in records:
        if "event" not in r:
            keys.update((k, None) for k in r if k.startswith(("val_", "train_")) and k not in NOT_METRICS)
    return list(keys)
