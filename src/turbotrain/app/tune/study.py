"""The Optuna study behind ``turbotrain tune``: trials as processes, constraints with a penalty,
pruning, and a study that resumes from SQLite.

- Objective: throughput (tokens/s for a preset, samples/s for a workload) from the median timed
  step after warm-up; compilation is in the warm-up and reported as time to first step.
- Each trial runs in its own process (:mod:`.trial`) under a timeout, polled every half second:
  its memory arrives first, then each window's throughput. A trial whose peak memory is over the
  budget (``--batch.max_memory_gib`` / ``--batch.max_memory_fraction``, else the device, kept
  ``batch.headroom`` under as the batch finder does) is stopped at once. A window under half the
  best trial's throughput, or (from the second window) in the slowest quarter of earlier trials'
  at that window (Optuna's PercentilePruner), prunes the trial.
- Over budget, out of memory, failed, timed out or a setting the device refuses: the trial is
  COMPLETE with the penalty value 0 and positive constraint values (memory, loss parity, failure),
  so the sampler (TPE, reading the constraints set on each trial) learns that region loses. Optuna's samplers
  ignore FAILED trials and keep proposing that region; these are not FAILED.
- A proposal that needs at least the memory of one already over budget (same precision,
  checkpointing, compile scope, attention and loss, a micro-batch at least as large), or whose memory
  extrapolated from two measured micro-batches is over, is rejected without running. Such
  trials, and those stopped for memory, do not count towards ``--trials``: the over-budget region
  loses without eating the trial budget (proposals are capped at 4 x trials + 8).
- Loss parity: each trial's loss on fixed held-out batches against a short fp32 reference with
  the base settings (the baseline trial itself where the base is fp32), within the bench's
  tolerance (1e-3 nats when both compute in fp32, else max(0.05 nats, 1%)).
"""

from __future__ import annotations

import json
import math
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ...base.config import RunConfig
from ...base.errors import ConfigError, TurbotrainError, required_module
from ...core.meter.parity import RECOMMEND_MIN_SPEEDUP, interleaved, loss_tolerance
from ..measure import Target
from .runner import Outcome, Runner, TuneOptions
from .space import MICRO, Dim, base_params, to_changes

PENALTY = 0.0  # the objective value of a trial that violates a constraint (throughput is maximised)
SLOW_FRACTION = 0.5  # a window under this fraction of the best trial's throughput stops the trial
STUDY_NAME = "turbotrain-tune"
STUDY_DB = "study.db"
MEMORY_KEYS = ("precision.mode", "memory.checkpointing", "compile.scope", "model.attention", "model.loss")
NOT_COUNTED = ("over budget", "predicted over budget", "oom", "invalid", "duplicate")
CONSTRAINTS = ("memory", "loss_parity", "failed")  # each <= 0 when satisfied
KEPT = ("precision", "math_precision", "recompiles_after_warmup", "graph_breaks", "data_wait_ms_per_step")

Log = Callable[..., None]


def require_optuna() -> Any:
    """The optuna module, or a one-line error that says how to install it."""
    optuna = required_module(
        "optuna", "turbotrain tune needs Optuna: pip install 'turbotrain[tune]' (or pip install optuna)"
    )
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna


@dataclass
class Measured:
    """A trial's memory, for predicting others' (peak None after an out-of-memory error)."""

    params: dict[str, Any]
    peak_bytes: int | None
    over: bool


