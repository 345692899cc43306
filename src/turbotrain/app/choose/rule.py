"""The decision rule of ``choose.measure`` (docs/choose.md): the candidates, which are worth measuring
and which measured one is kept. Pure functions over figures, tested with figures given by hand."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ...base.config import AUTO, RunConfig
from ...core.meter.parity import loss_tolerance
from ...core.meter.table import figure, render_table

Overrides = dict[str, dict[str, Any]]
# what a candidate's measurement keeps for naming the run's regime (app/regime.probe_of reads them)
PROBE_KEYS = ("data_wait_ms_per_step", "tflops", "peak_tflops", "device_busy_ms", "host_enqueue_ms")

# The first step of a compiled candidate, estimated before measuring it (seconds, compile included):
# DESIGN's facts: a small GPT took 25-40 s to compile on a 2-core CPU; GPT-2 small's first step 34 s
# on an H100. A guess on the side of caution: it only decides whether measuring fits the budget.
COMPILE_COST_S = {"cpu": 30.0, "cuda": 40.0}


@dataclass(frozen=True)
class Candidate:
    """A recipe: the config ``changes`` on top of the user's config, and what they mean."""

    name: str
    changes: Overrides
    what: str
    compiles: bool = False  # its first step compiles (expensive: measured only when it fits the budget)
    baseline: bool = False


@dataclass
class Row:
    """One candidate in the decision table: its figures (None when not measured) and verdict."""

    name: str
    what: str
    changes: Overrides
    status: str = "pending"  # baseline | kept | rejected | skipped | failed
    reason: str = ""
    step_ms: float | None = None  # median timed step (the bench protocol's figure)
    first_step_s: float | None = None  # setup + compilation + the first step
    parity_loss: float | None = None  # loss on fixed held-out batches after the timed steps
    math_precision: str | None = None  # what the matmuls ran in ("fp32", "tf32", "bf16", ...)
    parity_ok: bool | None = None
    break_even_step: float | None = None  # the step at which its extra first-step cost is paid back
    projected_s: float | None = None  # first step + planned steps x step time
    measure_s: float | None = None  # wall time its measurement cost
    cached: bool = False  # figures reused from the cache
    # the regime probe's figures (app/regime.py): data wait, FLOP/s, and on CUDA the device timeline
    probe: dict[str, Any] = field(default_factory=dict)
    baseline: bool = False
    compiles: bool = False

    @classmethod
    def of(cls, c: Candidate) -> Row:
        return cls(c.name, c.what, c.changes, baseline=c.baseline, compiles=c.compiles)

    @property
    def measured(self) -> bool:
        return self.step_ms is not None

    def set_figures(self, figures: Mapping[str, Any]) -> None:
        """Take the figures of :func:`turbotrain.app.measure.run` (or the cache's copy of them)."""
        self.step_ms = float(figures["step_ms_median"])
        self.first_step_s = float(figures["first_step_s"])
        self.parity_loss = figures.get("parity_loss")
        if self.parity_loss is None:  # no held-out batches: the last timed step's loss
            self.parity_loss = figures.get("final_loss")
        self.math_precision = figures.get("math_precision")
        fresh = {k: figures[k] for k in PROBE_KEYS if figures.get(k) is not None}
        cached = figures.get("probe")
        self.probe = dict(cached) if isinstance(cached, Mapping) else fresh

    def figures(self) -> dict[str, Any]:
        rest = ("first_step_s", "parity_loss", "math_precision", "probe")
        return {"step_ms_median": self.step_ms, **{k: getattr(self, k) for k in rest}}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Decision:
    """What ``choose`` decided: the ``changes`` applied to the run's config, the table, why."""

    changes: Overrides
    rows: list[Row] = field(default_factory=list)
    planned_steps: int = 0
    summary: str = ""  # one line: what was kept and why
    measured: bool = False  # whether anything was timed in this process
    cache: str = ""  # where the figures were cached / reused from
    key: str = ""
    measure_s: float = 0.0  # wall time spent measuring in this process (the decision's cost)
    regime: dict[str, str] | None = None  # the kept recipe's regime (app/regime.py), when named

    @property
    def kept(self) -> Row | None:
        return next((r for r in self.rows if r.status == "kept"), None)

    def to_dict(self) -> dict[str, Any]:
        keys = ("changes", "planned_steps", "summary", "measured", "cache", "key")
        out = {k: getattr(self, k) for k in keys}
        out |= {"measure_s": round(self.measure_s, 3), "regime": self.regime}
        return {**out, "rows": [r.to_dict() for r in self.rows], "table": format_table(self)}


def auto_fields(config: RunConfig) -> list[str]:
    """The settings ``choose`` may decide: those left at ``auto``."""
    auto = {"compile.scope": config.compile.scope, "precision.mode": config.precision.mode}
    return [name for name, value in auto.items() if value == AUTO]


