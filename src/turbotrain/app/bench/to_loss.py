"""``turbotrain bench --to-loss L``: wall time and tokens to a target validation loss, over seeds
(docs/bench.md). The training wall time excludes model building, data loading and the evaluations
(the same work for every contender); a difference counts only when the seed ranges do not overlap."""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...base.config import comma_list, load_config
from ...base.failure import cause_in_log
from ...base.process import child_env
from ...core.engine import default_loss
from ...core.meter.table import DASH, render_table
from ...loop.fit import fit
from ...loop.hooks import FitContext, Hook
from ...parts.hardware import device_name
from ..measure import child_main, merge, run_child
from ..training import build_training

VAL_SEED = 1234  # the held-out batches every run evaluates: the same whatever the run's seed
SCHEMA = "turbotrain-bench-to-loss/1"


@dataclass
class ToLossOptions:
    """``contenders`` (name -> overrides) on ``preset`` + ``overrides`` over ``seeds``, to ``target_loss``
    (None: the budget), ``max_tokens`` (0: none) or ``max_steps``."""

    contenders: dict[str, dict[str, dict[str, Any]]]
    preset: str = "gpt-tiny"
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    target_loss: float | None = None
    max_tokens: int = 0
    max_steps: int = 300
    eval_every: int = 10
    seeds: tuple[int, ...] = (0, 1, 2)
    threads: int = 0
    timeout_s: float = 900.0
    work_dir: Path = Path(".")


class _ToLoss(Hook):
    """Every ``eval_every`` steps: the validation loss (one host read, at evaluation only), the
    training wall time so far (evaluation time excluded) and the tokens; stops at the target or
    the token budget."""

    def __init__(self, val: list[Any], loss_fn: Any, opts: ToLossOptions, log: Callable[[str], None]) -> None:
        self.val, self.loss_fn, self.opts, self.log = val, loss_fn, opts, log
        self.curve: list[dict[str, float]] = []
        self.reached: dict[str, float] | None = None
        self.train_s = 0.0
        self._t0 = 0.0

    def on_fit_start(self, ctx: FitContext) -> None:
        self._t0 = time.perf_counter()

    def on_step_end(self, ctx: FitContext) -> None:
        step, tokens = ctx.engine.state.step, ctx.engine.state.tokens
        budget = bool(self.opts.max_tokens) and tokens >= self.opts.max_tokens
        if step % self.opts.eval_every and not budget and step < ctx.max_steps:
            return
        ctx.engine.synchronize()  # host-device sync point: the training time ends here (evaluation only)
        self.train_s += time.perf_counter() - self._t0
        val = ctx.engine.evaluate(ctx.model, self.val, self.loss_fn)  # a host read of the loss
        point = {"step": step, "tokens": tokens, "train_s": self.train_s, "val_loss": val}
        self.curve.append(point)
        self.log(f"step {step}: val {val:.4f} after {tokens:,} tokens, {self.train_s:.1f} s")
        target = self.opts.target_loss
        if target is not None and self.reached is None and val <= target:
            self.reached = point
            ctx.request_stop("target loss reached")
        elif budget:
            ctx.request_stop("token budget spent")
        ctx.model.train()
        self._t0 = time.perf_counter()


def run_one(opts: ToLossOptions, contender: str, seed: int, run_dir: Path) -> dict[str, Any]:
    """One contender with one seed, in this process: the curve and where the target was reached."""
    own: dict[str, dict[str, Any]] = {  # this run's seed, name and steps; the hook evaluates
        "run": {"seed": seed, "name": f"{contender}-seed{seed}"},
        "train": {"max_steps": opts.max_steps, "eval_every": 0},
        "monitor": {"progress": False},
    }
    config = load_config(opts.preset, merge(opts.overrides, opts.contenders[contender], own))
    training = build_training(config, run_dir, progress=False)
    val = training.data.val_batches(training.config.replace(run={"seed": VAL_SEED - 1}), 0, 1)
    if not val:
        raise ValueError("the preset's data has no validation split to measure the loss on")
    loss_fn = training.spec.loss_fn() or default_loss
    hook = _ToLoss(val, loss_fn, opts, lambda line: print(f"{contender} seed {seed}: {line}", flush=True))
    t = training
    fit(t.engine, t.model, t.optimizer, t.loader, max_steps=opts.max_steps, hooks=[hook], loss_fn=loss_fn)
    return {
        "contender": contender,
        "seed": seed,
        "reached": hook.reached,
        "final": hook.curve[-1] if hook.curve else None,
        "curve": hook.curve,
        "precision": training.engine.precision.name,
        "device_name": device_name(training.engine.device),
    }