def predicted_over(
    params: dict[str, Any], history: list[Measured], limit: float | None, base_micro: int
) -> str:
    """Why ``params`` cannot fit (see the module docstring), or ''."""
    key = tuple(params.get(k) for k in MEMORY_KEYS)
    micro = int(params.get(MICRO, base_micro))
    alike = [h for h in history if tuple(h.params.get(k) for k in MEMORY_KEYS) == key]
    for h in alike:
        if h.over and micro >= int(h.params.get(MICRO, base_micro)):
            return f"needs at least the memory of a trial over budget (micro-batch {h.params.get(MICRO, base_micro)})"
    peaks = {int(h.params.get(MICRO, base_micro)): h.peak_bytes for h in alike if h.peak_bytes is not None}
    points = sorted(peaks.items())  # (micro-batch, peak bytes) of the alike trials measured
    if limit is not None and len(points) >= 2 and micro > points[-1][0]:
        (b0, p0), (b1, p1) = points[-2], points[-1]
        peak = p1 + (p1 - p0) / (b1 - b0) * (micro - b1)
        if peak > limit:
            return f"extrapolated peak {peak / 2**20:,.0f} MiB over the {limit / 2**20:,.0f} MiB limit"
    return ""


def _finite(*values: Any) -> bool:
    """Whether every value given is a finite number (None counts as finite: not measured)."""
    return all(v is None or (isinstance(v, (int, float)) and math.isfinite(v)) for v in values)


class StudyStopped(TurbotrainError):
    """A trial failed for a reason no setting changes: the study stops (its results are written)."""


def constraints_of(trial: Any) -> list[float]:
    """Optuna's constraints_func: the values the study stored (<= 0 feasible); a trial that
    stored none (interrupted) counts as violating."""
    return list(trial.user_attrs.get("constraints", [1.0, 1.0, 1.0]))


