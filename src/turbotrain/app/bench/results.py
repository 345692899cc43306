"""Result files: ``--out DIR`` writes ``DIR/<workload>-<kind>.json`` (the report, the environment,
the exact command, the git commit) and ``.md`` (the table)."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ...base.atomic import atomic_write
from ...base.version import collect_git
from ..environment import collect_env
from .tables import render_report

SCHEMA = "turbotrain-bench/1"


def collect_environment() -> dict[str, Any]:
    """``collect_env()``, or why it failed (the runtime block is recorded either way)."""
    try:
        return collect_env()
    except Exception as exc:  # an environment probe must not lose the benchmark's figures
        return {"unavailable": f"collect_env() failed: {type(exc).__name__}: {exc}"}


def collect_runtime() -> dict[str, Any]:
    """What this process knows without probing devices: versions, platform, CPU count."""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }


def build_document(report: dict[str, Any], command: str, argv: list[str]) -> dict[str, Any]:
    """The JSON document for one report."""
    return {
        "schema": SCHEMA,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command,
        "argv": argv,
        "git": collect_git(),
        "runtime": collect_runtime(),
        "env": collect_environment(),
        **report,
    }


def strict_json(value: Any) -> Any:
    """``value`` with non-finite floats (a diverged loss) as the strings "nan", "inf", "-inf", so the
    file stays strict JSON and keeps the fact instead of failing to write."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def write_document(doc: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """``<workload>-<kind>.json`` and ``.md`` in ``out_dir`` (written atomically)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{doc['workload']['name']}-{doc['kind']}"
    paths = (out_dir / f"{stem}.json", out_dir / f"{stem}.md")
    texts = (json.dumps(strict_json(doc), indent=1, default=str, allow_nan=False) + "\n", render_report(doc))
    for path, text in zip(paths, texts):
        atomic_write(path, text)
    return paths


class ReportWriter:
    """Writes a report's JSON and markdown at each call (as ``BenchOptions.progress``: after every
    row), each write replacing the last atomically; the environment is probed once."""

    def __init__(
        self, out_dir: Path, command: str, argv: list[str], extra: dict[str, Any] | None = None
    ) -> None:
        self.out_dir, self.command, self.argv, self.extra = out_dir, command, argv, extra or {}
        self._head: dict[str, Any] | None = None

    def __call__(self, report: dict[str, Any]) -> tuple[Path, Path]:
        if self._head is None:
            self._head = build_document({}, self.command, self.argv)
        updated = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return write_document({**self._head, "updated_utc": updated, **report, **self.extra}, self.out_dir)
