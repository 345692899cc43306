"""``turbotrain report RUN``: PNG plots and a performance summary from a run directory.

Reads what a run leaves behind (``metrics.jsonl``, ``config.toml``, ``summary.json``) and writes
``plots/*.png`` (loss, learning rate, throughput, MFU, memory, GPU utilisation against step),
``summary.md`` and ``summary.json``. A crashed run is fine: a last line cut off mid-write is
skipped and reported, and a plot whose metric was never recorded (memory and MFU on a CPU) is
skipped with the reason.

This module is the only writer of ``summary.json`` (:func:`write_summary`): training hands it the
facts it knows, and every figure that comes from the metrics (the final losses among them) is
computed here once, by :func:`summarize_records`.
"""

from __future__ import annotations

import json
import statistics
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..base.atomic import atomic_write
from ..base.errors import TurbotrainError
from ..base.rundir import CONFIG_FILE, METRICS_FILE, PLOTS_DIR, SUMMARY_FILE, SUMMARY_MD
from . import expert_report

# ----------------------------------------------------------------------------- reading


@dataclass
class RunData:
    """What was found in a run directory, and what was wrong with it."""

    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # one line each, shown to the user


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Records from a metrics.jsonl, skipping (and naming) lines that are not whole JSON records,
    such as the last line of a run killed mid-write."""
    records: list[dict[str, Any]] = []
    problems: list[str] = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            where = "the last line" if number == len(lines) else f"line {number}"
            problems.append(
                f"{path.name}: {where} is cut off or not JSON ({line[:40]!r}...); skipped it (a crashed run?)"
            )
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            problems.append(f"{path.name}: line {number} has no integer 'step'; skipped it")
            continue
        records.append(record)
    return records, problems


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory. Raises TurbotrainError only when there is nothing to report on."""
    path = Path(run_dir)
    if not path.is_dir():
        raise TurbotrainError(
            f"run directory {path} does not exist; pass a directory made by `turbotrain train` (e.g. runs/NAME)"
        )
    data = RunData(path)
    found = [name for name in (METRICS_FILE, CONFIG_FILE, SUMMARY_FILE) if (path / name).is_file()]
    if not found:
        raise TurbotrainError(
            f"{path} is not a run directory: it has no {METRICS_FILE}, {CONFIG_FILE} or {SUMMARY_FILE}"
        )
    if (path / METRICS_FILE).is_file():
        data.records, data.problems = read_metrics(path / METRICS_FILE)
        if not data.records:
            data.problems.append(f"{METRICS_FILE} holds no complete records: nothing to plot")
    else:
        data.problems.append(f"no {METRICS_FILE}: the run logged no metrics, nothing to plot")
    if (path / CONFIG_FILE).is_file():
        try:
            data.config = tomllib.loads((path / CONFIG_FILE).read_text())
        except tomllib.TOMLDecodeError as exc:
            data.problems.append(f"{CONFIG_FILE} is not valid TOML ({exc}); config left out")
    else:
        data.problems.append(f"no {CONFIG_FILE}: config left out")
    if (path / SUMMARY_FILE).is_file():
        try:
            loaded = json.loads((path / SUMMARY_FILE).read_text())
            data.summary = loaded if isinstance(loaded, dict) else {}
        except json.JSONDecodeError:
            data.problems.append(f"{SUMMARY_FILE} is not valid JSON; rebuilt from the metrics")
    else:
        data.problems.append(
            f"no {SUMMARY_FILE} from training (the run did not finish?); summary built from the metrics"
        )
    return data


# ----------------------------------------------------------------------------- numbers


