"""Compile guard: torch.compile's recompilations and graph breaks during training (silent unless
``TORCH_LOGS``), counted from dynamo's own bookkeeping (no per-step cost, no sync), with a warning
naming the cause when they keep happening after warm-up.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..base.failure import first_line

log = logging.getLogger(__name__)

REASON_CHARS = 200  # a reason is cut to its first line and this many characters
_WARM_START: list[str] = []  # what the compile warm start did in this process (app/warmstart.py)


def record_warm_start(note: str) -> None:
    """Keep the warm start's one line for the run's summary (``compile.warm_start``)."""
    _WARM_START[:] = [note]


def compile_seconds() -> float:
    """Seconds dynamo has spent compiling frames in this process (its own timers); 0 without dynamo."""
    utils = sys.modules.get("torch._dynamo.utils")
    spent = getattr(utils, "calculate_time_spent", None) if utils is not None else None
    if spent is None:
        return 0.0
    times = spent()
    return float(times.get("total_wall_time", times.get("entire_frame_compile", 0.0)))


def payback_step(compile_s: float | None, eager_ms: float | None, compiled_ms: float | None) -> int | None:
    """The step at which compiling has paid back ``compile_s``; None when it never does."""
    if compile_s is None or eager_ms is None or compiled_ms is None or compiled_ms >= eager_ms:
        return None
    return int(round(1000 * compile_s / (eager_ms - compiled_ms))) + 1


def _guard_reason(text: str) -> str:
    """``'0/0: s.scale == 0.0   # file:8 in forward ...'`` -> ``'s.scale == 0.0 (file:8 in forward)'``."""
    line = first_line(text, "unknown")[:REASON_CHARS]
    head, _, where = line.partition("#")
    head = head.split(": ", 1)[-1].strip() if head[:1].isdigit() else head.strip()
    where = where.strip().lstrip("#").strip()
    return f"{head} ({where})" if where else head


def _first_entry(reason: str) -> bool:
    """Whether a guard-failure reason is a frame's first cached graph's: one per recompilation."""
    cid = str(reason).split(":", 1)[0].strip("[]! ")
    _, _, nth = cid.partition("/")
    return nth.split("_", 1)[0] == "0"


@dataclass(frozen=True)
class CompileCounts:
    """A snapshot of dynamo's counters: frames compiled, recompile and graph-break reasons, counted."""

    frames: int = 0
    recompile_reasons: dict[str, int] = field(default_factory=dict)
    break_reasons: dict[str, int] = field(default_factory=dict)

    @property
    def recompiles(self) -> int:
        return sum(self.recompile_reasons.values())

    @property
    def graph_breaks(self) -> int:
        return sum(self.break_reasons.values())

    def minus(self, base: CompileCounts) -> CompileCounts:
        """What happened since ``base`` (counters only grow)."""

        def less(now: dict[str, int], then: dict[str, int]) -> dict[str, int]:
            return {k: v - then.get(k, 0) for k, v in now.items() if v > then.get(k, 0)}

        return CompileCounts(
            self.frames - base.frames,
            less(self.recompile_reasons, base.recompile_reasons),
            less(self.break_reasons, base.break_reasons),
        )


def collect_compile_counts() -> CompileCounts:
    """dynamo's counters now (zero when dynamo was never imported); host dictionaries only."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return CompileCounts()
    counters = utils.counters
    recompiles: Counter[str] = Counter()
    for failures in list(getattr(utils, "guard_failures", {}).values()):
        for reason in list(failures):
            if _first_entry(reason):  # one per recompilation (each checks every cached graph)
                recompiles[_guard_reason(reason)] += 1
    breaks: Counter[str] = Counter()
    for reason, count in list(counters["graph_break"].items()):
        breaks[first_line(reason, "unknown")[:REASON_CHARS]] += int(count)
    return CompileCounts(int(counters["frames"].get("ok", 0)), dict(recompiles), dict(breaks))


def ranked_reasons(reasons: dict[str, int], limit: int = 5) -> list[str]:
    """``"3x reason"`` lines, most frequent first."""
    return [f"{n}x {r}" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:limit]]


def _top(reasons: dict[str, int]) -> str:
    reason, count = max(reasons.items(), key=lambda kv: kv[1])
    return f"{reason!r} ({count}x)"


class CompileGuard:
    """Counts recompilations and graph breaks since :meth:`start`; warns once, naming the top cause,
    past ``max_recompiles`` (0: never) after the first ``warmup_steps`` steps."""

    def __init__(self, max_recompiles: int = 2, warmup_steps: int = 10) -> None:
        self.max_recompiles, self.warmup_steps = max_recompiles, warmup_steps
        self.start()

    def start(self) -> None:
        """Count from now on (the engine calls it when it sets a model up)."""
        self.base = collect_compile_counts()
        self.base_compile_s = compile_seconds()
        self.at_warmup: CompileCounts | None = None
        self.warning = ""
        self._frames_seen = -1  # dynamo's frame count at the last check

    def since_start(self) -> CompileCounts:
        return collect_compile_counts().minus(self.base)

    def check(self, step: int) -> str:
        """Every few steps: the warning (logged once) when recompilations keep happening, else ""."""
        utils = sys.modules.get("torch._dynamo.utils")
        if self.warning or utils is None:
            return self.warning
        frames = int(utils.counters["frames"].get("total", 0))
        if frames == self._frames_seen and self.at_warmup is not None:
            return ""
        self._frames_seen = frames
        now = self.since_start()
        if step <= self.warmup_steps or self.at_warmup is None:
            if step >= self.warmup_steps:
                self.at_warmup = now
            return ""
        after = now.minus(self.at_warmup)
        if not self.max_recompiles or after.recompiles + after.graph_breaks <= self.max_recompiles:
            return ""
        causes = []
        if after.recompile_reasons:
            causes.append(f"guard failed: {_top(after.recompile_reasons)}")
        if after.break_reasons:
            causes.append(f"graph break: {_top(after.break_reasons)}")
        self.warning = (
            f"torch.compile recompiled {after.recompiles} time(s) and broke the graph {after.graph_breaks} time(s) "
            f"between step {self.warmup_steps} and step {step}; {'; '.join(causes) or 'cause not recorded'}. "
            "Keep shapes and Python numbers seen by forward() fixed (pad to one length, pass changing numbers "
            "as tensors), or mark the dimension dynamic (torch._dynamo.mark_dynamic)"
        )
        log.warning("compile guard: %s", self.warning)
        return self.warning

    def summary(self) -> dict[str, Any]:
        """For summary.json: what was compiled since the start (and after warm-up), and why."""
        now = self.since_start()
        after = now.minus(self.at_warmup) if self.at_warmup is not None else None
        return {
            "frames_compiled": now.frames,
            "recompiles": now.recompiles,
            "recompiles_after_warmup": after.recompiles if after is not None else None,
            "graph_breaks": now.graph_breaks,
            "recompile_reasons": ranked_reasons(now.recompile_reasons),
            "graph_break_reasons": ranked_reasons(now.break_reasons),
            "warning": self.warning,
            "compile_s": round(compile_seconds() - self.base_compile_s, 3),
            "warm_start": _WARM_START[0] if _WARM_START else "",
        }
