"""One tune trial in its own process: ``python -m turbotrain.app.tune.trial --spec S --result R``.

Mode ``measure``: peak memory first (CPU: one eager step as the batch finder counts it; CUDA: the
allocator's peak at the end of the warm-up), a progress event at once so the study can stop an
over-budget trial before its timed steps; then each window's throughput (for the pruner); the
result last, atomically. Mode ``find``: the batch finder's largest micro-batch for the target.
Status ``ok``, ``oom``, ``invalid`` (a setting this device or model refuses) or ``failed``;
``fatal`` marks a failure no setting changes (:func:`turbotrain.base.failure.no_setting_fixes`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...base.errors import TurbotrainError
from ...base.failure import first_line, no_setting_fixes, one_line
from ...core.oom import is_oom
from ...tools.memory import usable_memory_bytes
from ...tools.memory.stats import storage_bytes
from ..measure import Target, build, child_main, measure_memory, release, run


class Progress:
    """Appends progress events (one JSON object per line, flushed) for the parent to poll."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "a", buffering=1, encoding="utf-8")

    def emit(self, event: str, **values: Any) -> None:
        self.file.write(json.dumps({"event": event, "t": time.time(), **values}, default=str) + "\n")
        self.file.flush()


def measure_trial(spec: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """The ``measure`` mode (see the module docstring)."""
    target, run_dir = Target.from_dict(spec["target"]), Path(spec["run_dir"])
    built = build(target, spec["changes"], run_dir)
    try:
        c = built.config
        cuda = built.engine.device.type == "cuda"
        peak = None
        budget = usable_memory_bytes(built.engine.device, c.batch.max_memory_gib, c.batch.max_memory_fraction)
        if not cuda:
            if budget is not None:  # as the batch finder counts it: the weights already sit in RAM
                budget += storage_bytes(list(built.model.parameters()) + list(built.model.buffers()))
            peak = measure_memory(built)
            progress.emit("memory", peak_bytes=peak, budget_bytes=budget)
        figures = run(
            built,
            spec["warmup"],
            spec["steps"],
            window=spec["window"],
            on_window=lambda k, value: progress.emit("window", k=k, throughput=value),
            on_warm=(lambda at: progress.emit("memory", peak_bytes=at.get("peak_bytes"), budget_bytes=budget))
            if cuda
            else None,
        )
        figures["budget_bytes"] = budget
        if peak is not None:
            figures["peak_bytes"] = peak
        figures.pop("step_ms", None)
        return {"status": "ok", **figures}
    finally:
        release(built)


def find_trial(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``find`` mode: build the target with ``batch.micro = auto`` (the changes say so) and
    return the finder's answer."""
    built = build(Target.from_dict(spec["target"]), spec["changes"], Path(spec["run_dir"]))
    try:
        search = built.batch_search or {}
        return {"status": "ok", "found": search.get("found", built.micro), "search": search}
    finally:
        release(built)


def outcome(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The trial's result: its status (see the module docstring) and figures."""
    result: dict[str, Any] = {"pid": os.getpid()}
    try:
        result.update(
            find_trial(spec) if spec["mode"] == "find" else measure_trial(spec, Progress(args.progress))
        )
    except Exception as exc:
        if is_oom(exc):
            result.update(status="oom", reason=first_line(exc, "out of memory")[:300])
        elif isinstance(exc, TurbotrainError):
            result.update(status="invalid", reason=str(exc)[:500])
        else:
            traceback.print_exc()
            result.update(status="failed", reason=one_line(exc))
        if no_setting_fixes(exc):  # the loss is not a scalar, the loader is empty: no other setting will run
            result["fatal"] = True
    return result


def main(argv: Sequence[str] | None = None) -> int:
    return child_main(argv, (__doc__ or "").splitlines()[0], outcome, "--progress")


if __name__ == "__main__":
    sys.exit(main())
