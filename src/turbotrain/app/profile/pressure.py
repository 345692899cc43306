"""``profile``'s rules that watch the run rather than one step's time: memory pressure and a
falling throughput trend. Findings are ``Advice`` fields without ``settings``: neither is a
speed-up for ``--verify`` to measure."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...base.config import setting
from ...base.units import GIB, gib
from ...parts.hardware import device_total_bytes
from ...tools.memory.finder import usable_memory_bytes
from ...tools.memory.stats import storage_bytes

if TYPE_CHECKING:  # the caller (advice) hands the measure in: importing it here lengthens app's chain
    from ..measure import Built

MEMORY_SHARE = 0.80  # of the budget: memory pressure above it
TREND_DROP = 0.10  # the last third's median step this much slower than the first third's
TREND_MIN_STEPS = 6

BOTTLENECKS = {
    "memory": "memory pressure: one step uses most of the memory it may use",
    "trend": "throughput falls during the run",
}


def memory_budget(built: Built) -> tuple[int | None, str]:
    """The bytes one step may use and what they are (said in the finding)."""
    c, device = built.config, built.engine.device
    if device.type == "cuda":
        total = device_total_bytes(device)
        budget, what = total, "the device's"
        if c.memory.max_fraction > 0 and total:
            budget = int(total * c.memory.max_fraction)
            what = f"the cap (memory.max_fraction = {c.memory.max_fraction:g})"
    else:  # as the batch finder counts it: the weights already sit in RAM
        budget, what = usable_memory_bytes(device, 0.0, c.batch.max_memory_fraction), "the available RAM"
    if c.batch.max_memory_gib > 0 and (budget is None or c.batch.max_memory_gib * GIB < budget):
        budget, what = int(c.batch.max_memory_gib * GIB), "batch.max_memory_gib"
    if device.type != "cuda" and budget is not None:
        budget += storage_bytes(list(built.model.parameters()) + list(built.model.buffers()))
        what += ", plus the weights already in RAM"
    return budget, what


def memory_pressure(
    built: Built, figures: dict[str, Any], cpu_peak: Callable[[], int]
) -> list[dict[str, Any]]:
    """One finding when a step's peak memory (CUDA: the allocator's; CPU: ``cpu_peak()``, one eager
    step's tensors) passes :data:`MEMORY_SHARE` of the budget."""
    budget, what = memory_budget(built)
    peak = figures.get("peak_bytes") if built.engine.device.type == "cuda" else cpu_peak()
    if not budget or not peak or peak < MEMORY_SHARE * budget:
        return []
    c, micro, acc = built.config, built.micro, built.engine.accumulation
    changes = []
    if c.memory.checkpointing != "full":
        changes.append(
            setting("memory.checkpointing", "selective" if c.memory.checkpointing == "off" else "full")
        )
    if micro >= 2:
        changes.append(f"{setting('batch.micro', micro // 2)} {setting('batch.accumulation', 2 * acc)}")
    return [
        {
            "category": "memory",
            "change": " or ".join(changes) or "a smaller model or sequence",
            "why": f"one step's peak memory, {gib(peak):.3g} GiB, is {peak / budget:.0%} of the {gib(budget):.3g} GiB "
            f"it may use ({what}): a longer batch, fragmentation or a larger model runs out of memory",
            "expected": "activation checkpointing frees most activations for about a third more compute per "
            "step (selective: less); half the micro-batch with twice the accumulation halves the activations "
            "at the same global batch and the same math",
            "expected_speedup": 1.0,
        }
    ]


def throughput_trend(step_ms: list[float]) -> list[dict[str, Any]]:
    """One finding when the last third of the timed steps is TREND_DROP slower than the first."""
    if len(step_ms) < TREND_MIN_STEPS:
        return []
    third = len(step_ms) // 3
    early, late = statistics.median(step_ms[:third]), statistics.median(step_ms[-third:])
    if late < (1 + TREND_DROP) * early:
        return []
    return [
        {
            "category": "trend",
            "change": "find what slows down: in metrics.jsonl of a longer run, gpu_sm_clock_mhz and gpu_temp_c "
            "(a clock throttled by heat or power), host_rss_gib and mem_reserved_gib (memory growing step after "
            "step: a list that keeps tensors, fragmentation), the data wait, and the compile section of "
            "summary.md (recompilation)",
            "why": f"the timed steps slow down: the median of the last {third} is {late:.1f} ms, "
            f"{late / early - 1:.0%} above the first {third}'s {early:.1f} ms",
            "expected": "steps at the pace of the first ones once the cause is gone",
            "expected_speedup": 1.0,
        }
    ]
