"""One profile: a measured run with a torch.profiler window, the diagnosis, optional verification,
and its run folder (``trace.json.gz``, ``profile.json``, ``profile.md``, ``metrics.jsonl``, ``verify/``)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ...base.atomic import atomic_write
from ...base.failure import workload_failed
from ...base.rundir import new_run_dir
from ...core.meter.clock import median_of
from ...core.meter.parity import RECOMMEND_MIN_SPEEDUP, interleaved
from ...core.optim import resolve_implementation
from ...parts.hardware import device_name
from ..measure import Target, build, graph_break_reasons, measure_once, release, run
from ..regime import classify, probe_from, profiled_scale
from .advice import Advice, diagnose
from .render import render
from .syncs import SyncWindow
from .trace import ProfilerWindow, analyze

SCHEMA = "turbotrain-profile/1"
TRACE_FILE, JSON_FILE, MD_FILE = "trace.json.gz", "profile.json", "profile.md"


@dataclass(frozen=True)
class ProfileOptions:
    """Steps of each kind (``turbotrain profile --help``); ``verify``: ``repeats`` runs per variant."""

    warmup: int = 5
    timed: int = 20
    steps: int = 5
    verify: bool = False
    repeats: int = 3
    verify_warmup: int = 3
    verify_steps: int = 10


def profile_target(
    target: Target,
    options: ProfileOptions = ProfileOptions(),
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Profile ``target``; returns the report document, also written to the run folder."""
    config = target.config()
    name = config.run.name or f"profile-{target.label}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = new_run_dir(config.replace(run={"name": name}))
    with _failing_run(target, run_dir):
        built = build(target, None, run_dir)
    log(
        f"profiling {target.label}: {options.warmup} warm-up + {options.timed} timed + {options.steps} profiled steps ({run_dir})"
    )
    try:
        doc, advice = _profiled(target, built, options, run_dir)
    finally:
        release(built)
    if options.verify:
        doc["verify"] = _verify(target, advice, run_dir, options, log)
        doc["recommendations"] = [a.to_dict() for a in advice]
    atomic_write(run_dir / JSON_FILE, json.dumps(doc, indent=1, default=str) + "\n")
    atomic_write(run_dir / MD_FILE, render(doc) + "\n")
    return doc


def _profiled(
    target: Target, built: Any, options: ProfileOptions, run_dir: Path
) -> tuple[dict[str, Any], list[Any]]:
    """The measured run with its profiler and sync windows, and the report document of it."""
    with _failing_run(target, run_dir):
        timed = options.warmup + options.timed
        window = ProfilerWindow(built.engine.device, timed, options.steps)
        # the syncs are located in steps of their own: the locator's hooks slow every operator
        syncs = SyncWindow(built.engine.device, timed + options.steps, options.steps)
        figures = run(
            built, options.warmup, options.timed, extra_steps=2 * options.steps, hooks=[window, syncs]
        )
    trace = {**analyze(window), "syncs": syncs.report()}
    trace_path = window.export(run_dir / TRACE_FILE)
    bottleneck, advice = diagnose(built, figures, trace)
    loss = figures.get("final_loss")
    if not (loss is None or (isinstance(loss, (int, float)) and math.isfinite(loss))):
        # timings of a model that does not train: say so before anything else
        bottleneck = {"name": "non-finite loss", "text": NAN_TEXT.format(loss=loss)}
    doc = _document(built, figures, trace, trace_path)
    doc |= {"bottleneck": bottleneck, "recommendations": [a.to_dict() for a in advice], "verify": None}
    doc["regime"] = asdict(classify(probe_from(figures, trace, built.peak_tflops)))  # app/regime.py
    return doc, advice


CODE_CHANGE = {"status": "not verified", "reason": "a change to your code: apply it and profile again"}
NOT_RUN = {"status": "not verified", "reason": "interrupted before it ran"}


def _verify(
    target: Target, advice: list[Advice], run_dir: Path, o: ProfileOptions, log: Callable[[str], None]
) -> dict[str, Any]:
    """``--verify``: the baseline and each recommended setting run ``o.repeats`` times, interleaved (a
    burst of load hits all alike); a variant is kept when its median throughput is at least
    RECOMMEND_MIN_SPEEDUP x the baseline's. Fills ``a.verified`` for each recommendation and returns
    the baseline's runs; Ctrl-C reports what ran, the rest is unverified."""
    candidates = [a for a in advice if a.settings]
    for a in advice:
        if not a.settings:
            a.verified = dict(CODE_CHANGE)
    head: dict[str, Any] = {"repeats": o.repeats, "warmup": o.verify_warmup, "steps": o.verify_steps}
    head |= {"interrupted": False, "min_speedup": RECOMMEND_MIN_SPEEDUP}
    if not candidates:
        return {
            **head,
            "repeats": 0,
            "baseline": {"throughput_median": None, "throughputs": [], "unit": None},
            "note": "no recommendation is a setting: nothing to run",
        }
    variants = [("baseline", {}), *((a.change, a.settings) for a in candidates)]
    runs: list[list[dict[str, Any]]] = [[] for _ in variants]
    quiet = logging.getLogger("turbotrain")
    level = quiet.level
    quiet.setLevel(max(level, logging.WARNING))  # each run's assembly notes: the profiled run said them once
    try:
        for done, (r, i) in enumerate(interleaved(len(variants), o.repeats), 1):
            log(f"verify {done}/{o.repeats * len(variants)}: {variants[i][0]}")
            folder = run_dir / "verify" / f"run{i}-{r + 1}"
            runs[i].append(measure_once(target, variants[i][1], folder, o.verify_warmup, o.verify_steps))
    except KeyboardInterrupt:
        head["interrupted"] = True
        log("verification interrupted: reporting the runs that finished")
    finally:
        quiet.setLevel(level)
    base = [f["throughput"] for f in runs[0]]
    base_median = median_of(base)
    base_loss = median_of(f.get("parity_loss") for f in runs[0])
    for a, mine in zip(candidates, runs[1:]):
        a.verified = (
            _verdict(mine, base_median, base_loss) if mine and base_median is not None else dict(NOT_RUN)
        )
    unit = runs[0][0]["throughput_unit"] if runs[0] else None
    return {**head, "baseline": {"throughput_median": base_median, "throughputs": base, "unit": unit}}


