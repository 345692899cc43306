"""Run a comparison, the precision matrix or the ablation, each row in its own process
(``python -m turbotrain.app.bench.worker``), and derive throughput, MFU (where the GPU's peak is
known) and the loss difference from the reference row. Nothing is filled in that a process did not
measure."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from ...base.failure import cause_in_log
from ...base.process import child_env
from ...core.meter.parity import (
    MIXED_PRECISION_REL_TOL,
    MIXED_PRECISION_TOL,
    RECOMMEND_MIN_SPEEDUP,
    RULE,
    SAME_PRECISION_TOL,
    loss_tolerance,
)
from ...parts.hardware import estimate_mfu, lookup_peak
from ..measure import run_child
from .contenders import CONTENDERS, DEFAULT_ORDER
from .variants import LADDERS, Variant, ablation_variants, precision_variants
from .workloads import BenchWorkload, flops_per_step, to_spec, write_data


@dataclass
class BenchOptions:
    """How to run rows: device type, where to work, seed, per-row time limit (s), progress output."""

    device: str  # "cuda" or "cpu"
    work_dir: Path
    seed: int = 0
    timeout_s: float = 900.0
    log: Callable[[str], None] = field(default=lambda line: print(line, file=sys.stderr, flush=True))
    handtuned_compile: str = "auto"  # torch.compile in the hand-tuned row: auto (CUDA only), on, off
    # processes per row, run round-robin across rows (a noisy machine's bursts then hit every row)
    repeat: int = 1
    compile_cache: str = "cold"  # "cold": a fresh inductor/triton cache per row; "shared": one for all rows
    profile_dir: Path | None = None  # compare: profile a few turbotrain steps after its timed window
    profile_steps: int = 3
    threads: int = 0  # CPU threads per row process (OMP_NUM_THREADS); 0 = torch's default
    auto_planned_steps: int = 10_000  # the run length the turbotrain-auto row decides for (bench/auto.py)
    # Called with the report so far (``missing``: the rows not yet run) before every row and once
    # at the end: a bench killed at a time limit keeps what it measured (results.ReportWriter).
    progress: Callable[[dict[str, Any]], object] | None = None


def row_env(row_dir: Path, opts: BenchOptions) -> dict[str, str]:
    """The row's environment; compile caches by default cold, its own: no row's time to first step
    profits from another's compilation."""
    return child_env(
        threads=opts.threads, compile_cache=row_dir if opts.compile_cache == "cold" else opts.work_dir
    )


def run_row(contender: str, spec: dict[str, Any], row_name: str, opts: BenchOptions) -> dict[str, Any]:
    """One row in its own process; its JSON result (status ok / skipped / failed)."""
    row_dir, start = opts.work_dir / row_name, time.perf_counter()
    env, log_path = row_env(row_dir, opts), row_dir / "log.txt"
    code, out, cmd = run_child("turbotrain.app.bench.worker", row_dir, spec, env, opts.timeout_s, contender)
    wall_s = time.perf_counter() - start
    result: dict[str, Any]
    if code is None:
        result = {"status": "failed", "reason": f"timed out after {opts.timeout_s:.0f} s"}
    elif out is not None:
        result = out
    else:  # it died without a result of its own: the cause is in its log (the last line is often a warning's source)
        result = {"status": "failed", "reason": cause_in_log(log_path.read_text(errors="replace"), code)}
    result.update(contender=contender, row=row_name, command=" ".join(cmd), log=str(log_path), wall_s=wall_s)
    return result


@dataclass
class RowJob:
    """One row to run: its name, the contender process, its spec (or why it is skipped)."""

    row: str
    contender: str
    spec: dict[str, Any]
    skip: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # copied into the row (change, overrides)


NOT_RUN = "bench stopped before this row"  # a partial report's row that has no finished run


