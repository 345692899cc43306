"""``choose``: settings left at ``auto`` decided by measuring candidate recipes on the run's own
model before it trains (the rule: :mod:`.rule`; the cache: :mod:`.cache`).

Each candidate is one short run of the user's config with the candidate's changes, through
:func:`turbotrain.app.measure.measure_once` (the bench protocol's clock: warm-up, then the
median timed step; the loss on fixed held-out batches for parity): no second harness. The
measurements are cached under the key of what makes them valid; the next run of the same model
reuses them (and only measures a candidate it has no figures for, when that fits its budget).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...base.atomic import atomic_write
from ...base.config import RunConfig, to_toml
from ...base.errors import TurbotrainError, TurbotrainWarning
from ...base.rundir import CHOOSE_FILE, CHOOSE_MD
from ...core.device import resolve_device
from ...core.precision import DeviceCaps, resolve_precision
from ..measure import Target, measure_once
from . import cache
from .rule import (
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


def measure_in_process(config: RunConfig, work_dir: Path) -> MeasureFn:
    """Measure candidates of ``config`` in this process, each with a fresh model from the run's
    seed (``choose.warmup`` untimed and ``choose.steps`` timed steps), in ``work_dir``."""
    toml = work_dir / "config.toml"
    atomic_write(toml, to_toml(config))
    target = Target(preset=str(toml), model=config.model.workload or None)

    def measure(c: Candidate) -> dict[str, Any]:
        folder = work_dir / c.name.replace(" ", "-").replace("/", "-").replace("(", "").replace(")", "")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TurbotrainWarning)  # "bf16 on a CPU may be slow": we measure it
            try:
                return measure_once(target, c.changes, folder, config.choose.warmup, config.choose.steps)
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
) -> Decision | None:
    """Decide the run's ``auto`` settings by measurement; None when ``choose.measure = off`` or no
    setting is left at ``auto``. ``measure`` (injectable for tests) times one candidate."""
    c = config.choose
    if c.measure == "off" or not auto_fields(config):
        return None
    device = device or resolve_device(config.run.device)
    material = cache.key_material(config, cache.device_name(device))
    key = cache.key_of(material)
    folder = cache.cache_dir(config)
    cached = cache.load(folder, key, material) or {}
    planned = config.train.max_steps
    decision = Decision(changes={}, planned_steps=planned, key=key)
    first = stage1(config, device.type, resolve_precision("auto", DeviceCaps.of(device)))
    if c.measure == "auto" and first[0].name not in cached:
        # the baseline plus at least one more to time (a compile candidate when stage 1 has only
        # eager): the threshold a default run meets does not fall when the precision is not questioned
        why = too_short(planned, max(len(first), 2), c.warmup, c.steps, c.budget)
        if why:
            decision.summary = (
                f"fixed rules kept, nothing measured: {why} (choose.measure = always measures anyway)"
            )
            return decision
    with tempfile.TemporaryDirectory(prefix="turbotrain-choose-") as tmp:
        timer = measure or measure_in_process(config, Path(tmp))
        rows = [_figures(Row.of(cand), cand, cached, timer, decision, say) for cand in first]
        base = rows[0]
        if not base.measured:
            decision.summary = f"fixed rules kept: plain eager could not be measured ({base.reason})"
            decision.rows = rows
            say(f"choose: {decision.summary}")
            return decision
        best = judge(rows, planned, c.min_speedup)
        assert base.step_ms is not None
        for cand in stage2(config, device.type, best):
            row = Row.of(cand)
            why = (
                ""
                if cand.name in cached or c.measure == "always"
                else worth_measuring(cand, base.step_ms, planned, c.warmup, c.steps, c.budget, device.type)
            )
            if why:
                row.status, row.reason = "skipped", why
            else:
                _figures(row, cand, cached, timer, decision, say)
            rows.append(row)
        best = judge(rows, planned, c.min_speedup)
    decision.rows, decision.changes = rows, {k: dict(v) for k, v in best.changes.items()}
    decision.summary = f"kept {best.name} ({best.what}) for {planned:,d} steps: {best.reason}"
    compiled = [r for r in rows if r.compiles]
    plain = [r for r in compiled if "mode" not in r.changes.get("compile", {})]  # compile without CUDA graphs
    if plain and not any(r.measured or r.status == "failed" for r in plain) and not best.compiles:
        # no compiled candidate was timed: compile.scope keeps its fixed rule (auto: model on CUDA, off on CPU)
        decision.changes.pop("compile", None)
        decision.summary += "; compile.scope not measured, left to its fixed rule (auto)"
    fresh = {r.name: _cached_form(r) for r in rows if r.status != "skipped" and not r.cached}
    if fresh:
        saved = cache.save(folder, key, material, {**cached, **fresh})
        decision.cache = str(saved or "")
    else:
        decision.cache = str(folder / f"{key}.json")
    return decision


def _cached_form(r: Row) -> dict[str, Any]:
    if r.status == "failed":
        return {"failed": r.reason}
    return {**r.figures(), "measure_s": r.measure_s}


def _figures(
    row: Row,
    cand: Candidate,
    cached: dict[str, Any],
    timer: MeasureFn,
    decision: Decision,
    say: Callable[[str], None],
) -> Row:
    """Fill ``row`` from the cache, else by measuring ``cand`` (a failure is one line in the row)."""
    hit = cached.get(cand.name)
    if hit is not None:
        row.cached = True
        if "failed" in hit:
            row.status, row.reason = "failed", str(hit["failed"])
        else:
            row.set_figures(hit)
            row.measure_s = hit.get("measure_s")
        return row
    say(f"choose: measuring {cand.name} ({cand.what}) ...")
    t0 = time.perf_counter()
    try:
        row.set_figures(timer(cand))
    except (TurbotrainError, RuntimeError, ValueError) as exc:  # a refused setting, a failing compile
        row.status, row.reason = "failed", f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    row.measure_s = time.perf_counter() - t0
    decision.measure_s += row.measure_s
    decision.measured = True
    return row


def write_decision(run_dir: Path, decision: Decision) -> None:
    """The decision table in the run directory: choose.json (everything) and choose.md."""
    atomic_write(run_dir / CHOOSE_FILE, json.dumps(decision.to_dict(), indent=2, default=str) + "\n")
    atomic_write(run_dir / CHOOSE_MD, "\n".join(format_table(decision)) + "\n")


def choose_for_run(config: RunConfig, run_dir: Path, say: Callable[[str], None] = print) -> RunConfig:
    """What ``turbotrain train`` calls for a new run (one process): decide, show the table, write
    it to the run directory, and return the config with the chosen settings."""
    decision = choose(config, say=say)
    if decision is None:
        return config
    if not decision.rows:  # a run too short to pay for measuring: one log line, no file
        log.info("choose: %s", decision.summary)
        return config
    say("\n".join(format_table(decision)))
    write_decision(run_dir, decision)
    return apply(config, decision)


def apply(config: RunConfig, decision: Decision | None) -> RunConfig:
    """``config`` with the decision's changes (unchanged without one)."""
    if decision is None or not decision.changes:
        return config
    return config.replace(**decision.changes)
