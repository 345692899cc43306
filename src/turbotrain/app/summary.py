"""summary.json: the one writer (:func:`write_summary`) and the figures computed from a run's
metrics records (:func:`summarize_records`). A new summary field is a field of :class:`RunFacts`
(or a line in :func:`summarize_records`), and its summary.md line a section in :mod:`.report`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..base.atomic import atomic_write
from ..base.records import key_values, metric_keys
from ..base.rundir import SUMMARY_FILE
from ..core.meter.clock import median_of


@dataclass
class RunFacts:
    """What summary.json says of a run beyond its metrics, in the one shape every trainer fills;
    ``more``: what only one kind of run knows (the resolved settings, the stop reason, ...)."""

    run: str
    status: str
    steps: int
    samples: int  # of every rank
    tokens: int
    world_size: int
    first_step_s: float | None
    elapsed_s: float
    hardware: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)  # what changed how the run trains
    flops_per_sample: float | None = None
    flops_source: str | None = None
    flops_convention: str | None = None  # what MFU counts
    # activation checkpointing's recomputed forward, per sample: in HFU, not in MFU
    recompute_flops_per_sample: float | None = None
    peak_tflops: float | None = None
    compile: dict[str, Any] = field(default_factory=dict)  # recompiles, graph breaks, compile time
    optimizations: dict[str, Any] = field(default_factory=dict)  # what was in effect (precision, ...)
    more: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The facts as summary.json's keys (``more``'s at the top level, after the others)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "more"}, **self.more}


def failed_status(exc: BaseException | None) -> str:
    """summary.json's ``status`` of a run that ended with ``exc`` (the same words everywhere)."""
    if exc is None:
        return "failed: the process ended before training did"
    return f"failed: {type(exc).__name__}: {exc}"


def steady_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records that describe steady-state speed: without the first logging window (warm-up,
    compilation and caches settle there) when there are at least three windows."""
    timed = [r for r in records if r.get("step_ms")]
    return timed[1:] if len(timed) >= 3 else timed


# the steady-state medians summary.json gives (hw_tflops, activation checkpointing: with the recomputed forward)
STEADY_KEYS = (
    "tokens_per_s",
    "samples_per_s",
    "step_ms",
    "tflops",
    "mfu",
    "hw_tflops",
    "hfu",
    "gpu_util_pct",
    "gpu_power_w",
)


def _no_event(record: dict[str, Any]) -> dict[str, Any]:
    """An event record without its ``event`` key."""
    return {k: v for k, v in record.items() if k != "event"}


def summarize_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Steady-state medians (tokens/s, samples/s, step ms, achieved TFLOP/s, MFU), the median
    tokens/s of all windows, peak device memory in GiB, GPU utilisation and the final/best
    losses, from metrics records; the restarts (event records a relaunch wrote) as a list."""
    restarts = [r for r in records if r.get("event") == "restart"]
    epochs = [_no_event(r) for r in records if r.get("event") == "epoch"]
    records = [r for r in records if "event" not in r]
    steady = steady_records(records)
    med = lambda key: median_of(v for _, v in key_values(steady, key))  # noqa: E731
    losses = key_values(records, "loss")
    vals = key_values(records, "val_loss")
    peaks = [v for _, v in key_values(records, "mem_peak_gib")]
    return {
        "tokens_per_s_median": median_of(v for _, v in key_values(records, "tokens_per_s") if v),
        "steady_state": {"windows": len(steady), **{k: med(k) for k in STEADY_KEYS}},
        "peak_memory_gib": max(peaks) if peaks else None,
        "final_train_loss": losses[-1][1] if losses else None,
        "final_train_step": losses[-1][0] if losses else None,
        "final_val_loss": vals[-1][1] if vals else None,
        "final_val_step": vals[-1][0] if vals else None,
        "best_val_loss": min(v for _, v in vals) if vals else None,
        **{
            f"final_{key}": values[-1][1]
            for key in metric_keys(records)
            if (values := key_values(records, key))
        },
        "logged_steps": len(records),
        "last_step": records[-1]["step"] if records else None,
        **({"epochs": epochs} if epochs else {}),
        **(
            {"restarts": {"count": len(restarts), "each": [_no_event(r) for r in restarts]}}
            if restarts
            else {}
        ),
    }


def write_summary(
    run_dir: Path, facts: RunFacts | dict[str, Any], records: list[dict[str, Any]], **more: Any
) -> dict[str, Any]:
    """Write the run's summary.json (atomically) and return it: ``facts`` (what training knows, or
    a summary read back for the report), the figures from the metrics ``records`` (when there are
    any) on top, then ``more``."""
    known = facts.to_dict() if isinstance(facts, RunFacts) else facts
    summary = {**known, **(summarize_records(records) if records else {}), **more}
    atomic_write(run_dir / SUMMARY_FILE, json.dumps(summary, indent=2, default=str) + "\n")
    return summary
