"""Batch-size finder: the largest (or fastest) micro-batch that fits, with headroom, keeping the
global batch through gradient accumulation.

The search runs ``trial(micro) -> TrialResult(peak_bytes, step_s)`` (raising
``torch.OutOfMemoryError`` when a size does not fit): it doubles from ``start`` until a size runs
out of memory, goes over the budget or reaches ``max_micro``, then binary-searches (on multiples of
8 from 8 up). The answer keeps ``headroom`` (a fraction of the peak) free under the limit: the
budget, else the largest peak that ran when out of memory was the only signal; peaks of sizes not
tried are interpolated. On CPU (no allocator statistics; out of memory kills the process) sizes
whose extrapolated peak exceeds the RAM are not run, and a step (median of 3) longer than
:data:`CPU_MAX_STEP_S` fails (a timing rule: a busy CPU may find a smaller size). On CUDA with
``pick='largest'`` the answer depends on memory only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ...base.config import BATCH_PICKS, choice_error
from ...base.errors import ConfigError, TurbotrainError
from ...base.units import GIB, gib
from ...core.oom import is_oom
from ...core.process_group import collective_device, in_group
from ...parts.hardware import ram_bytes

log = logging.getLogger(__name__)

DEFAULT_MAX_MICRO = 1024  # sequences; beyond this larger micro-batches rarely run faster
CPU_MAX_STEP_S = 1.0  # on CPU, a micro-batch whose measured step takes longer is not chosen: steps stay short


@dataclass(frozen=True)
class TrialResult:
    """One trial that ran: its peak memory in bytes and its step time in seconds."""

    peak_bytes: int
    step_s: float


Trial = Callable[[int], TrialResult]  # micro -> its peak and step time, or torch.OutOfMemoryError


@dataclass
class TrialRecord:
    micro: int
    fits: bool
    peak_bytes: int | None = None
    step_s: float | None = None
    reason: str = ""  # why it does not fit: "out of memory" or "over budget"

    @property
    def samples_per_s(self) -> float:
        return self.micro / self.step_s if self.step_s else 0.0


@dataclass
class BatchSearch:
    """The finder's answer and how it got there (written to the run summary and the cache)."""

    micro: int  # the micro-batch to train with (after fitting the global batch)
    found: int  # what the search chose, per rank, before the global batch was fitted
    pick: str
    headroom: float
    limit_bytes: int | None  # memory the choice keeps ``headroom`` under (None: no limit met)
    budget_bytes: int | None  # the memory cap or the device's usable memory
    trials: list[TrialRecord] = field(default_factory=list)
    search_s: float = 0.0
    accumulation: int = 1
    world_size: int = 1
    global_batch: int = 0
    note: str = ""
    cached: bool = False

    @property
    def chosen_peak_bytes(self) -> int | None:
        return _interpolate(self.found, [t for t in self.trials if t.fits])

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["chosen_peak_gib"] = gib(self.chosen_peak_bytes)
        out["limit_gib"], out["budget_gib"] = gib(self.limit_bytes), gib(self.budget_bytes)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BatchSearch:
        known = {f for f in cls.__dataclass_fields__}
        values = {k: v for k, v in data.items() if k in known}
        values["trials"] = [TrialRecord(**t) for t in data.get("trials", [])]
        return cls(**values)

    def describe(self) -> str:
        """One line for the log: size, how it was found, memory, global batch."""
        how = "from the cache" if self.cached else f"{len(self.trials)} trials in {self.search_s:.1f} s"
        peak = self.chosen_peak_bytes
        mem = f", peak {gib(peak):.2f} GiB" if peak is not None else ""
        if self.limit_bytes is not None:
            mem += f" of a {gib(self.limit_bytes):.2f} GiB limit ({100 * self.headroom:.0f}% headroom)"
        return (
            f"batch finder: micro-batch {self.micro} ({self.pick}, {how}{mem}); "
            f"global batch {self.global_batch} = {self.micro} x accumulation {self.accumulation} x {self.world_size} rank(s)"
        )


def _interpolate(micro: int, fitting: list[TrialRecord]) -> int | None:
    """Peak bytes at ``micro``, linear between the measured sizes around it; at or below the
    smallest measured size, that size's peak (an upper bound: memory grows with the batch)."""
    points = sorted((t.micro, t.peak_bytes) for t in fitting if t.peak_bytes is not None)
    if not points:
        return None
    if micro <= points[0][0]:
        return points[0][1]
    for (b0, p0), (b1, p1) in zip(points, points[1:]):
        if b0 <= micro <= b1:
            return int(p0 + (p1 - p0) * (micro - b0) / (b1 - b0))
    b0, p0 = points[-2] if len(points) > 1 else (0, 0)
    b1, p1 = points[-1]
    return int(p1 + (p1 - p0) / max(b1 - b0, 1) * (micro - b1))


def _agree_across_ranks(value: int) -> int:
    """The minimum of ``value`` over all ranks under torch.distributed (a sync point, once per trial)."""
    if not in_group():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t.item())


