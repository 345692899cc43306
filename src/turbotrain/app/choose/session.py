"""``choose``: settings left at ``auto`` decided by measuring candidate recipes on the run's own
model before it trains (docs/choose.md), each one short run through :mod:`turbotrain.app.measure`."""

from __future__ import annotations

import json
import logging
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...base.atomic import atomic_write
from ...base.config import RunConfig, to_toml
from ...base.errors import TurbotrainError, TurbotrainWarning
from ...base.failure import one_line
from ...base.rundir import CHOOSE_FILE, CHOOSE_MD
from ...core.device import resolve_device
from ...core.meter import cache as meter_cache
from ...core.precision import DeviceCaps, resolve_precision
from ..measure import Target, measure_once
from ..prepare import Begun, PreparedRun
from ..regime import CPU_LINE, Regime, classify, probe_of
from . import cache
from .rule import (
    PROBE_KEYS,
    Candidate,
    Decision,
    Row,
    auto_fields,
    format_table,
    judge,
    stage1,
    stage2,
    too_short,
    worth_measuring,
)

log = logging.getLogger(__name__)

MeasureFn = Callable[[Candidate], dict[str, Any]]  # a candidate -> measure.run's figures


def probe_run(
    target: Target, changes: Mapping[str, Mapping[str, Any]] | None, run_dir: Path
) -> tuple[Regime, dict[str, Any]]:
    """A short run of the real step (3 warm-up + 5 steps, then the timeline on CUDA) and its regime."""
    figures = measure_once(target, changes, run_dir, 3, 5, timeline=True)
    return classify(probe_of(figures)), figures


def _written(config: RunConfig, folder: Path) -> Target:
    """``config`` as a Target: its config.toml written in ``folder``, the run's workload."""
    atomic_write(folder / "config.toml", to_toml(config))
    return Target(preset=str(folder / "config.toml"), model=config.model.workload or None)


def measure_in_process(config: RunConfig, work_dir: Path) -> MeasureFn:
    """Measure candidates of ``config`` in this process, each with a fresh model from the run's seed."""
    target = _written(config, work_dir)

    def measure(c: Candidate) -> dict[str, Any]:
        folder = work_dir / c.name.replace(" ", "-").replace("/", "-").replace("(", "").replace(")", "")
        # "bf16 on a CPU may be slow": we measure it
        with warnings.catch_warnings(action="ignore", category=TurbotrainWarning):
            try:
                # plus the regime's device timeline on CUDA (3 more steps there)
                return measure_once(
                    target, c.changes, folder, config.choose.warmup, config.choose.steps, timeline=True
                )
            finally:
                if c.compiles:  # its graphs belong to a model that is gone; the on-disk caches stay warm
                    torch.compiler.reset()

    return measure


def choose(
    config: RunConfig,
    *,
    measure: MeasureFn | None = None,
    device: torch.device | None = None,
    say: Callable[[str], None] = print,
    planned: int | None = None,
) -> Decision | None:
    """Decide the run's ``auto`` settings by measurement; None when ``choose.measure = off`` or no
    setting is left at ``auto``. ``planned``: the run's resolved length, else ``train.max_steps``."""
    c = config.choose
    if _nothing_to_choose(config):
        return None
    device = device or resolve_device(config.run.device)
    material = cache.key_material(config, device)
    key = meter_cache.key_of(material)
    path = cache.cache_dir(config) / f"{key}.json"  # {candidate name: figures}
    cached = meter_cache.read(path, cache.WHAT, material, cache.checked_rows) or {}
    planned = planned or config.train.max_steps
    decision = Decision(changes={}, planned_steps=planned, key=key)
    first = stage1(config, device.type, resolve_precision("auto", DeviceCaps.of(device)))
    # the baseline plus at least one more to time (a compile candidate when stage 1 has only
    # eager): the threshold a default run meets does not fall when the precision is not questioned
    why = too_short(planned, max(len(first), 2), c.warmup, c.steps, c.budget)
    if c.measure == "auto" and first[0].name not in cached and why:
        decision.summary = (
            f"fixed rules kept, nothing measured: {why} (choose.measure = always measures anyway)"
        )
        return decision
    with tempfile.TemporaryDirectory(prefix="turbotrain-choose-") as tmp:
        m = _Measuring(cached, measure or measure_in_process(config, Path(tmp)), decision, say)
        rows = [m.figures(Row.of(cand), cand) for cand in first]
        base = rows[0]
        if not base.measured:
            decision.summary = f"fixed rules kept: plain eager could not be measured ({base.reason})"
            decision.rows = rows
            say(f"choose: {decision.summary}")
            return decision
        m.stage2(config, device.type, rows)
        _keep(decision, rows, judge(rows, planned, c.min_speedup), planned)
    fresh = {  # what this process measured, failures included
        r.name: {"failed": r.reason} if r.status == "failed" else {**r.figures(), "measure_s": r.measure_s}
        for r in rows
        if r.status != "skipped" and not r.cached
    }
    saved = meter_cache.write(path, cache.WHAT, material, {**cached, **fresh}) if fresh else path
    decision.cache = str(saved or "")
    return decision


