"""The ``turbotrain-auto`` and ``turbotrain-graphs`` rows of ``bench --compare``, in their contender process.

``turbotrain-auto``: :func:`~turbotrain.app.choose.session.choose` decides the settings left at
``auto`` for a run of ``auto_planned_steps``, each candidate timed by the bench's own turbotrain row
on a fresh model and the same batches, under the same clock; then the row trains with the decision.
The decision's cost (``decision_s``) is reported beside the step time, never inside it; its cache is
a fresh folder (the cost of a first run). ``turbotrain-graphs``: the defaults plus
``compile.cuda_graphs``; where graphs cannot run the row is skipped with their one-line reason.
"""

from __future__ import annotations

import gc
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from ...base.config import load_config
from ...base.errors import ConfigError, TurbotrainError, TurbotrainWarning
from ..choose.rule import Candidate
from ..choose.session import choose
from ..measure import merge
from .contenders import SkipContender, train_turbotrain, turbotrain_overrides
from .protocol import BatchList, Job, StepClock
from .workloads import seeded_workload

PLANNED_STEPS = 10_000  # the run length the auto row decides for (bench --auto-planned-steps)


def _with(spec: dict[str, Any], changes: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``spec`` with ``changes`` on top of its turbotrain overrides."""
    return {**spec, "turbotrain_overrides": merge(spec.get("turbotrain_overrides"), changes)}


def measure_candidates(job: Job) -> Callable[[Candidate], dict[str, Any]]:
    """``choose``'s timer for the bench: the turbotrain row with the candidate's changes, on a fresh
    model from the seed, the job's batches and protocol; figures named as ``measure.run`` names them."""
    spec = {k: v for k, v in job.spec.items() if k not in ("profile_dir", "profile_steps")}

    def measure(c: Candidate) -> dict[str, Any]:
        model, loss_fn = seeded_workload(spec["model"]["kind"], spec["model"]["kwargs"], spec["seed"])
        clock = StepClock(job.device, spec["warmup_steps"], spec["timed_steps"])
        batches = BatchList(job.batches.batches, spec["warmup_steps"] + spec["timed_steps"])
        try:
            with warnings.catch_warnings():  # "bf16 on a CPU may be slow": we measure it
                warnings.simplefilter("ignore", TurbotrainWarning)
                extra = train_turbotrain(
                    Job(_with(spec, c.changes), job.device, model, batches, clock, loss_fn)
                )
            figures = clock.finish()
        except SkipContender as exc:  # a refused setting: the candidate fails, the decision goes on
            raise TurbotrainError(str(exc)) from None
        finally:
            if c.compiles:  # its graphs belong to a model that is gone
                torch.compiler.reset()
            del model
            gc.collect()  # the candidate's model, optimizer and engine, before the next one is built
            if job.device.type == "cuda":
                torch.cuda.empty_cache()
        return {
            "step_ms_median": figures["step_ms_median"],
            "first_step_s": figures["time_to_first_step_s"],
            "final_loss": figures["final_loss"],
            "math_precision": extra["math_precision"],
        }

    return measure


def train_auto(job: Job) -> dict[str, Any]:
    """Decide by measurement (choose), then train the row with the decision (see the module doc)."""
    planned = int(job.spec.get("auto_planned_steps", PLANNED_STEPS))
    base = turbotrain_overrides(job.spec, job.device, planned)
    base["choose"] = {"measure": "auto", "warmup": job.spec["warmup_steps"], "steps": job.spec["timed_steps"]}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="turbotrain-bench-choose-") as cache:
        base["data"] = {**base.get("data", {}), "cache_dir": cache}  # a first run's cost: nothing cached
        try:
            config = load_config(overrides=base)
        except ConfigError as exc:
            raise SkipContender(str(exc)) from None
        decision = choose(config, measure=measure_candidates(job), device=job.device)
    decision_s = time.perf_counter() - t0
    changes = decision.changes if decision is not None else {}
    extra = train_turbotrain(replace(job, spec=_with(job.spec, changes)))
    summary = decision.summary if decision is not None else "nothing left at auto: the defaults"
    return {
        **extra,
        "recipe": f"{extra['recipe']}; choose for {planned:,d} planned steps: {summary} "
        f"(decided in {decision_s:.1f} s, not in the step time)",
        "decision_s": decision_s,
        "decision_measure_s": decision.measure_s if decision is not None else 0.0,
        "planned_steps": planned,
        "decision": decision.to_dict() if decision is not None else None,
    }


def train_graphs(job: Job) -> dict[str, Any]:
    """turbotrain's defaults plus whole-step CUDA graphs; how many steps were captured and replayed."""
    extra = train_turbotrain(replace(job, spec=_with(job.spec, GRAPHS)))
    return {**extra, "recipe": f"{extra['recipe']}, whole-step CUDA graphs (compile.cuda_graphs)"}


GRAPHS = {"compile": {"cuda_graphs": True}}

TRAINERS: dict[str, Callable[[Job], dict[str, Any]]] = {
    "turbotrain-auto": train_auto,
    "turbotrain-graphs": train_graphs,
}