def _values(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [
        (r["step"], float(r[key]))
        for r in records
        if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
    ]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def steady_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records that describe steady-state speed: without the first logging window (warm-up,
    compilation and caches settle there) when there are at least three windows."""
    timed = [r for r in records if r.get("step_ms")]
    return timed[1:] if len(timed) >= 3 else timed


def summarize_records(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Steady-state medians (tokens/s, samples/s, step ms, achieved TFLOP/s, MFU), the median
    tokens/s of all windows, peak device memory in GiB, GPU utilisation and the final/best
    losses, from metrics records; the restarts (event records a relaunch wrote) as a list."""
    restarts = [r for r in records if r.get("event") == "restart"]
    epochs = [{k: v for k, v in r.items() if k != "event"} for r in records if r.get("event") == "epoch"]
    records = [r for r in records if "event" not in r]
    steady = steady_records(records)
    med = lambda key: _median([v for _, v in _values(steady, key)])  # noqa: E731
    losses = _values(records, "loss")
    vals = _values(records, "val_loss")
    peaks = [v for _, v in _values(records, "mem_peak_gib")]
    return {
        "tokens_per_s_median": _median([v for _, v in _values(records, "tokens_per_s") if v]),
        "steady_state": {
            "windows": len(steady),
            "tokens_per_s": med("tokens_per_s"),
            "samples_per_s": med("samples_per_s"),
            "step_ms": med("step_ms"),
            "tflops": med("tflops"),
            "mfu": med("mfu"),
            "gpu_util_pct": med("gpu_util_pct"),
            "gpu_power_w": med("gpu_power_w"),
        },
        "peak_memory_gib": max(peaks) if peaks else None,
        "final_train_loss": losses[-1][1] if losses else None,
        "final_train_step": losses[-1][0] if losses else None,
        "final_val_loss": vals[-1][1] if vals else None,
        "final_val_step": vals[-1][0] if vals else None,
        "best_val_loss": min(v for _, v in vals) if vals else None,
        **{
            f"final_{key}": values[-1][1] for key in metric_keys(records) if (values := _values(records, key))
        },
        "logged_steps": len(records),
        "last_step": records[-1]["step"] if records else None,
        **({"epochs": epochs} if epochs else {}),
        **(
            {
                "restarts": {
                    "count": len(restarts),
                    "each": [{k: v for k, v in r.items() if k != "event"} for r in restarts],
                }
            }
            if restarts
            else {}
        ),
    }


# ----------------------------------------------------------------------------- plots


@dataclass(frozen=True)
class Series:
    key: str
    label: str
    scale: float = 1.0
    style: str = "-"


@dataclass(frozen=True)
class PlotSpec:
    """One PNG: ``series`` on the left axis (and ``right`` on a second axis)."""

    file: str
    title: str
    ylabel: str
    series: tuple[Series, ...]
    right: tuple[Series, ...] = ()
    right_label: str = ""
    logy: bool = False
    missing: str = ""  # why the metric may be absent
    fallback_title: str = ""  # when only the right-axis series has data


PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec(
        "loss.png",
        "Training and validation loss",
        "loss (cross-entropy, nats per token)",
        (
            Series("loss", "train loss (last step of each window)"),
            Series("val_loss", "validation loss", style="o-"),
        ),
    ),
    PlotSpec("lr.png", "Learning rate schedule", "learning rate", (Series("lr", "learning rate"),)),
    PlotSpec(
        "throughput.png",
        "Training throughput",
        "tokens per second",
        (Series("tokens_per_s", "tokens/s"),),
        right=(Series("step_ms", "step time (ms)", style="--"),),
        right_label="step time (ms)",
    ),
    PlotSpec(
        "mfu.png",
        "Model FLOPs utilisation (MFU)",
        "MFU (% of dense datasheet peak)",
        (Series("mfu", "MFU", scale=100.0),),
        right=(Series("tflops", "achieved model TFLOP/s", style="--"),),
        right_label="achieved TFLOP/s",
        missing="no datasheet peak for this device (CPU or unknown GPU): MFU left out",
        fallback_title="Achieved model TFLOP/s (MFU left out: no datasheet peak for this device)",
    ),
    PlotSpec(
        "memory.png",
        "Device memory (CUDA caching allocator)",
        "memory (GiB)",
        (
            Series("mem_allocated_gib", "allocated"),
            Series("mem_reserved_gib", "reserved", style="--"),
            Series("mem_peak_gib", "peak allocated", style=":"),
        ),
        missing="device memory is only measured on CUDA",
    ),
    PlotSpec(
        "gpu.png",
        "GPU utilisation and power (NVML)",
        "GPU utilisation (%)",
        (
            Series("gpu_util_pct", "SM utilisation (%)"),
            Series("gpu_mem_util_pct", "memory-bus utilisation (%)", style="--"),
        ),
        right=(Series("gpu_power_w", "power (W)", style=":"),),
        right_label="power (W)",
        missing="NVML sampling needs an NVIDIA GPU and driver (monitor.nvml = true)",
    ),
)