def _nothing_to_choose(config: RunConfig) -> bool:
    """``choose.measure = off``, or no setting left at auto (then ``always`` is one warning: a
    setting that does nothing here, which a preset may carry)."""
    c = config.choose
    if c.measure != "off" and auto_fields(config):
        return False
    if c.measure == "always":
        warnings.warn(
            "choose.measure = always does nothing in this run: no setting is left at auto "
            "(compile.scope and precision.mode are set), so nothing is measured",
            TurbotrainWarning,
            stacklevel=3,
        )
    return True


def _keep(decision: Decision, rows: list[Row], best: Row, planned: int) -> None:
    """``best``'s changes and the summary into ``decision``; compile.scope left to its fixed rule
    when no compiled candidate was timed."""
    decision.rows, decision.changes = rows, {k: dict(v) for k, v in best.changes.items()}
    decision.summary = f"kept {best.name} ({best.what}) for {planned:,d} steps: {best.reason}"
    plain = [r for r in rows if r.compiles and "mode" not in r.changes.get("compile", {})]  # no CUDA graphs
    if plain and not any(r.measured or r.status == "failed" for r in plain) and not best.compiles:
        # no compiled candidate was timed: compile.scope keeps its fixed rule (auto: model on CUDA, off on CPU)
        decision.changes.pop("compile", None)
        decision.summary += "; compile.scope not measured, left to its fixed rule (auto)"


@dataclass
class _Measuring:
    """The candidates' figures of one decision: the cache's, else timed by ``timer``."""

    cached: dict[str, Any]
    timer: MeasureFn
    decision: Decision
    say: Callable[[str], None]

    def stage2(self, config: RunConfig, device_type: str, rows: list[Row]) -> None:
        """Stage 2's compiled candidates (in stage 1's best precision) appended to ``rows``: measured,
        or skipped when their first step would not fit the budget."""
        c, planned, eager_ms = config.choose, self.decision.planned_steps, rows[0].step_ms
        assert eager_ms is not None
        for cand in stage2(config, device_type, judge(rows, planned, c.min_speedup)):
            row, why = Row.of(cand), ""
            if cand.name not in self.cached and c.measure != "always":
                why = worth_measuring(cand, eager_ms, planned, c.warmup, c.steps, c.budget, device_type)
            if why:
                row.status, row.reason = "skipped", why
            else:
                self.figures(row, cand)
            rows.append(row)

    def figures(self, row: Row, cand: Candidate) -> Row:
        """Fill ``row`` from the cache, else by measuring ``cand`` (a failure is one line in the row)."""
        hit = self.cached.get(cand.name)
        if hit is not None:
            row.cached = True
            if "failed" in hit:
                row.status, row.reason = "failed", str(hit["failed"])
            else:
                row.set_figures(hit)
                row.measure_s = hit.get("measure_s")
            return row
        self.say(f"choose: measuring {cand.name} ({cand.what}) ...")
        t0 = time.perf_counter()
        try:
            row.set_figures(self.timer(cand))
        except (TurbotrainError, RuntimeError, ValueError) as exc:  # a refused setting, a failing compile
            row.status, row.reason = "failed", one_line(exc)
        row.measure_s = time.perf_counter() - t0
        self.decision.measure_s += row.measure_s
        self.decision.measured = True
        return row


def choose_for_run(config: RunConfig, run_dir: Path, **options: Any) -> RunConfig:
    """``config`` with the settings :func:`decide_for_run` (its ``options``) chooses."""
    return apply(config, decide_for_run(config, run_dir, **options))