def find_batch_size(
    trial: Trial,
    *,
    max_micro: int = DEFAULT_MAX_MICRO,
    start: int = 1,
    headroom: float = 0.10,
    pick: str = "largest",
    budget_bytes: int | None = None,
    multiple_of: int = 8,
    predict: bool = False,
    slowdown_stop: float = 0.0,
    max_step_s: float = 0.0,
    agree: Callable[[int], int] = _agree_across_ranks,
) -> BatchSearch:
    """Search the micro-batch for ``trial`` (see the module doc). Never returns a size that ran
    out of memory or exceeded ``budget_bytes``; ``pick='fastest'``: the tried size with the most
    samples/s within the headroom. Under torch.distributed every rank must call it: each verdict
    is the all-ranks minimum, so all ranks walk the same sizes.

    ``predict``: skip a size whose extrapolated peak exceeds ``budget_bytes`` (CPU, where running
    out of memory kills the process). ``slowdown_stop`` (0 = off): stop growing under that
    fraction of the best samples/s so far. ``max_step_s`` (0 = off): a size whose measured step
    takes longer does not fit (``start`` always does). Both are timing rules: answers vary with load."""
    _check_search(pick, headroom, start, max_micro)
    search = _Search(trial, budget_bytes, predict, max_step_s, agree)
    lo, hi = search.grow(start, max_micro, slowdown_stop)
    if lo == 0:
        reason = search.trials[-1].reason
        raise TurbotrainError(
            f"batch finder: even micro-batch {start} does not fit ({reason}); use --memory.checkpointing=full, "
            "a lower precision (--precision.mode=bf16-mixed), a smaller model, or a larger --batch.max_memory_gib"
        )
    search.bisect(lo, hi, multiple_of)
    fitting = [t for t in search.trials if t.fits]
    largest = max(fitting, key=lambda t: t.micro)
    limit = budget_bytes
    if any(t.reason == "out of memory" for t in search.trials) and largest.peak_bytes is not None:
        limit = largest.peak_bytes if limit is None else min(limit, largest.peak_bytes)
    # Ranks saw the same fits but may have measured different peaks: all take the smallest answer.
    found = agree(_choose(fitting, largest.micro, limit, headroom, pick, multiple_of, max_micro))
    elapsed = time.perf_counter() - search.t0
    return BatchSearch(
        found, found, pick, headroom, limit, budget_bytes, search.trials, elapsed, global_batch=found
    )


def _check_search(pick: str, headroom: float, start: int, max_micro: int) -> None:
    if pick not in BATCH_PICKS:
        raise choice_error("batch.pick", pick, BATCH_PICKS)
    if headroom < 0 or headroom >= 1:
        raise ConfigError(f"batch.headroom = {headroom!r} must be in [0, 1), a fraction of the measured peak")
    if start < 1 or max_micro < start:
        raise ConfigError(f"the batch-size search needs 1 <= start ({start}) <= max_micro ({max_micro})")