NO_FLOPS = "no FLOP count for this model (give the monitor an example batch to count them)"


NOT_METRICS = ("val_loss", "val_step")


def metric_keys(records: list[dict[str, Any]]) -> list[str]:
    """The validation metrics besides the loss (``val_accuracy``, ...) and what ``engine.log`` logged
    (``train_accuracy``, ...) in ``records``, in first-seen order."""
    keys: dict[str, None] = {}
    for r in records:
        if "event" not in r:
            keys.update((k, None) for k in r if k.startswith(("val_", "train_")) and k not in NOT_METRICS)
    return list(keys)


def plots_for(records: list[dict[str, Any]]) -> tuple[PlotSpec, ...]:
    """:data:`PLOTS` labelled for what was measured: a language model's loss is in nats per token
    and its throughput in tokens/s; any other model's loss is just its loss and its throughput is
    in samples/s. MFU's note says why it is missing: no FLOP count, or no datasheet peak."""
    tokens = any(v for _, v in _values(records, "tokens_per_s"))
    counted = bool(_values(records, "tflops"))
    out = []
    for spec in PLOTS:
        if spec.file == "loss.png" and not tokens:
            spec = replace(spec, ylabel="loss")
        elif spec.file == "throughput.png" and not tokens:
            spec = replace(spec, ylabel="samples per second", series=(Series("samples_per_s", "samples/s"),))
        elif spec.file == "mfu.png" and not counted:
            spec = replace(spec, missing=NO_FLOPS)
        out.append(spec)
    metrics = metric_keys(records)
    if metrics:  # the workload's own (accuracy, ...): validation metrics and what engine.log logged
        out.insert(
            1,
            PlotSpec(
                "metrics.png",
                "Your metrics",
                "value",
                tuple(
                    Series(
                        k,
                        ("validation " if k.startswith("val_") else "train ")
                        + k.partition("_")[2].replace("_", " "),
                        style="o-" if k.startswith("val_") else "-",
                    )
                    for k in metrics
                ),
            ),
        )
    return tuple(out)


COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")