def decide_for_run(
    config: RunConfig,
    run_dir: Path,
    say: Callable[[str], None] = print,
    measure: MeasureFn | None = None,
    planned: int | None = None,
) -> Decision | None:
    """What ``turbotrain train`` decides for a new run (one process): decide, show the table, write
    it to the run directory and name the run's regime."""
    decision = choose(config, measure=measure, say=say, planned=planned)
    if decision is None:
        log.debug("%s", name_regime(config, None))
        return None
    if decision.rows:  # a table only when something was weighed
        say("\n".join(format_table(decision)))
    regime = name_regime(apply(config, decision), decision)
    # the reasons (nothing measured, the regime) at debug level and in choose.json / summary.md
    if not decision.rows:  # too short to pay for measuring
        log.debug("choose: %s", decision.summary)
    (say if decision.regime else log.debug)(regime)  # named from figures measured: said below the table
    decision.regime = {**(decision.regime or {}), "line": regime}
    atomic_write(run_dir / CHOOSE_FILE, json.dumps(decision.to_dict(), indent=2, default=str) + "\n")
    atomic_write(run_dir / CHOOSE_MD, "\n".join(format_table(decision)) + "\n")
    return decision


def at_start(prepared: PreparedRun, settings: RunConfig) -> Begun:
    """choose as a start hook of ``train``'s preparation (before the generators are seeded); a
    resume never measures again (config.toml keeps the choice)."""
    if prepared.resume or prepared.plan.world > 1:
        return Begun()
    decision = decide_for_run(prepared.config, prepared.run_dir, planned=settings.train.max_steps)
    return Begun(decision.changes if decision is not None else {})


# a shorter run is not probed: the probe's build and steps would cost more than it tells
PROBE_MIN_STEPS = 100


def name_regime(config: RunConfig, decision: Decision | None) -> str:
    """The run's regime in one line (app/regime.py): from choose's figures of the kept recipe (no
    cost); else on CUDA one short probe of the run's step; on a CPU, where launch and compute cannot
    be told apart, the caveat alone."""
    rows = decision.rows if decision is not None else []
    row = next((r for r in rows if r.status == "kept" and r.measured), None)
    row = row or next((r for r in rows if r.measured), None)  # the kept recipe unmeasured: the baseline's
    if row is not None and row.step_ms is not None:
        regime = classify(probe_of({**row.probe, "step_ms_median": row.step_ms}))
        assert decision is not None
        decision.regime = {"name": regime.name, "why": regime.why}
        return f"{regime.line()} [choose's figures of {row.name}]"
    if resolve_device(config.run.device).type != "cuda":
        return CPU_LINE
    if config.choose.measure == "off":
        return "regime: not probed (choose.measure = off: nothing is measured before the run)"
    if config.train.max_steps < PROBE_MIN_STEPS:
        return f"regime: not probed (a run of {config.train.max_steps} steps: the probe would cost more than it tells)"
    with tempfile.TemporaryDirectory(prefix="turbotrain-regime-") as tmp:
        probe = probe_line(_written(config, Path(tmp)), None, Path(tmp) / "run", "a probe of the run's step")
        return probe["line"]


def probe_line(
    target: Target, changes: Mapping[str, Mapping[str, Any]] | None, run_dir: Path, label: str
) -> dict[str, Any]:
    """One short probe of ``target``'s step as the regime's line, name, why and figures; a probe
    that fails is one line (the run or check itself will say it better)."""
    try:
        regime, figures = probe_run(target, changes, run_dir)
    except (TurbotrainError, RuntimeError, ValueError) as exc:
        return {"line": f"regime: not probed ({one_line(exc)})"}
    finally:
        torch.compiler.reset()  # what the probe compiled belongs to a model that is gone (disk caches stay warm)
    kept = {k: figures.get(k) for k in ("step_ms_median", *PROBE_KEYS, "launch_queue_full")}
    return {"line": f"{regime.line()} [{label}]", "name": regime.name, "why": regime.why, "figures": kept}


def doctor_regime(preset: str | None, model: str | None) -> dict[str, Any]:
    """``doctor --model``'s regime: on CUDA one short probe of the model's step in eager (whether
    launches or kernels hold the step, which compile and CUDA graphs answer); on a CPU the caveat."""
    if not torch.cuda.is_available():
        return {"line": CPU_LINE}
    eager = {"compile": {"scope": "off"}, "choose": {"measure": "off"}}
    label = "a probe of 8 eager steps and 3 on the device timeline"
    with tempfile.TemporaryDirectory(prefix="turbotrain-regime-") as tmp:
        return probe_line(Target(preset=preset, model=model), eager, Path(tmp), label)


def apply(config: RunConfig, decision: Decision | None) -> RunConfig:
    """``config`` with the decision's changes (unchanged without one)."""
    return config if decision is None or not decision.changes else config.replace(**decision.changes)