def precision_modes(device_type: str, resolved: str, tf32: bool, cpu_bf16: bool) -> list[tuple[str, str]]:
    """(mode, description) of the precisions to try besides ``resolved`` (auto's pick) when
    ``precision.mode = auto``: fp32 on a GPU (bf16 autocast's casts can cost more than they save on
    a launch-bound step). On a CPU only with ``cpu_bf16`` (``choose.measure = always``, the user's
    opt-in): by default ``auto`` is fp32 on every CPU, so a default run's math does not depend on
    which CPU it meets (bf16 units or not) or on timing noise."""
    if device_type == "cuda":
        fp32 = [("fp32", "fp32 weights and math" + (", TF32 matmuls" if tf32 else ""))]
        return [] if resolved == "fp32" else fp32
    return [("bf16-mixed", "bf16 autocast")] if cpu_bf16 and resolved != "bf16-mixed" else []


def stage1(config: RunConfig, device_type: str, resolved_precision: str) -> list[Candidate]:
    """The baseline (plain eager in the user's precision) and the eager precision candidates."""
    fields_ = auto_fields(config)
    eager: Overrides = {"compile": {"scope": "off"}} if "compile.scope" in fields_ else {}
    if "precision.mode" in fields_:
        eager = {**eager, "precision": {"mode": resolved_precision}}
    out = [Candidate("eager", eager, f"plain eager, {resolved_precision}", baseline=True)]
    if "precision.mode" in fields_:
        cpu_bf16 = config.choose.measure == "always"
        for mode, what in precision_modes(device_type, resolved_precision, config.precision.tf32, cpu_bf16):
            out.append(Candidate(f"eager {mode}", {**eager, "precision": {"mode": mode}}, f"eager, {what}"))
    return out


def stage2(config: RunConfig, device_type: str, best: Row) -> list[Candidate]:
    """The compiled candidates, in ``best``'s precision (stage 1's pick)."""
    if "compile.scope" not in auto_fields(config):
        return []
    precision = {"precision": best.changes["precision"]} if "precision" in best.changes else {}
    label = f", {best.changes['precision']['mode']}" if precision else ""
    out = [
        Candidate(
            f"compile {scope}" + (f" ({best.name.split(' ', 1)[1]})" if " " in best.name else ""),
            {**precision, "compile": {"scope": scope}},
            f"torch.compile of the {'model' if scope == 'model' else 'repeated blocks'}{label}",
            compiles=True,
        )
        for scope in ("model", "blocks")
    ]
    if device_type == "cuda" and config.compile.mode == "default":
        graphs = {**precision, "compile": {"scope": "model", "mode": "reduce-overhead"}}
        what = f"torch.compile mode reduce-overhead (CUDA graphs){label}"
        out.append(Candidate("compile model + CUDA graphs", graphs, what, compiles=True))
    return out


def too_short(planned_steps: int, candidates: int, warmup: int, steps: int, budget: float) -> str:
    """Why a run of ``planned_steps`` is too short to measure ``candidates`` eager recipes of
    ``warmup`` + ``steps`` steps each within ``budget`` of its length ("" when it is not)."""
    cost = candidates * (warmup + steps)
    need = math.ceil(cost / budget)
    if planned_steps >= need:
        return ""
    return (
        f"the run's {planned_steps} steps are too few to pay for measuring: {candidates} candidates x "
        f"{warmup + steps} steps = {cost} steps, more than {budget:.0%} of the run (needs >= {need} steps)"
    )


def worth_measuring(
    c: Candidate,
    eager_ms: float,
    planned_steps: int,
    warmup: int,
    steps: int,
    budget: float,
    device_type: str,
) -> str:
    """Why compiled candidate ``c`` is not worth measuring before a run of ``planned_steps`` whose
    eager step takes ``eager_ms`` ("" when it is): its estimated first-step cost plus its timed steps
    exceed ``budget`` of the run's eager time. Says the break-even it would have to reach."""
    if not c.compiles:
        return ""
    first_s = COMPILE_COST_S.get(device_type, COMPILE_COST_S["cuda"])
    cost_s = first_s + (warmup + steps) * eager_ms / 1000
    run_s = planned_steps * eager_ms / 1000
    if cost_s <= budget * run_s:
        return ""
    need_ms = 1000 * first_s / planned_steps
    pays = (
        f"it would have to save {need_ms:.1f} ms a step ({need_ms / eager_ms:.0%} of eager's {eager_ms:.1f} ms) "
        f"to pay back its first step within the run"
        if need_ms < eager_ms
        else f"its first step alone costs more than the whole run in eager ({run_s:.1f} s), so it cannot pay back"
    )
    return (
        f"not measured: its first step costs ~{first_s:.0f} s ({device_type} estimate) and measuring it "
        f"~{cost_s:.0f} s, {cost_s / run_s:.0%} of the planned run ({planned_steps} steps x "
        f"{eager_ms:.1f} ms = {run_s:.0f} s; budget {budget:.0%}); {pays}"
    )