@dataclass
class _Search:
    """The sizes tried so far and how to try the next (:func:`find_batch_size`)."""

    trial: Trial
    budget_bytes: int | None
    predict: bool
    max_step_s: float
    agree: Callable[[int], int]
    trials: list[TrialRecord] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)

    def _run(self, record: TrialRecord, fitting: list[TrialRecord]) -> None:
        try:
            result = self.trial(record.micro)
        except RuntimeError as exc:
            if not is_oom(exc):
                raise
            record.reason = "out of memory"
            return
        record.peak_bytes, record.step_s = int(result.peak_bytes), float(result.step_s)
        record.fits = self.budget_bytes is None or result.peak_bytes <= self.budget_bytes
        record.reason = "" if record.fits else "over budget"
        # the first size always counts
        if record.fits and self.max_step_s and fitting and record.step_s > self.max_step_s:
            record.fits = False
            record.reason = f"over the step-time budget ({record.step_s:.2f} s > {self.max_step_s:g} s)"

    def attempt(self, micro: int) -> bool:
        record = TrialRecord(micro, False)
        fitting = [t for t in self.trials if t.fits]
        budget = self.budget_bytes
        expected = (
            _interpolate(micro, fitting)
            if self.predict and budget is not None and len(fitting) >= 2
            else None
        )
        if expected is not None and budget is not None and expected > budget:
            record.reason = "over budget (predicted, not run)"
        else:
            self._run(record, fitting)
        if self.agree(int(record.fits)) == 0 and record.fits:
            record.fits, record.reason = False, "another rank ran out of memory"
        self.trials.append(record)
        measured = (f", {record.step_s:.2f} s a step" if record.step_s is not None else "") + (
            f", peak {gib(record.peak_bytes):.2f} GiB" if record.peak_bytes is not None else ""
        )
        # one line per size: a long search shows it is alive
        log.info(
            "batch finder: micro-batch %d %s%s (%.0f s so far)",
            micro,
            "fits" if record.fits else record.reason,
            measured,
            time.perf_counter() - self.t0,
        )
        return record.fits

    def grow(self, micro: int, max_micro: int, slowdown_stop: float) -> tuple[int, int]:
        """Double from ``micro``: (the last size that fits or 0, the first that does not or 0)."""
        lo = hi = 0
        while True:
            if not self.attempt(micro):
                return lo, micro
            last, best = self.trials[-1], max(t.samples_per_s for t in self.trials if t.fits)
            if slowdown_stop and last.samples_per_s < slowdown_stop * best:
                last.fits, last.reason = False, f"slower (under {slowdown_stop:.0%} of the best samples/s)"
                return lo, hi  # a ceiling from speed, not memory: no binary search above it
            lo = micro
            if micro >= max_micro:
                return lo, hi
            micro = min(2 * micro, max_micro)

    def bisect(self, lo: int, hi: int, multiple_of: int) -> None:
        """Binary search between the last success and the first failure."""
        while hi:
            grid = multiple_of if lo >= multiple_of else 1
            if hi - lo <= grid:
                return
            mid = lo + max(grid, (hi - lo) // 2 // grid * grid)
            if mid >= hi:
                return
            if self.attempt(mid):
                lo = mid
            else:
                hi = mid


def _choose(
    fitting: list[TrialRecord],
    largest: int,
    limit: int | None,
    headroom: float,
    pick: str,
    multiple_of: int,
    max_micro: int,
) -> int:
    """The answer: the fastest tried size within the headroom, or the largest size (a multiple
    of 8 from 8 up, unless it is the ceiling itself) whose interpolated peak keeps the headroom."""
    target = None if limit is None else limit / (1.0 + headroom)  # None: no memory limit was met
    if pick == "fastest":
        within = [t for t in fitting if target is None or (t.peak_bytes or 0) <= target]
        if within:
            return max(within, key=lambda t: (t.samples_per_s, t.micro)).micro
    if target is None:
        return largest

    def keeps_headroom(micro: int) -> bool:
        peak = _interpolate(micro, fitting)
        return peak is not None and peak <= target

    # the ceiling (data, or the per-rank global batch) may be any number
    if largest == max_micro and keeps_headroom(largest):
        return largest
    grid = multiple_of if largest >= multiple_of else 1
    # multiples of 8 down from the largest, then the small sizes
    candidates = [*range(largest // grid * grid, grid - 1, -grid), *range(grid - 1, 0, -1)]
    # none: less headroom than asked, the smallest that ran
    return next((c for c in candidates if keeps_headroom(c)), min(t.micro for t in fitting))


def plan_accumulation(
    found: int, global_size: int, accumulation: int, world: int = 1
) -> tuple[int, int, int, str]:
    """(micro, accumulation, global batch, note) for a per-rank micro-batch of at most ``found``.

    ``global_size`` 0 keeps ``accumulation`` and lets the global batch follow the found size.
    Otherwise global = micro x accumulation x world exactly, with the smallest accumulation
    whose equal split keeps the micro-batch at least half of ``found``; when no such split exists
    the nearest larger global batch is used, and the note says so.
    """
    if global_size <= 0:
        return found, accumulation, found * accumulation * world, ""
    notes = []
    per_rank = -(-global_size // world)
    if per_rank * world != global_size:
        notes.append(
            f"global batch {global_size} is not divisible by {world} ranks; each rank takes {per_rank}"
        )
    if per_rank <= found:
        micro, acc = per_rank, 1
    else:
        acc_min = -(-per_rank // found)
        exact = [a for a in range(acc_min, 2 * acc_min + 1) if per_rank % a == 0]
        if exact:
            acc = exact[0]
            micro = per_rank // acc
        else:
            acc = acc_min
            micro = -(-per_rank // acc)
            notes.append(
                f"{per_rank} sequences per rank do not split into equal micro-batches of at most {found}"
            )
    total = micro * acc * world
    if total != global_size:
        notes.append(
            f"training with global batch {total} = {micro} x {acc} x {world} instead of {global_size}"
        )
    return micro, acc, total, "; ".join(notes)


def usable_memory_bytes(
    device: torch.device, max_memory_gib: float = 0.0, max_memory_fraction: float = 0.0
) -> int | None:
    """The memory a search may fill, in bytes: on CUDA what is free plus what this process
    already holds; on CPU the available RAM; capped by ``max_memory_gib`` (GiB) and by
    ``max_memory_fraction`` of the device's total. None where nothing is known (meta)."""
    total, budget = ram_bytes() if device.type == "cpu" else (None, None)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free + torch.cuda.memory_reserved(device))
    caps = [budget] if budget is not None else []
    if max_memory_gib > 0:
        caps.append(int(max_memory_gib * GIB))
    if max_memory_fraction > 0:
        if not max_memory_fraction <= 1:
            raise ConfigError(f"batch.max_memory_fraction = {max_memory_fraction} must be in (0, 1]")
        if total is not None:
            caps.append(int(max_memory_fraction * total))
    return min(caps) if caps else None