def run_to_loss(opts: ToLossOptions, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every (contender, seed) in its own process, round-robin over the seeds; the document."""
    opts.work_dir.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    for seed in opts.seeds:
        for name in opts.contenders:
            job, t0 = opts.work_dir / f"{name}-seed{seed}", time.perf_counter()
            spec = {"contender": name, "seed": seed, "run_dir": str(job / "run"), "options": _shared(opts)}
            env = child_env(threads=opts.threads)
            code, out, _ = run_child("turbotrain.app.bench.to_loss", job, spec, env, opts.timeout_s)
            if code == 0 and out is not None:
                run = out
            else:  # the cause, not the log's last line (often a warning's source)
                log_text = (job / "log.txt").read_text(errors="replace")
                reason = "timed out" if code is None else f"exit {code}: {cause_in_log(log_text, code)[:200]}"
                run = {"contender": name, "seed": seed, "failed": reason}
            run["process_s"] = time.perf_counter() - t0
            runs.append(run)
            log(_run_line(run))
    return summarize(opts, runs)


def summarize(opts: ToLossOptions, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per contender the medians and spreads of time and tokens to target; the verdicts."""
    rows = []
    for name in opts.contenders:
        mine = [r for r in runs if r["contender"] == name]
        reached = [r["reached"] for r in mine if r.get("reached")]
        finals = [r["final"]["val_loss"] for r in mine if r.get("final")]
        rows.append(
            {
                "contender": name,
                "settings": opts.contenders[name],
                "seeds": len(mine),
                "reached": len(reached),
                "time_s": _stats([p["train_s"] for p in reached]),
                "tokens": _stats([p["tokens"] for p in reached]),
                "steps": _stats([p["step"] for p in reached]),
                "final_val_loss": _stats(finals),
            }
        )
    return {
        "schema": SCHEMA,
        "kind": "to-loss",
        **{k: v for k, v in _shared(opts).items() if k != "contenders"},
        "rows": rows,
        "verdicts": verdicts(rows),
        "runs": runs,
        "device_name": next((r["device_name"] for r in runs if r.get("device_name")), None),
        "torch": torch.__version__,
        "load_avg_1m": os.getloadavg()[0],  # a shared CPU's other work slows the wall times
    }


def _stats(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Each contender against the first, in time and in tokens to target (see the module docstring)."""
    kinds = (("time_s", "s"), ("tokens", "tokens"))
    return [_verdict(rows[0], row, what, unit) for row in rows[1:] for what, unit in kinds]


def _verdict(a: dict[str, Any], b: dict[str, Any], what: str, unit: str) -> str:
    label = "time" if what == "time_s" else "tokens"
    sa, sb = a[what], b[what]
    if a["reached"] < a["seeds"] or b["reached"] < b["seeds"]:
        missed = [r["contender"] for r in (a, b) if r["reached"] < r["seeds"]]
        return (
            f"{label} to target: not comparable, {' and '.join(missed)} did not reach it with every seed "
            "(more steps or a higher target)"
        )
    assert sa is not None and sb is not None
    if min(sa["n"], sb["n"]) < 2:
        return f"{label} to target: one seed, so no seed spread to judge against (use --seeds 3 or more)"
    ratio = sb["median"] / sa["median"] if sa["median"] else math.inf
    fmt = (lambda v: f"{v:.1f} {unit}") if unit == "s" else (lambda v: f"{v:,.0f} {unit}")
    spread = max(sa["max"] - sa["min"], sb["max"] - sb["min"])
    separated = sb["min"] > sa["max"] or sa["min"] > sb["max"]
    diff = sb["median"] - sa["median"]
    verdict = (
        "larger than the seed spread: a real difference"
        if separated
        else "within the seed spread: no difference shown"
    )
    return (
        f"{label} to target: {b['contender']} {fmt(sb['median'])} vs {a['contender']} {fmt(sa['median'])} "
        f"({ratio:.2f}x, difference {fmt(abs(diff))}; seed spread up to {fmt(spread)}): {verdict}"
    )


def render_to_loss(doc: dict[str, Any]) -> str:
    """The markdown table and the verdicts."""
    goal = f"validation loss <= {doc['target_loss']}" if doc["target_loss"] is not None else "the budget"
    lines = [
        f"## turbotrain bench --to-loss: {doc['preset']} to {goal} ({len(doc['seeds'])} seed(s) each, "
        f"at most {doc['max_steps']} steps"
        + (f" or {doc['max_tokens']:,} tokens" if doc["max_tokens"] else "")
        + f", evaluated every {doc['eval_every']} steps; {doc.get('device_name')})",
        "",
        render_table(doc["rows"], TO_LOSS_COLUMNS),
    ]
    lines += ["", *[f"- {v}" for v in doc["verdicts"]]]
    failed = [r for r in doc["runs"] if r.get("failed")]
    lines += [f"- {r['contender']} seed {r['seed']} failed: {r['failed']}" for r in failed]
    if doc.get("load_avg_1m") is not None:
        lines.append(
            f"- load average {doc['load_avg_1m']:.1f} at the end (a shared CPU: other work slows the wall times, "
            "not the tokens)"
        )
    return "\n".join(lines)


def _settings(r: dict[str, Any]) -> str:
    flags = " ".join(f"--{s}.{k}={v}" for s, kv in r["settings"].items() for k, v in kv.items())
    return f"`{flags or DASH}`"


TO_LOSS_COLUMNS: list[tuple[str, Any]] = [
    ("contender", lambda r: r["contender"]),
    ("settings", _settings),
    ("reached", lambda r: f"{r['reached']}/{r['seeds']}"),
    ("time to target (s): median [min-max]", lambda r: _range(r["time_s"], "{:.1f}")),
    ("tokens to target: median [min-max]", lambda r: _range(r["tokens"], "{:,.0f}")),
    ("steps", lambda r: _range(r["steps"], "{:.0f}")),
    ("final val loss", lambda r: _range(r["final_val_loss"], "{:.4f}")),
]


def _range(s: dict[str, float] | None, fmt: str) -> str:
    if s is None:
        return DASH
    return f"{fmt.format(s['median'])} [{fmt.format(s['min'])}-{fmt.format(s['max'])}]"


def _run_line(run: dict[str, Any]) -> str:
    head = f"{run['contender']} seed {run['seed']}: "
    if run.get("failed"):
        return head + f"failed ({run['failed']})"
    if run.get("reached"):
        p = run["reached"]
        return head + f"target at step {p['step']}, {p['tokens']:,} tokens, {p['train_s']:.1f} s"
    final = run.get("final") or {}
    return (
        head
        + f"target not reached (val {final.get('val_loss', float('nan')):.4f} at step {final.get('step')})"
    )


def parse_contender(text: str) -> tuple[str, dict[str, dict[str, Any]]]:
    """``"NAME:section.key=value,section.key=value"`` -> (NAME, nested overrides)."""
    name, _, rest = text.partition(":")
    if not name.strip():
        raise ValueError(f"--versus {text!r}: give NAME:section.key=value[,section.key=value]")
    out: dict[str, dict[str, Any]] = {}
    for item in comma_list(rest):
        key, sep, value = item.partition("=")
        section, dot, field_name = key.partition(".")
        if not (sep and dot and section and field_name):
            raise ValueError(f"--versus {text!r}: {item!r} is not section.key=value")
        out.setdefault(section, {})[field_name] = value
    return name.strip(), out


def _shared(opts: ToLossOptions) -> dict[str, Any]:
    """The options a run's child needs (and the document records), as JSON."""
    return {name: getattr(opts, name) for name in SHARED} | {"seeds": list(opts.seeds)}


SHARED = ("contenders", "preset", "overrides", "target_loss", "max_tokens", "max_steps", "eval_every")


def child(job: dict[str, Any], _: argparse.Namespace) -> dict[str, Any]:
    """One run in a child process (``--spec JOB.json``, written by :func:`run_to_loss`)."""
    opts = ToLossOptions(**{**job["options"], "seeds": tuple(job["options"]["seeds"])})
    return run_one(opts, job["contender"], job["seed"], Path(job["run_dir"]))


def main(argv: Sequence[str] | None = None) -> int:
    return child_main(argv, "one to-loss run (turbotrain bench --to-loss starts these)", child)


if __name__ == "__main__":
    sys.exit(main())
