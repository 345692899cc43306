"""Tune trials as processes: ``python -m turbotrain.app.tune.trial`` under a timeout, its progress
events read while it runs. The study talks to a :class:`Runner` (tests use a simulated one)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ...base.errors import TurbotrainError
from ...base.failure import cause_in_log
from ...base.process import child_env
from ..measure import Target, run_child


@dataclass
class TuneOptions:
    """Trials to run and how each is measured (steps are optimizer steps)."""

    trials: int = 20
    warmup: int = 5
    steps: int = 30
    window: int = 10  # timed steps per intermediate value reported to the pruner
    timeout_s: float = 600.0
    prune: bool = True
    confirm: int = 2  # interleaved re-measurements of the best and the baseline at the end (0 = none)
    threads: int = 0  # CPU threads per trial process (0 = torch's default)
    seed: int = 0


@dataclass
class Outcome:
    """How a trial process ended: ``status`` ok / oom / invalid / failed / timeout / pruned /
    over budget; ``result`` the figures it wrote (partial or empty when stopped)."""

    status: str
    result: dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    peak_bytes: int | None = None
    budget_bytes: int | None = None
    windows: list[float] = field(default_factory=list)


TRIAL = "turbotrain.app.tune.trial"
Changes = dict[str, dict[str, Any]]
Report = Callable[[int, float], bool]  # (window, throughput) -> prune now
OverBudget = Callable[[int, int | None], bool]  # (peak bytes, budget bytes) -> stop now


class Runner(Protocol):
    def measure(self, name: str, changes: Changes, report: Report, over_budget: OverBudget) -> Outcome: ...

    def find(self, changes: Changes) -> dict[str, Any]: ...


class ProcessRunner:
    """Each trial as ``python -m turbotrain.app.tune.trial`` in ``run_dir/trials/NAME``, its progress read live."""

    def __init__(
        self, target: Target, run_dir: Path, options: TuneOptions, status: Callable[[str], None]
    ) -> None:
        self.target, self.run_dir, self.options, self.status = target, run_dir, options, status

    def _spawn(
        self, name: str, spec: dict[str, Any], poll: Callable[[list[dict[str, Any]]], str]
    ) -> tuple[int | None, str, Path, dict[str, Any] | None]:
        folder = self.run_dir / "trials" / name
        progress = folder / "progress.jsonl"
        folder.mkdir(parents=True, exist_ok=True)
        progress.unlink(missing_ok=True)
        progress.touch()
        seen, stop = 0, ""

        def check() -> bool:
            nonlocal seen, stop
            text = progress.read_text()
            lines = text.splitlines()
            complete = lines if text.endswith("\n") else lines[:-1]
            events = [json.loads(line) for line in complete[seen:]]
            seen = len(complete)
            stop = poll(events) if events else ""
            return bool(stop)

        env = child_env(threads=self.options.threads, compile_cache=self.run_dir / "compile-cache")
        spec, args = {**spec, "run_dir": str(folder)}, ("--progress", str(progress))
        code, result, _ = run_child(TRIAL, folder, spec, env, self.options.timeout_s, *args, poll=check)
        if code is not None and not stop and progress.exists():
            check()  # events written just before it exited
        return code, stop, folder, result

    def measure(self, name: str, changes: Changes, report: Report, over_budget: OverBudget) -> Outcome:
        o = self.options
        spec = {
            "mode": "measure",
            "target": self.target.to_dict(),
            "changes": changes,
            "warmup": o.warmup,
            "steps": o.steps,
            "window": o.window,
        }
        out = Outcome("failed")

        def poll(events: list[dict[str, Any]]) -> str:
            for e in events:
                if e["event"] == "memory" and e.get("peak_bytes") is not None:
                    out.peak_bytes, out.budget_bytes = int(e["peak_bytes"]), e.get("budget_bytes")
                    if over_budget(out.peak_bytes, out.budget_bytes):
                        return "over budget"
                elif e["event"] == "window":
                    out.windows.append(float(e["throughput"]))
                    self.status(f"{name}: window {e['k']}: {e['throughput']:,.0f}/s")
                    if report(int(e["k"]), float(e["throughput"])):
                        return "pruned"
            return ""

        code, stop, folder, result = self._spawn(name, spec, poll)
        log = folder / "log.txt"
        if stop:
            out.status, out.reason = stop, ""
        elif code is None:
            out.status, out.reason = "timeout", f"ran past {o.timeout_s:g} s (--trial-timeout-s)"
        elif result is not None:
            out.result = result
            out.status, out.reason = out.result.get("status", "failed"), out.result.get("reason", "")
            out.peak_bytes = out.result.get("peak_bytes", out.peak_bytes)
            out.budget_bytes = out.result.get("budget_bytes", out.budget_bytes)
        else:  # it died without a word of its own: the cause is in its log (the last line is often a warning's source)
            out.status, out.reason = (
                "failed",
                f"{cause_in_log(log.read_text(errors='replace'), code)} (see {log})",
            )
        return out

    def find(self, changes: Changes) -> dict[str, Any]:
        spec = {"mode": "find", "target": self.target.to_dict(), "changes": changes}
        code, _, folder, found = self._spawn("batch-finder", spec, lambda events: "")
        if code is None or found is None:
            raise TurbotrainError(
                f"tune: the batch finder run failed or timed out (see {folder / 'log.txt'}); "
                "fix the batch size with --batch.micro=N"
            )
        if found.get("status") != "ok":
            raise TurbotrainError(
                f"tune: the batch finder run ended with {found.get('status')}: {found.get('reason')}"
            )
        return found