def run_rows(
    jobs: list[RowJob],
    opts: BenchOptions,
    prefix: str,
    on_rows: Callable[[list[dict[str, Any]], list[str]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every job ``opts.repeat`` times, round-robin, merged by :func:`merge_runs`; before each
    run, ``on_rows(rows so far, runs still to come)``."""
    runs: dict[str, list[dict[str, Any]]] = {j.row: [] for j in jobs}
    todo = [(k, j) for k in range(max(1, opts.repeat)) for j in jobs if not j.skip]
    label = (lambda k, j: f"{j.row} (run {k + 1})") if opts.repeat > 1 else (lambda k, j: j.row)
    for i, (k, j) in enumerate(todo):
        if on_rows is not None:
            on_rows(_merged_rows(jobs, runs), [label(*t) for t in todo[i:]])
        tag = f"{prefix}-{j.row}" + (f"-run{k + 1}" if opts.repeat > 1 else "")
        result = run_row(j.contender, j.spec, tag, opts)
        _log_row(opts, result, label(k, j))
        runs[j.row].append(result)
    return _merged_rows(jobs, runs)


def run_report(
    jobs: list[RowJob],
    opts: BenchOptions,
    prefix: str,
    build: Callable[[list[dict[str, Any]]], dict[str, Any]],
) -> dict[str, Any]:
    """The rows' report (``build``: rows -> report), handed to ``opts.progress`` as it grows."""

    def stamped(rows: list[dict[str, Any]], missing: list[str]) -> dict[str, Any]:
        return {**build(rows), "complete": not missing, "missing": missing}

    def partial(rows: list[dict[str, Any]], missing: list[str]) -> None:
        if opts.progress is not None:
            opts.progress(stamped(rows, missing))

    report = stamped(run_rows(jobs, opts, prefix, partial), [])
    if opts.progress is not None:
        opts.progress(report)
    return report


def _merged_rows(jobs: list[RowJob], runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One fresh row per job from the runs finished so far (derived figures are added later)."""
    rows = []
    for j in jobs:
        if j.skip or not runs[j.row]:
            status = ("skipped", j.skip) if j.skip else ("not run", NOT_RUN)
            row = {"contender": j.contender, "row": j.row, "status": status[0], "reason": status[1]}
        else:
            row = {**merge_runs(runs[j.row]), "row": j.row}
        rows.append({**row, **j.extra})
    return rows


def merge_runs(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from repeated runs of it (a failed run fails the row: its reason is kept)."""
    failed = [r for r in results if r.get("status") != "ok"]
    if failed:
        return dict(failed[0])
    order = sorted(results, key=lambda r: r["step_ms_median"])
    row = dict(order[(len(order) - 1) // 2])
    if len(results) > 1:
        row["time_to_first_step_s"] = statistics.median(r["time_to_first_step_s"] for r in results)
        keys = ("step_ms_median", "time_to_first_step_s", "final_loss", "process_s", "log")
        row["runs"] = [{k: r.get(k) for k in keys} for r in results]
    return row


def derive(row: dict[str, Any], w: BenchWorkload, flops: float) -> None:
    """Add throughput and MFU from the row's median step (in place)."""
    if row.get("status") != "ok":
        return
    step_s = row["step_ms_median"] / 1000.0
    row["samples_per_s"] = w.batch_size / step_s
    if w.tokens_per_sample:
        row["tokens_per_s"] = row["samples_per_s"] * w.tokens_per_sample
    row["model_tflops_per_s"] = flops / step_s / 1e12
    spec = lookup_peak(row.get("device_name")) if row.get("device") == "cuda" else None
    peak = spec.peak_tflops(row.get("math_precision", "bf16")) if spec else None
    if spec and peak:
        row["mfu"] = estimate_mfu(flops / step_s, peak)
        row["mfu_peak_tflops"] = peak
        row["mfu_peak_source"] = f"{spec.name} dense {row.get('math_precision')} datasheet peak"


def compare_to(rows: list[dict[str, Any]], ref: dict[str, Any] | None, *, speed_key: str) -> None:
    """Loss difference and parity of every ok row against ``ref``; ``speed_key`` names the
    ratio: 'turbotrain_speedup' (ref throughput / row's) or 'speedup' (row's / ref's)."""
    for row in rows:
        if row.get("status") != "ok" or ref is None or ref.get("status") != "ok":
            continue
        tol = loss_tolerance(row, ref)
        row["loss_diff"] = row["final_loss"] - ref["final_loss"]
        row["loss_tol"] = tol
        row["loss_within_tol"] = abs(row["loss_diff"]) <= tol
        ratio = row["step_ms_median"] / ref["step_ms_median"]
        row[speed_key] = ratio if speed_key == "turbotrain_speedup" else 1.0 / ratio


def _base(kind: str, w: BenchWorkload, opts: BenchOptions, flops: float, flops_method: str) -> dict[str, Any]:
    cpu = opts.device == "cpu"
    timing = [
        "median of the timed steps; warm-up and compilation excluded (reported as time to first step)",
        "CUDA events, synchronized before reading" if opts.device == "cuda" else "host clock",
    ]
    if opts.repeat > 1:
        timing.append(
            f"each row run in {opts.repeat} processes round-robin, the run with the median step time reported"
        )
    if opts.compile_cache == "shared":
        timing.append(
            "compile caches shared between rows (a later row may reuse an earlier row's compilation, so its "
            "time to first step is a lower bound)"
        )
    if opts.threads:
        timing.append(f"{opts.threads} CPU thread(s) per row")
    return {
        "kind": kind,
        "workload": {**asdict(w), "describe": w.describe()},
        "device": opts.device,
        "seed": opts.seed,
        "flops_per_step": flops,
        "flops_method": flops_method,
        "tolerance": {
            "same_precision_nats": SAME_PRECISION_TOL,
            "mixed_precision_nats": MIXED_PRECISION_TOL,
            "mixed_precision_relative": MIXED_PRECISION_REL_TOL,
            "rule": RULE,
        },
        "mfu_basis": "model FLOPs per step / median step time / the GPU's dense datasheet peak for the precision "
        "each row computes in (turbotrain.parts.hardware); omitted when the device is unknown or a CPU",
        "repeat": opts.repeat,
        "timing": "; ".join(timing) + (". CPU shared with other processes: timings are noisy" if cpu else ""),
        "compile_cache": opts.compile_cache,
        "threads": opts.threads or None,
    }


def _log_row(opts: BenchOptions, row: dict[str, Any], label: str) -> None:
    if row["status"] == "ok":
        opts.log(
            f"  {label:<28} {row['step_ms_median']:9.2f} ms/step  loss {row['final_loss']:.4f}  "
            f"first step {row['time_to_first_step_s']:.2f} s"
        )
    else:
        opts.log(f"  {label:<28} {row['status']} ({row.get('reason', '')})")


def run_compare(w: BenchWorkload, opts: BenchOptions, contenders: list[str] | None = None) -> dict[str, Any]:
    """Every contender on the same model, data, seed and batch, each in its own process."""
    names = _contender_names(w, opts.device, contenders)

    def jobs(spec: dict[str, Any]) -> list[RowJob]:
        specs = {
            "handtuned": {**spec, "handtuned": {"compile": opts.handtuned_compile}},
            "turbotrain-auto": {**spec, "auto_planned_steps": opts.auto_planned_steps},
        }
        if opts.profile_dir:
            profile = {"profile_steps": opts.profile_steps, "profile_dir": str(opts.profile_dir)}
            specs["turbotrain"] = {**spec, **profile}
        return [
            RowJob(
                n,
                n,
                specs.get(n, spec),
                CONTENDERS[n].unavailable(opts.device) or "",
                {"title": CONTENDERS[n].title},
            )
            for n in names
        ]

    def finish(rows: list[dict[str, Any]], report: dict[str, Any]) -> None:
        for row in rows:
            row.setdefault("recipe", CONTENDERS[row["contender"]].recipe(opts.device))
        ref = next((r for r in rows if r["contender"] == "turbotrain"), None)
        compare_to(rows, ref, speed_key="turbotrain_speedup")
        report.update(reference="turbotrain", summary=_compare_summary(rows, ref))

    return _run(w, opts, "compare", jobs, finish)


def _run(
    w: BenchWorkload,
    opts: BenchOptions,
    kind: str,
    jobs: Callable[[dict[str, Any]], list[RowJob]],
    finish: Callable[[list[dict[str, Any]], dict[str, Any]], None],
) -> dict[str, Any]:
    """The rows ``jobs(spec)`` on the workload's data, each derived (:func:`derive`); the report is
    ``_base`` plus what ``finish(rows, report)`` adds."""
    opts.work_dir.mkdir(parents=True, exist_ok=True)
    data = write_data(w, opts.seed, opts.work_dir / f"{w.name}-{kind}-data.pt")
    flops, method = flops_per_step(w)
    spec = to_spec(w, device=opts.device, seed=opts.seed, data_file=data)
    opts.log(f"{kind}: {w.describe()}")

    def build(rows: list[dict[str, Any]]) -> dict[str, Any]:
        for row in rows:
            derive(row, w, flops)
        report = _base(kind, w, opts, flops, method)
        device_name = next((r["device_name"] for r in rows if r.get("device_name")), None)
        report.update(device_name=device_name, rows=rows)
        finish(rows, report)
        return report

    return run_report(jobs(spec), opts, f"{w.name}-{kind}", build)


def _contender_names(w: BenchWorkload, device: str, contenders: list[str] | None) -> list[str]:
    """The contenders asked for (default: those for this workload) that run on ``device``."""
    names = list(contenders or DEFAULT_ORDER)
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise ValueError(f"unknown contender(s) {unknown}; choose from {', '.join(CONTENDERS)}")
    if device != "cuda":
        names = [n for n in names if not CONTENDERS[n].cuda_only]
    if not contenders or list(contenders) == list(DEFAULT_ORDER):  # the default list: rows for this workload
        names = [n for n in names if not CONTENDERS[n].workloads or w.model in CONTENDERS[n].workloads]
    return names


def _compare_summary(rows: list[dict[str, Any]], ref: dict[str, Any] | None) -> dict[str, Any]:
    ok = [r for r in rows if r["status"] == "ok"]
    first, digests = [r["first_loss"] for r in ok], {r["init_digest"] for r in ok}
    parity = all(r.get("loss_within_tol", False) for r in ok) if ref and ref["status"] == "ok" else None
    return {
        "contenders_ok": [r["contender"] for r in ok],
        "same_initial_weights": len(digests) <= 1,
        "init_digests": sorted(digests),
        "first_loss_spread": max(first) - min(first) if ok else None,
        "loss_parity": parity,
    }


def _variant_jobs(variants: list[Variant], spec: dict[str, Any]) -> list[RowJob]:
    """The variants as turbotrain rows: each its overrides on the spec's."""
    jobs = []
    for v in variants:
        model = {**spec["model"], "kwargs": {**spec["model"]["kwargs"], **v.model}}
        extra = {"change": v.change, "overrides": v.overrides, "model_overrides": v.model}
        if v.ladder:
            extra["ladder"] = v.ladder
        row = {**spec, "turbotrain_overrides": v.overrides, "model": model}
        jobs.append(RowJob(v.name, "turbotrain", row, skip=v.skip, extra=extra))
    return jobs


def _known(every: list[Variant], only: Sequence[str], kind: str) -> list[Variant]:
    """``every`` row of a matrix, once ``only`` is checked to name rows of it (a one-line error)."""
    unknown = sorted(set(only) - {v.name for v in every})
    if unknown:
        raise ValueError(f"unknown {kind} row(s) {unknown}; choose from {', '.join(v.name for v in every)}")
    return every


def run_precision_matrix(w: BenchWorkload, opts: BenchOptions, only: Sequence[str] = ()) -> dict[str, Any]:
    """Each precision this device supports against fp32 (speed, memory, loss); recommends the
    fastest within tolerance (``only``: just these rows, beside fp32)."""
    every = _known(precision_variants(opts.device), only, "precision")
    variants = [v for v in every if not only or v.name in only or v.name == "fp32"]

    def finish(rows: list[dict[str, Any]], report: dict[str, Any]) -> None:
        ref = next((r for r in rows if r["row"] == "fp32"), None)
        compare_to(rows, ref, speed_key="speedup")
        if ref and ref.get("status") == "ok" and "peak_mem_gib" in ref:
            for r in rows:
                if r.get("status") == "ok" and "peak_mem_gib" in r:
                    r["mem_reduction"] = 1.0 - r["peak_mem_gib"] / ref["peak_mem_gib"]
        report.update(
            reference="fp32",
            notes=[
                "rows run with compile off so each isolates the precision; see --matrix ablation for compile"
            ],
            summary={"recommendation": recommend(rows)},
        )

    return _run(w, opts, "precision", partial(_variant_jobs, variants), finish)


def recommend(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest ok row whose final loss is within tolerance of fp32, if it is at least
    RECOMMEND_MIN_SPEEDUP x fp32's speed (else fp32 itself); None when fp32 did not run."""
    good = [r for r in rows if r.get("status") == "ok" and r.get("loss_within_tol")]
    if not good:
        return None
    best = min(good, key=lambda r: r["step_ms_median"])
    reference = next((r for r in good if r.get("row") == "fp32"), None)
    if reference is not None and best.get("speedup", 1.0) < RECOMMEND_MIN_SPEEDUP:
        best = reference
    rejected = [r["row"] for r in rows if r.get("status") == "ok" and not r.get("loss_within_tol")]
    return {
        "row": best["row"],
        "speedup": best.get("speedup"),
        "loss_diff": best.get("loss_diff"),
        "outside_tolerance": rejected,
        "min_speedup": RECOMMEND_MIN_SPEEDUP,
        "text": f"{best['row']}: {best.get('speedup', 1.0):.2f}x fp32's speed, final loss within "
        f"{best['loss_tol']:.3g} nats of fp32 ({best['loss_diff']:+.4f}); a row must be >= "
        f"{RECOMMEND_MIN_SPEEDUP:.2f}x fp32 to be preferred"
        + (f"; outside tolerance: {', '.join(rejected)}" if rejected else ""),
    }


def run_ablation(w: BenchWorkload, opts: BenchOptions, only: Sequence[str] = ()) -> dict[str, Any]:
    """Each ladder (LADDERS), every row against its ladder's base (``only``: these rows, beside their bases)."""
    every = _known(ablation_variants(w, opts.device), only, "ablation")
    ladders = {v.ladder for v in every if v.name in only}
    bases = {LADDERS[ladder]["reference"] for ladder in ladders}
    variants = [v for v in every if not only or v.name in only or v.name in bases]

    def finish(rows: list[dict[str, Any]], report: dict[str, Any]) -> None:
        for ladder, about in LADDERS.items():
            ref = next((r for r in rows if r["row"] == about["reference"]), None)
            compare_to([r for r in rows if r.get("ladder") == ladder], ref, speed_key="speedup")
        report.update(reference="baseline", ladders=LADDERS)

    return _run(w, opts, "ablation", partial(_variant_jobs, variants), finish)
