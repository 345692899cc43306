"""``turbotrain profile --verify``: the baseline and each recommended setting run ``repeats`` times,
interleaved (a burst of load hits all alike); a variant is kept when its median throughput is at
least RECOMMEND_MIN_SPEEDUP x the baseline's. Ctrl-C reports what ran; the rest is unverified."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...core.meter.parity import RECOMMEND_MIN_SPEEDUP, interleaved
from ..measure import Target, measure_once
from .advice import Advice

CODE_CHANGE = {"status": "not verified", "reason": "a change to your code: apply it and profile again"}
NOT_RUN = {"status": "not verified", "reason": "interrupted before it ran"}


def verify(
    target: Target,
    advice: list[Advice],
    run_dir: Path,
    warmup: int,
    steps: int,
    repeats: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Fill ``a.verified`` for each recommendation; returns the baseline's runs."""
    candidates = [a for a in advice if a.settings]
    for a in advice:
        if not a.settings:
            a.verified = dict(CODE_CHANGE)
    head: dict[str, Any] = {"repeats": repeats, "warmup": warmup, "steps": steps, "interrupted": False}
    head["min_speedup"] = RECOMMEND_MIN_SPEEDUP
    if not candidates:
        return {
            **head,
            "repeats": 0,
            "baseline": {"throughput_median": None, "throughputs": [], "unit": None},
            "note": "no recommendation is a setting: nothing to run",
        }
    variants = [("baseline", {}), *((a.change, a.settings) for a in candidates)]
    runs: list[list[dict[str, Any]]] = [[] for _ in variants]
    try:
        for done, (r, i) in enumerate(interleaved(len(variants), repeats), 1):
            log(f"verify {done}/{repeats * len(variants)}: {variants[i][0]}")
            runs[i].append(measure_once(target, variants[i][1], run_dir / f"run{i}-{r + 1}", warmup, steps))
    except KeyboardInterrupt:
        head["interrupted"] = True
        log("verification interrupted: reporting the runs that finished")
    base = [f["throughput"] for f in runs[0]]
    base_median = statistics.median(base) if base else None
    base_loss = _median([f.get("parity_loss") for f in runs[0]])
    for a, mine in zip(candidates, runs[1:]):
        a.verified = (
            _verdict(mine, base_median, base_loss) if mine and base_median is not None else dict(NOT_RUN)
        )
    unit = runs[0][0]["throughput_unit"] if runs[0] else None
    return {**head, "baseline": {"throughput_median": base_median, "throughputs": base, "unit": unit}}


def _verdict(mine: list[dict[str, Any]], base_median: float, base_loss: float | None) -> dict[str, Any]:
    median = statistics.median(f["throughput"] for f in mine)
    speedup = median / base_median
    loss = _median([f.get("parity_loss") for f in mine])
    return {
        "status": "kept" if speedup >= RECOMMEND_MIN_SPEEDUP else "dropped",
        "speedup": speedup,
        "throughput_median": median,
        "throughputs": [f["throughput"] for f in mine],
        "runs": len(mine),
        "loss_diff": None if loss is None or base_loss is None else loss - base_loss,
    }


def _median(values: list[Any]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None