def judge(rows: list[Row], planned_steps: int, min_speedup: float) -> Row:
    """Mark every measured row kept / rejected (with why) and return the kept one. The baseline
    is kept unless a candidate passes every rule and projects a shorter run."""
    base = next(r for r in rows if r.baseline)
    assert base.step_ms is not None and base.first_step_s is not None, "the baseline must be measured"
    base.projected_s = base.first_step_s + planned_steps * base.step_ms / 1000
    eligible = [base]
    for r in rows:
        if r.baseline or r.status in ("skipped", "failed") or not r.measured:
            continue
        assert r.step_ms is not None and r.first_step_s is not None
        r.projected_s = r.first_step_s + planned_steps * r.step_ms / 1000
        saving_ms = base.step_ms - r.step_ms
        extra_s = max(0.0, r.first_step_s - base.first_step_s)
        r.break_even_step = 1000 * extra_s / saving_ms if saving_ms > 0 else None
        r.parity_ok = parity(r, base)
        r.status = "rejected"
        r.reason = _rejection(r, base, extra_s, planned_steps, min_speedup)
        if not r.reason:
            eligible.append(r)
    best = min(eligible, key=lambda r: r.projected_s or math.inf)
    for r in eligible:
        if r is best:
            continue
        assert r.step_ms is not None  # eligible rows were measured
        r.status = "rejected"
        r.reason = f"{base.step_ms / r.step_ms:.2f}x eager, pays back at step {r.break_even_step or 0:,.0f}; "
        r.reason += f"{best.name} projects a shorter run"
    if best is base:
        others = any(r is not base and r.measured for r in rows)
        why = "no measured candidate passes parity, beats it and pays back within the run"
        base.status, base.reason = "kept", f"plain eager: {why if others else 'nothing else was measured'}"
    else:
        best.status = "kept"
        best.reason = f"{base.step_ms / (best.step_ms or 1):.2f}x eager, parity ok, " + (
            f"pays back its +{max(0.0, (best.first_step_s or 0) - base.first_step_s):.1f} s first step "
            f"at step {best.break_even_step:,.0f} of {planned_steps:,d}"
            if best.break_even_step
            else "no extra first-step cost"
        )
        base.status, base.reason = "rejected", f"{best.name} is faster"
    return best


def _rejection(r: Row, base: Row, extra_s: float, planned_steps: int, min_speedup: float) -> str:
    """Why measured ``r`` loses to the baseline by a rule ("" when it passes every one)."""
    assert r.step_ms is not None and base.step_ms is not None
    if not r.parity_ok:
        tol = loss_tolerance(_prec(r), _prec(base))
        return (
            f"loss parity: {r.parity_loss:.5f} vs eager's {base.parity_loss:.5f} "
            f"(|diff| > {tol:g}, the bench's rule)"
        )
    if r.step_ms >= base.step_ms:
        return f"slower than plain eager ({r.step_ms:.2f} vs {base.step_ms:.2f} ms a step)"
    if base.step_ms / r.step_ms < min_speedup:
        return (
            f"{base.step_ms / r.step_ms:.2f}x eager, under the {min_speedup:.2f}x a change must gain "
            "(choose.min_speedup: within timing noise)"
        )
    if r.break_even_step is not None and r.break_even_step > planned_steps:
        return (
            f"{base.step_ms / r.step_ms:.2f}x eager, but its first step costs {extra_s:.1f} s more: it pays "
            f"back at step {r.break_even_step:,.0f}, after the run's {planned_steps:,d} steps"
        )
    return ""


def _prec(r: Row) -> dict[str, Any]:
    return {"math_precision": r.math_precision, "final_loss": r.parity_loss}


def parity(r: Row, base: Row) -> bool:
    """The bench's loss-parity rule on the held-out loss: 1e-3 nats when both compute in fp32,
    else 0.05 nats or 1% (NaN or a missing loss fails)."""
    if r.parity_loss is None or base.parity_loss is None:
        return r.parity_loss is None and base.parity_loss is None
    diff = abs(r.parity_loss - base.parity_loss)
    return math.isfinite(diff) and diff <= loss_tolerance(_prec(r), _prec(base))


def format_table(d: Decision) -> list[str]:
    """The decision table as markdown lines (also what the terminal shows)."""
    regime = [(d.regime or {}).get("line", "")] if (d.regime or {}).get("line") else []
    if not d.rows:  # nothing weighed: the reason (and the regime) alone
        return [f"choose: {d.summary}", *regime]
    return [f"choose: {d.summary}", *regime, "", *render_table(d.rows, DECISION_COLUMNS).splitlines()]


DECISION_COLUMNS: list[tuple[str, Any]] = [
    ("candidate", lambda r: r.name),
    ("recipe", lambda r: r.what),
    ("step ms", lambda r: figure(r.step_ms, ".2f", " (cached)" if r.cached else "", "-")),
    ("first step s", lambda r: figure(r.first_step_s, ".2f", missing="-")),
    ("parity", lambda r: "-" if r.parity_ok is None else ("ok" if r.parity_ok else "FAIL")),
    ("break-even step", lambda r: figure(r.break_even_step, ",.0f", missing="-")),
    ("verdict", lambda r: r.status),
    ("why", lambda r: r.reason),
]