def _draw(spec: PlotSpec, records: list[dict[str, Any]], path: Path, subtitle: str) -> bool:
    """Render one plot; False when none of its series has data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    left = [(s, _values(records, s.key)) for s in spec.series]
    right = [(s, _values(records, s.key)) for s in spec.right]
    left = [(s, v) for s, v in left if v]
    right = [(s, v) for s, v in right if v]
    if not left and not right:
        return False
    title = spec.title
    if not left:  # e.g. achieved TFLOP/s without an MFU: draw it on the main axis, say why
        left, right = right, []
        ylabel = right_label = spec.right_label
        title = spec.fallback_title or spec.title
    else:
        ylabel, right_label = spec.ylabel, spec.right_label
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    handles = []
    color = iter(COLORS)
    few = len(records) <= 40  # mark the logged points when there are few of them

    def draw(axis: Any, s: Series, v: list[tuple[int, float]]) -> list[Any]:
        xs, ys = zip(*v)
        marker = "o" if "o" in s.style else ("." if few else None)
        return axis.plot(
            xs,
            [y * s.scale for y in ys],
            linestyle=s.style.replace("o", "") or "-",
            marker=marker,
            color=next(color),
            label=s.label,
            markersize=5,
        )

    for s, v in left:
        handles += draw(ax, s, v)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    if spec.logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    if right:
        ax2 = ax.twinx()
        for s, v in right:
            handles += draw(ax2, s, v)
        ax2.set_ylabel(right_label)
        ax2.set_ylim(0, ax2.get_ylim()[1] * 1.08)
    if spec.file in ("throughput.png", "mfu.png", "memory.png", "gpu.png"):
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)  # rates from zero, with headroom above the line
    if spec.file == "lr.png":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    # Below the axes, so it never hides a line.
    ax.legend(
        handles=handles,
        labels=[h.get_label() for h in handles],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        ncol=min(3, len(handles)),
        fontsize=9,
        frameon=False,
    )
    ax.set_title(f"{title}\n{subtitle}", fontsize=11)
    atomic_write(path, lambda f: fig.savefig(f, format="png", bbox_inches="tight"))
    plt.close(fig)
    return True


def write_plots(data: RunData, out_dir: Path) -> tuple[list[str], list[str]]:
    """PNG files written (relative to the run directory) and one line per plot skipped."""
    written, skipped = [], []
    if not data.records:
        return written, ["all plots: no metrics records"]
    out_dir.mkdir(parents=True, exist_ok=True)
    name = data.summary.get("run") or data.path.name
    hw = data.summary.get("hardware", {}).get("name") or data.summary.get("resolved", {}).get("device", "")
    subtitle = f"run {name}" + (f" on {hw}" if hw else "")
    for spec in plots_for(data.records):
        if _draw(spec, data.records, out_dir / spec.file, subtitle):
            written.append(f"{out_dir.name}/{spec.file}")
            if spec.file == "mfu.png" and not _values(data.records, "mfu"):
                skipped.append(f"{spec.file}: shows achieved TFLOP/s only; {spec.missing}")
        else:
            keys = ", ".join(s.key for s in (*spec.series, *spec.right))
            skipped.append(
                f"{spec.file}: skipped, no {keys} in the metrics"
                + (f" ({spec.missing})" if spec.missing else "")
            )
    return written, skipped


# ----------------------------------------------------------------------------- summary


def _fmt(value: Any, spec: str = ",.1f", unit: str = "") -> str:
    if value is None:
        return "n/a"
    return f"{value:{spec}}{unit}"


def write_summary(
    run_dir: Path, facts: dict[str, Any], records: list[dict[str, Any]], **more: Any
) -> dict[str, Any]:
    """Write the run's summary.json (atomically) and return it: ``facts`` (what training knows:
    status, steps, hardware, events, ...), the figures from the metrics ``records`` (when there
    are any) on top, then ``more``."""
    summary = {**facts, **(summarize_records(records) if records else {}), **more}
    atomic_write(run_dir / SUMMARY_FILE, json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def _amount(summary: dict[str, Any]) -> str:
    """What the run trained on: tokens when its batches held token ids, samples otherwise (an image
    model's "0 tokens" says nothing)."""
    if not summary.get("tokens") and summary.get("samples"):
        return f"{summary['samples']:,d} samples"
    return f"{_fmt(summary.get('tokens'), ',d')} tokens"


def format_markdown(summary: dict[str, Any]) -> str:
    """summary.md: hardware, optimizations, speed, losses, config, plots, notes."""
    steady = summary.get("steady_state") or {}
    hw = summary.get("hardware") or {}
    opts = summary.get("optimizations") or {}
    resolved = summary.get("resolved") or {}
    lines = [f"# Run `{summary['run']}`: {summary['status']}", ""]
    if summary.get("steps") is not None:
        lines.append(
            f"{summary['steps']} of {summary.get('max_steps', '?')} optimizer steps, {_amount(summary)}, "
            f"{_fmt(summary.get('elapsed_s'), '.1f', ' s')} in total."
            + (f" Stop reason: {summary['stop_reason']}." if summary.get("stop_reason") else "")
        )
        lines.append("")
    lines += ["## Hardware", ""]
    if hw:
        sheet = hw.get("datasheet")
        lines.append(f"- device: {hw.get('device')} ({hw.get('name')})")
        if sheet:
            lines.append(
                f"- datasheet: {sheet.get('bf16_tflops')} TFLOP/s dense bf16, {sheet.get('tf32_tflops')} TF32, "
                f"{sheet.get('fp32_tflops')} fp32; {sheet.get('mem_bandwidth_gbs')} GB/s ({sheet.get('name')})"
            )
        else:
            lines.append("- datasheet: none for this device, so MFU is left out")
        lines.append(
            f"- torch {hw.get('torch')}, CUDA {hw.get('cuda') or 'none'}"
            + (f", driver {hw['driver']}" if hw.get("driver") else "")
            + f"; CPU {hw.get('cpu')} ({hw.get('cpu_cores')} cores, {hw.get('torch_threads')} torch threads)"
        )
    elif resolved.get("device"):
        lines.append(f"- device: {resolved['device']}")
    else:
        lines.append("- not recorded")
    lines += ["", "## Optimizations in effect", ""]
    table = opts or {
        k: resolved[k]
        for k in ("precision", "compile", "optimizer", "attention", "num_workers", "pin_memory")
        if k in resolved
    }
    if table:
        lines += ["| setting | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in table.items()]
    else:
        lines.append("not recorded")
    sheet_pct = steady.get("mfu")
    tokens, windows = steady.get("tokens_per_s"), f"(median of {steady.get('windows', 0)} windows)"
    lines += [
        "",
        "## Performance",
        "",
        "| metric | value |",
        "|---|---|",
        f"| time to first step (warm-up, compilation) | {_fmt(summary.get('first_step_s'), '.2f', ' s')} |",
        # no token ids (images): left out
        *([f"| steady-state tokens/s {windows} | {_fmt(tokens, ',.0f')} |"] if tokens else []),
        f"| steady-state samples/s{'' if tokens else ' ' + windows} | {_fmt(steady.get('samples_per_s'), ',.1f')} |",
        f"| step time (median) | {_fmt(steady.get('step_ms'), ',.1f', ' ms')} |",
        f"| achieved model TFLOP/s | {_fmt(steady.get('tflops'), '.4g')} |",
        f"| MFU | {_fmt(100 * sheet_pct if sheet_pct is not None else None, '.1f', ' %')} |",
        f"| peak device memory | {_fmt(summary.get('peak_memory_gib'), '.2f', ' GiB')} |",
    ]
    if summary.get("host_peak_rss_gib") is not None:
        lines.append(
            f"| peak host memory (process RSS) | {_fmt(summary['host_peak_rss_gib'], '.2f', ' GiB')} |"
        )
    if steady.get("gpu_util_pct") is not None:
        lines.append(f"| GPU utilisation (median) | {_fmt(steady['gpu_util_pct'], '.0f', ' %')} |")
    if summary.get("flops_per_sample"):
        lines.append(
            f"| training FLOPs per sample | {summary['flops_per_sample']:.4g} ({summary.get('flops_source', '')}) |"
        )
    lines += [
        "",
        "## Losses",
        "",
        f"- final train loss: {_fmt(summary.get('final_train_loss'), '.4f')} (step {summary.get('final_train_step', summary.get('steps', '?'))})",
        f"- final validation loss: {_fmt(summary.get('final_val_loss'), '.4f')} (step {summary.get('final_val_step')})",
        f"- best validation loss: {_fmt(summary.get('best_val_loss'), '.4f')}",
        *(
            f"- final validation {k[len('final_val_') :].replace('_', ' ')}: {_fmt(v, '.4f')}"
            for k, v in summary.items()
            if k.startswith("final_val_") and k not in ("final_val_loss", "final_val_step")
        ),
        *(
            f"- last logged train {k[len('final_train_') :].replace('_', ' ')} (engine.log): {_fmt(v, '.4f')}"
            for k, v in summary.items()
            if k.startswith("final_train_") and k not in ("final_train_loss", "final_train_step")
        ),
    ]
    epochs = summary.get("epochs") or []
    if epochs:  # train.epochs: one row per epoch
        keys = [k for k in epochs[-1] if k.startswith("epoch_")]
        lines += [
            "",
            "## Epochs",
            "",
            "| epoch | step | " + " | ".join(k[len("epoch_") :].replace("_", " ") for k in keys) + " |",
            "|---|---|" + "---|" * len(keys),
        ]
        lines += [
            f"| {e['epoch']} | {e['step']} | " + " | ".join(_fmt(e.get(k), ".4g") for k in keys) + " |"
            for e in epochs
        ]
    comp = summary.get("compile") or {}
    if comp.get("frames_compiled") or comp.get("graph_breaks"):
        lines += [
            "",
            "## Compile",
            "",
            f"- frames compiled {comp['frames_compiled']}, recompilations {comp.get('recompiles')} "
            f"({_fmt(comp.get('recompiles_after_warmup'), 'd')} after warm-up), graph breaks {comp.get('graph_breaks')}",
        ]
        lines += [f"- recompiled because {r}" for r in comp.get("recompile_reasons", [])]
        lines += [f"- graph break: {r}" for r in comp.get("graph_break_reasons", [])]
        if comp.get("warning"):
            lines.append(f"- **warning**: {comp['warning']}")
    lines += expert_report.markdown(summary.get("experts"))
    restarts = summary.get("restarts") or {}
    if restarts.get("count"):
        lines += [
            "",
            "## Restarts",
            "",
            f"{restarts['count']} restart(s), each resuming by itself from its newest verified checkpoint:",
            "",
        ]
        lines += [
            f"- {r.get('time')}: resumed at step {r.get('step')} from {r.get('resumed_from') or 'the start (no checkpoint yet)'}"
            f" on {r.get('world_size')} process(es), {r.get('steps_redone')} logged step(s) trained again ({r.get('why')})"
            for r in restarts.get("each", [])
        ]
    events = summary.get("events") or []
    if events:
        lines += ["", "## Events", ""] + [f"- step {e['step']}: {e['kind']}: {e['detail']}" for e in events]
    report = summary.get("report", {})
    lines += ["", "## Plots", ""]
    lines += [f"![{Path(p).stem}]({p})" for p in report.get("plots", [])] or ["none"]
    notes = report.get("skipped", []) + report.get("problems", [])
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    config = summary.get("config")
    if config:
        lines += ["", "## Resolved config", "", "```json", json.dumps(config, indent=2, default=str), "```"]
    return "\n".join(lines) + "\n"


@dataclass
class ReportResult:
    run_dir: Path
    plots: list[str]
    skipped: list[str]
    problems: list[str]
    summary: dict[str, Any]


def write_report(run_dir: str | Path) -> ReportResult:
    """Plots, summary.md and summary.json for ``run_dir``; see the module docstring."""
    data = load_run(run_dir)
    plots, skipped = write_plots(data, data.path / PLOTS_DIR)
    experts = expert_report.read_experts(data.path)  # a mixture-of-experts run: its load and placement
    if experts is not None:
        plots += expert_report.write_plots(experts, data.path / PLOTS_DIR, f"run {data.path.name}")
    # training's summary first
    known = {
        "run": data.path.name,
        "status": "unknown (no summary.json from training)",
        **({"config": data.config} if data.config else {}),
        **data.summary,
    }
    summary = write_summary(
        data.path,
        known,
        data.records,
        report={"plots": plots, "skipped": skipped, "problems": data.problems},
        **({"experts": expert_report.summarize(experts)} if experts is not None else {}),
    )
    atomic_write(data.path / SUMMARY_MD, format_markdown(summary))
    return ReportResult(data.path, plots, skipped, data.problems, summary)