def _verdict(mine: list[dict[str, Any]], base_median: float, base_loss: float | None) -> dict[str, Any]:
    median = statistics.median(f["throughput"] for f in mine)
    speedup = median / base_median
    loss = median_of(f.get("parity_loss") for f in mine)
    return {
        "status": "kept" if speedup >= RECOMMEND_MIN_SPEEDUP else "dropped",
        "speedup": speedup,
        "throughput_median": median,
        "throughputs": [f["throughput"] for f in mine],
        "runs": len(mine),
        "loss_diff": None if loss is None or base_loss is None else loss - base_loss,
    }


NAN_TEXT = (
    "the loss is {loss} (not finite) at the end of the profiled run: the model is not training, so its "
    "timings and the advice below describe a broken step; fix the loss first (an fp32 run, a lower learning "
    "rate, the model's own arithmetic)"
)


@contextlib.contextmanager
def _failing_run(target: Target, run_dir: Path) -> Iterator[None]:
    """A run that fails leaves no run folder behind (it would hold a lone metrics.jsonl that
    looks like a run); a failure inside a workload (``--model``: its forward raises, its loader
    is empty) is one line naming the cause, as ``bench`` and ``tune`` say it."""
    try:
        yield
    except BaseException as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        failed = workload_failed(
            f"profile {target.label}", exc, "; nothing was profiled (no run folder kept)", in_user_code=False
        )
        if target.is_workload and failed is not None:
            raise failed from None
        raise


FIGURES = (  # the measured run's figures the report keeps, in this order
    "step_ms_median throughput throughput_unit samples_per_s tokens_per_s first_step_s data_wait_ms_per_step "
    "tflops mfu peak_bytes warmup steps"
).split()
OPERATORS = ("forward_ops_per_step", "forward_op_median_us", "forward_op_time_median_us")
PROFILED_NOTE = (
    "phase shares come from the profiled steps (profiler overhead included) and are applied to "
    "the unprofiled median step; the data wait is measured in the unprofiled timed steps"
)


def _document(built: Any, figures: dict[str, Any], trace: dict[str, Any], trace_path: Path) -> dict[str, Any]:
    c, engine = built.config, built.engine
    target = {**built.target.to_dict(), "describe": built.workload.describe() if built.workload else c.preset}
    profiled = {"steps": trace["profiled_steps"], "step_ms": trace["profiled_step_ms"], "note": PROFILED_NOTE}
    compiled = {k: figures[k] for k in ("compiled", "recompiles_after_warmup", "graph_breaks")}
    return {
        "schema": SCHEMA,
        "target": target,
        "run_dir": str(built.run_dir),
        "trace": str(trace_path),
        "device": engine.device.type,
        "device_name": device_name(engine.device),
        "settings": _settings(built),
        "loader": built.loader_info,
        "figures": {k: figures.get(k) for k in FIGURES},
        "profiled": profiled,
        "breakdown": _breakdown(figures, trace),
        "device_timeline": trace.get("device"),
        "syncs": trace["syncs"],
        "operators": {k: trace[k] for k in OPERATORS},
        "compile": {**compiled, "graph_break_reasons": graph_break_reasons()},
    }


def _breakdown(figures: dict[str, Any], trace: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each phase's share of the profiled steps applied to the unprofiled median step."""
    step_ms = figures["step_ms_median"]
    scale = profiled_scale(figures, trace)
    out = {p: {"ms": v["share"] * step_ms, "share": v["share"]} for p, v in trace["phases"].items()}
    if "device" in trace:
        for p, v in trace["phases"].items():
            out[p]["device_ms"] = v["device_ms"] * scale
    out["data"]["ms"] = figures["data_wait_ms_per_step"]  # measured unprofiled, in the timed steps
    out["data"]["share"] = figures["data_wait_ms_per_step"] / step_ms if step_ms else 0.0
    return out


def _settings(built: Any) -> dict[str, Any]:
    c, engine, scope = built.config, built.engine, built.engine.options.compile_scope
    optimizer = type(built.optimizer).__name__
    if not (built.workload and built.workload.optimizer):  # turbotrain's: which implementation
        optimizer += f" ({resolve_implementation(c.optim.implementation, engine.device)})"
    return {
        "precision": engine.precision.name,
        "compile": scope if scope == "off" else f"{scope} ({c.compile.mode})",
        "optimizer": optimizer,
        "micro_batch": built.micro,
        "accumulation": engine.accumulation,
        "log_every": c.monitor.log_every,
        "checkpointing": c.memory.checkpointing,
    }