@dataclass
class Study:
    """One tune study: ``space`` over ``target``'s base config, trials run by ``runner``."""

    target: Target
    base: RunConfig
    space: list[Dim]
    options: TuneOptions
    run_dir: Path
    runner: Runner
    log: Log
    global_batch: int
    base_precision: str  # the base config's precision, resolved for the device
    headroom: float = 0.10
    fits_micro: int | None = None  # the batch finder's answer at the base settings (None: not run)
    study: Any = None
    history: list[Measured] = field(default_factory=list)
    reference: dict[str, Any] | None = None
    legacy_constraints: bool = False  # Optuna < 5: constraints through the sampler's constraints_func
    _pruned_why: str = ""

    def open(self) -> None:
        """Create the study in ``run_dir/study.db``, or resume it (same target, space and trial settings)."""
        optuna = require_optuna()
        self.study = self._create_study(optuna)
        o = self.options
        identity = {
            "target": self.target.to_dict(),
            "space": [d.to_dict() for d in self.space],
            "warmup": o.warmup,
            "steps": o.steps,
            "global_batch": self.global_batch,
        }
        identity = json.loads(json.dumps(identity, default=str))
        saved = self.study.user_attrs.get("identity")
        if saved is None:
            self.study.set_user_attr("identity", identity)
            self._enqueue_baselines()
        elif saved != identity:
            raise ConfigError(
                f"{self.run_dir} holds a tune study of other settings (target, search space or trial "
                "length differ); give another --run.name to start a new one"
            )
        else:
            self.log(f"resuming the study in {self.run_dir}: {len(self.study.trials)} trial(s) so far")
        self.reference = self.study.user_attrs.get("reference")
        for t in self.study.trials:
            if t.state == optuna.trial.TrialState.RUNNING:  # left by a process that died: it never reports
                self.study.tell(t.number, state=optuna.trial.TrialState.FAIL)
            if "peak_bytes" in t.user_attrs or t.user_attrs.get("status") == "oom":
                over = bool(t.user_attrs.get("over_budget"))
                self.history.append(Measured(dict(t.params), t.user_attrs.get("peak_bytes"), over))

    def _create_study(self, optuna: Any) -> Any:
        """The Optuna study in SQLite (loaded if it exists): TPE with the constraints, and the pruner."""
        o = self.options
        self.legacy_constraints = not hasattr(optuna.trial.Trial, "set_constraint")  # Optuna < 5
        sampler = optuna.samplers.TPESampler(
            seed=o.seed,
            n_startup_trials=max(2, o.trials // 3),
            multivariate=True,
            group=True,
            **({"constraints_func": constraints_of} if self.legacy_constraints else {}),
        )
        # The slowest quarter from the second window and four completed trials on: on a shared CPU one
        # window's noise is as large as most differences (a median rule at the first window pruned a
        # repeat of the baseline). Far slower trials go at their first window (SLOW_FRACTION).
        pruner = (
            optuna.pruners.PercentilePruner(25.0, n_startup_trials=4, n_warmup_steps=2)
            if o.prune
            else optuna.pruners.NopPruner()
        )
        return optuna.create_study(
            study_name=STUDY_NAME,
            storage=f"sqlite:///{self.run_dir / STUDY_DB}",
            direction="maximize",
            sampler=sampler,
            pruner=pruner,
            load_if_exists=True,
        )

    def _enqueue_baselines(self) -> None:
        """A new study's first trial: the base settings; when those do not fit, also the base
        settings at their largest micro-batch that does (the batch finder's answer)."""
        base = base_params(self.space)
        self.study.enqueue_trial(base, user_attrs={"baseline": True})
        micro = next((d for d in self.space if d.key == MICRO), None)
        if micro is not None and self.fits_micro is not None and base.get(MICRO, 0) > self.fits_micro:
            fitted = max((m for m in micro.choices if m <= self.fits_micro), default=None)
            if fitted is not None:
                self.study.enqueue_trial({**base, MICRO: fitted}, user_attrs={"baseline": True})

    def counted(self) -> int:
        return sum(1 for t in self.study.trials if t.user_attrs.get("counted"))

    def _limit(self, budget: int | None) -> float | None:
        return None if budget is None else budget / (1.0 + self.headroom)

    def _tell(self, trial: Any, params: dict[str, Any], out: Outcome) -> None:
        """Record a trial's outcome: attributes, constraints, memory, and value (else the penalty)."""
        optuna = require_optuna()
        loss = out.result.get("parity_loss")
        # NaN/inf: a penalised trial, never a constraint of NaN
        if out.status == "ok" and not _finite(loss, out.result.get("throughput")):
            why = f"the loss is {loss} (not finite): these settings do not train"
            out = replace(out, status="failed", reason=why, result={**out.result, "parity_loss": None})
        if (
            self.reference is None
            and trial.user_attrs.get("baseline")
            and out.status == "ok"
            and self.base_precision == "fp32"
            and out.result.get("parity_loss") is not None
        ):
            self._set_reference(out.result)  # the baseline computes in fp32: it is the reference
        attrs = self._judge(out)
        self._record(trial, attrs)
        if out.status in ("ok", "over budget", "predicted over budget", "oom") or out.peak_bytes is not None:
            self.history.append(Measured(params, out.peak_bytes, bool(attrs["over_budget"])))
        if out.status == "pruned":
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:  # every other outcome is COMPLETE: feasible with its throughput, or the penalty
            self.study.tell(trial, float(out.result["throughput"]) if attrs["feasible"] else PENALTY)

    def _judge(self, out: Outcome) -> dict[str, Any]:
        """A trial's attributes: its constraints, whether it is feasible, what it measured."""
        status, result, peak = out.status, out.result, out.peak_bytes
        limit = self._limit(out.budget_bytes)
        over = peak is not None and limit is not None and peak > limit
        mem = 1.0 if status in ("oom", "predicted over budget") else 0.0
        if peak is not None and limit:
            mem = peak / limit - 1.0
        parity, diff, tol = self._parity(result)
        failed = 0.0 if status in ("ok", "pruned", "over budget", "predicted over budget", "oom") else 1.0
        constraints = [mem, parity, failed]
        feasible = status == "ok" and all(c <= 0 for c in constraints)
        return {
            "status": status
            if status != "ok" or feasible
            else ("loss parity" if parity > 0 else "over budget"),
            "reason": out.reason,
            "counted": status not in NOT_COUNTED,
            "constraints": constraints,
            "feasible": feasible,
            "throughput": result.get("throughput"),
            "unit": result.get("throughput_unit"),
            "peak_bytes": peak,
            "budget_bytes": out.budget_bytes,
            "over_budget": over or status in ("oom", "predicted over budget"),
            "parity_loss": result.get("parity_loss"),
            "loss_diff": diff,
            "loss_tol": tol,
            "first_step_s": result.get("first_step_s"),
            "step_ms_median": result.get("step_ms_median"),
            "windows": out.windows,
            **{k: result.get(k) for k in KEPT},
        }

    def _parity(self, result: dict[str, Any]) -> tuple[float, float | None, float | None]:
        """(loss-parity constraint, loss - reference, tolerance): (0, None, None) without a reference."""
        ref = (self.reference or {}).get("parity_loss")
        loss = result.get("parity_loss")
        if ref is None or not _finite(ref) or loss is None:
            return 0.0, None, None
        tol = loss_tolerance(
            {"math_precision": result.get("math_precision")}, {"math_precision": "fp32", "final_loss": ref}
        )
        diff = loss - ref
        return abs(diff) / tol - 1.0, diff, tol

    def run_trial(self, trial: Any, index: int) -> None:
        """Propose, run (unless skipped: :meth:`_skipped`) and record one trial."""
        params = base_params(self.space, lambda d: trial.suggest_categorical(d.key, list(d.choices)))
        name = f"trial-{trial.number:03d}"
        label = ", ".join(f"{k.split('.', 1)[1]}={v}" for k, v in params.items())
        changes = to_changes(params, self.global_batch)
        if self._skipped(trial, params, changes, name, label):
            return
        self.log(f"{name} ({index}/{self.options.trials}): {label}", transient=True)
        outcome = self.runner.measure(
            name, changes, report=lambda k, value: self._report(trial, k, value), over_budget=self._over
        )
        if outcome.status == "pruned":
            outcome = replace(outcome, reason=self._pruned_why)
        self._tell(trial, params, outcome)
        self.log(self.describe_trial(self.study.trials[trial.number]))
        if outcome.result.get("fatal"):  # the loss is not a scalar, the loader is empty: no proposal can run
            raise StudyStopped(
                f"{name} ({'the baseline' if trial.user_attrs.get('baseline') else label}) failed for a "
                f"reason no setting tune searches changes: {outcome.reason}; fix the workload, then run the same "
                "command again"
            )

    def _skipped(
        self, trial: Any, params: dict[str, Any], changes: dict[str, Any], name: str, label: str
    ) -> bool:
        """Record and log a proposal not run (refused by the config, a repeat, predicted over budget)."""
        try:
            self.target.config(changes)  # a combination the config refuses costs no process
        except ConfigError as exc:
            self._tell(trial, params, Outcome("invalid", reason=str(exc)))
            self.log(f"{name}: skipped, invalid: {exc}")
            return True
        done = [
            t
            for t in self.study.trials
            if t.state.name in ("COMPLETE", "PRUNED") and t.number != trial.number
        ]
        same = next(
            (t for t in done if t.params == params and t.user_attrs.get("status") != "duplicate"), None
        )
        if same is not None:
            self._repeat(trial, same)
            self.log(f"{name}: not run, the same settings as trial {same.number}; {label}", transient=True)
            return True
        budget = (self.reference or {}).get("budget_bytes")
        base_micro = int(self.base.batch.micro) if isinstance(self.base.batch.micro, int) else 1
        why = predicted_over(params, self.history, self._limit(budget), base_micro)
        if why:
            self._tell(trial, params, Outcome("predicted over budget", reason=why, budget_bytes=budget))
            self.log(f"{name}: not run, predicted over the memory budget ({why}); {label}")
            return True
        return False

    def _repeat(self, trial: Any, same: Any) -> None:
        """A proposal identical to an earlier trial: its outcome again, not run and not counted."""
        optuna = require_optuna()
        attrs = {k: v for k, v in same.user_attrs.items() if k != "baseline"}
        attrs.update(status="duplicate", counted=False, reason=f"the settings of trial {same.number}")
        self._record(trial, attrs)
        if same.state == optuna.trial.TrialState.PRUNED:
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            self.study.tell(trial, same.value)

    def _record(self, trial: Any, attrs: dict[str, Any]) -> None:
        """Store ``attrs`` on the trial and (Optuna >= 5) its constraints; none stored: violating."""
        for k, v in attrs.items():
            trial.set_user_attr(k, v)
        if not self.legacy_constraints:
            for k, v in zip(CONSTRAINTS, attrs.get("constraints", [1.0, 1.0, 1.0])):
                trial.set_constraint(k, v)

    def _over(self, peak: int, budget: int | None) -> bool:
        limit = self._limit(budget)
        return limit is not None and peak > limit

    def _report(self, trial: Any, k: int, value: float) -> bool:
        """Report window ``k``'s throughput; True to stop the trial: under SLOW_FRACTION of the
        best feasible trial so far (it cannot win, whatever the noise), or Optuna's pruner says so."""
        trial.report(value, k)
        if not self.options.prune:
            return False
        best = max((t.value for t in self.study.trials if t.state.name == "COMPLETE" and t.value), default=0)
        if best and value < SLOW_FRACTION * best:
            why = f"under {SLOW_FRACTION:.0%} of the best trial's {best:,.0f}/s"
        elif trial.should_prune():
            why = "in the slowest quarter of earlier trials at this window"
        else:
            return False
        self._pruned_why = f"window {k}: {value:,.0f}/s, {why}"
        return True

    def describe_trial(self, t: Any) -> str:
        a = t.user_attrs
        rate = f"{a['throughput']:,.0f} {a.get('unit') or ''}" if a.get("throughput") else "—"
        mem = f", peak {a['peak_bytes'] / 2**20:,.1f} MiB" if a.get("peak_bytes") else ""
        extra = f" ({a['reason']})" if a.get("reason") else ""
        return f"trial {t.number:3d}: {a.get('status', t.state.name.lower())}: {rate}{mem}{extra}"

    def ensure_reference(self, after_baseline: bool = False) -> None:
        """The fp32 reference for loss parity (and the memory budget): the baseline trial when
        the base computes in fp32 and it completed, else one run of its own (fp32, the base
        settings at the largest micro-batch the finder found to fit: the same samples, so the same math), run
        whatever its memory, once."""
        if self.reference is not None and (
            self.reference.get("parity_loss") is not None or self.reference.get("tried")
        ):
            return
        if self.base_precision == "fp32" and not after_baseline:
            return  # the baseline trial, when it completes, is the reference
        params = {**base_params(self.space), "precision.mode": "fp32"}
        micro = next((d for d in self.space if d.key == MICRO), None)
        if micro is not None:  # the largest that the finder found to fit (the smallest would be slowest)
            fits = [m for m in micro.choices if self.fits_micro is None or m <= self.fits_micro]
            params[MICRO] = max(fits) if fits else min(micro.choices)
        self.log("reference: the base settings in fp32, for loss parity", transient=True)
        out = self._measure_plain("reference-fp32", params)
        if out.status != "ok":
            self.log(f"reference run {out.status} ({out.reason}): loss parity is not checked")
        self._set_reference(
            {**(out.result if out.status == "ok" else {"budget_bytes": out.budget_bytes}), "tried": True}
        )

    def _measure_plain(self, name: str, params: dict[str, Any]) -> Outcome:
        """Run ``params`` to the end: never pruned, never stopped for memory (reference, confirmation)."""
        return self.runner.measure(
            name, to_changes(params, self.global_batch), lambda k, v: False, lambda peak, budget: False
        )

    def _set_reference(self, result: dict[str, Any]) -> None:
        self.reference = {
            k: result.get(k) for k in ("parity_loss", "budget_bytes", "throughput", "math_precision", "tried")
        }
        if not _finite(self.reference["parity_loss"]):  # a NaN reference would make every trial's parity NaN
            self.reference["parity_loss"] = None
        self.study.set_user_attr("reference", self.reference)

    def run(self) -> None:
        """Run trials until ``options.trials`` counted ones are done (see the module docstring)."""
        optuna = require_optuna()
        self.ensure_reference()
        proposals = 0
        limit = 4 * self.options.trials + 8
        while self.counted() < self.options.trials and proposals < limit:
            proposals += 1
            trial = self.study.ask()
            try:
                self.run_trial(trial, self.counted() + 1)
            except BaseException:
                if self.study.trials[trial.number].state == optuna.trial.TrialState.RUNNING:
                    trial.set_user_attr("status", "interrupted")
                    self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
                raise
            waiting = any(
                t.state.name == "WAITING" and t.user_attrs.get("baseline") for t in self.study.trials
            )
            if self.reference is None and not waiting:
                # no baseline completed in fp32: a reference of its own
                self.ensure_reference(after_baseline=True)
        if proposals >= limit and self.counted() < self.options.trials:
            self.log(
                f"stopped after {proposals} proposals: the sampler kept proposing settings that cannot run here"
            )

    def rows(self) -> list[dict[str, Any]]:
        """Every trial as a row: number, state, parameters and what it measured."""
        return [
            {"number": t.number, "state": t.state.name.lower(), "params": dict(t.params), **t.user_attrs}
            for t in self.study.trials
            if t.state.name != "WAITING"
        ]

    def confirm(self, best: dict[str, Any], repeats: int) -> dict[str, Any]:
        """Measure the best trial's settings against the baseline's again, ``repeats`` times each,
        interleaved (baseline, best, best, baseline, ...: load that comes and goes on a shared
        machine hits both alike), and compare medians: a trial can win on a quiet minute alone."""
        base_row = self.baseline_row()
        if base_row is None:
            note = "no baseline trial was feasible: nothing to compare with"
            return {"repeats": 0, "confirmed": None, "note": note}
        baseline = base_row["params"]
        runs: dict[str, list[float]] = {"baseline": [], "best": []}
        for r, i in interleaved(2, repeats):
            label, params = ("baseline", baseline) if i == 0 else ("best", best["params"])
            self.log(f"confirming: {label} ({r + 1}/{repeats})", transient=True)
            out = self._measure_plain(f"confirm-{label}-{r + 1}", params)
            if out.status == "ok":
                runs[label].append(float(out.result["throughput"]))
        result: dict[str, Any] = {
            "repeats": repeats,
            "throughputs": runs,
            "min_speedup": RECOMMEND_MIN_SPEEDUP,
        }
        if runs["baseline"] and runs["best"]:
            result["speedup"] = statistics.median(runs["best"]) / statistics.median(runs["baseline"])
            result["confirmed"] = result["speedup"] >= RECOMMEND_MIN_SPEEDUP
        else:
            result["confirmed"] = False
        self.log(
            f"confirmation: {result.get('speedup', float('nan')):.2f}x the baseline over {repeats} interleaved "
            f"run(s) each: {'confirmed' if result['confirmed'] else 'not confirmed (within noise)'}"
        )
        return result

    def baseline_row(self) -> dict[str, Any] | None:
        """The fastest feasible baseline trial: the base settings, or (when those are over the
        memory budget) the base settings at the largest micro-batch the finder found to fit."""
        return self._fastest(lambda r: bool(r.get("baseline")))

    def best(self) -> dict[str, Any] | None:
        """The fastest feasible trial (constraints all <= 0), or None."""
        return self._fastest(lambda r: r["status"] != "duplicate")

    def _fastest(self, keep: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
        rows = (r for r in self.rows() if r.get("feasible") and r.get("throughput") and keep(r))
        return max(rows, key=lambda r: r["throughput"], default=None)
