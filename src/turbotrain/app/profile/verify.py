"""``turbotrain profile --verify``: apply each recommendation in its own short run and keep only
what measurably helped.

Every recommendation with config ``settings`` becomes a variant; the baseline and the variants
run ``repeats`` times, interleaved (baseline, A, B, ..., then the reverse order, and so on, so a
burst of load on a shared machine hits all of them alike), each a fresh short run in this process
(:func:`turbotrain.app.measure.measure_once`: warm-up excluded, median step). A variant's speedup is
the median of its throughputs over the baseline's median; it is kept when that is at least the
bench's RECOMMEND_MIN_SPEEDUP (1.05x: below it, run-to-run noise). Changes to your own code
cannot be applied here and are reported as "not verified". Ctrl-C ends the verification early:
what ran is reported, the rest is marked unverified.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...core.meter.parity import RECOMMEND_MIN_SPEEDUP, interleaved
from ..measure import Target, measure_once
from .advice import Advice


def verify(
    target: Target,
    advice: list[Advice],
    run_dir: Path,
    *,
    warmup: int,
    steps: int,
    repeats: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Fill ``a.verified`` for each recommendation; returns the baseline's runs and whether the
    verification was interrupted."""
    candidates = [a for a in advice if a.settings]
    for a in advice:
        if not a.settings:
            a.verified = {
                "status": "not verified",
                "reason": "a change to your code: apply it and profile again",
            }
    if not candidates:
        return {
            "repeats": 0,
            "warmup": warmup,
            "steps": steps,
            "interrupted": False,
            "min_speedup": RECOMMEND_MIN_SPEEDUP,
            "baseline": {"throughput_median": None, "throughputs": [], "unit": None},
            "note": "no recommendation is a setting: nothing to run",
        }
    variants: list[tuple[str, dict[str, Any]]] = [("baseline", {})] + [
        (a.change, a.settings) for a in candidates
    ]
    runs: list[list[dict[str, Any]]] = [[] for _ in variants]
    total, done, interrupted = repeats * len(variants), 0, False
    try:
        for r, i in interleaved(len(variants), repeats):
            done += 1
            log(f"verify {done}/{total}: {variants[i][0]}")
            runs[i].append(measure_once(target, variants[i][1], run_dir / f"run{i}-{r + 1}", warmup, steps))
    except KeyboardInterrupt:
        interrupted = True
        log("verification interrupted: reporting the runs that finished")
    base = [f["throughput"] for f in runs[0]]
    base_median = statistics.median(base) if base else None
    base_loss = _median([f.get("parity_loss") for f in runs[0]])
    for a in candidates:
        mine = runs[1 + candidates.index(a)]
        if not mine or base_median is None:
            a.verified = {"status": "not verified", "reason": "interrupted before it ran"}
            continue
        median = statistics.median(f["throughput"] for f in mine)
        speedup = median / base_median
        loss = _median([f.get("parity_loss") for f in mine])
        a.verified = {
            "status": "kept" if speedup >= RECOMMEND_MIN_SPEEDUP else "dropped",
            "speedup": speedup,
            "throughput_median": median,
            "throughputs": [f["throughput"] for f in mine],
            "runs": len(mine),
            "loss_diff": None if loss is None or base_loss is None else loss - base_loss,
        }
    return {
        "repeats": repeats,
        "warmup": warmup,
        "steps": steps,
        "interrupted": interrupted,
        "min_speedup": RECOMMEND_MIN_SPEEDUP,
        "baseline": {
            "throughput_median": base_median,
            "throughputs": base,
            "unit": runs[0][0]["throughput_unit"] if runs[0] else None,
        },
    }


def _median(values: list[Any]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None
