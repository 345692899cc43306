"""``turbotrain report RUN``: PNG plots, summary.md and summary.json from a run directory, handed to
the run's experiment trackers. A crashed run is fine: a cut-off last line or a plot whose metric was
never recorded is skipped, with the reason.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from ..base.atomic import atomic_write
from ..base.errors import TurbotrainError
from ..base.records import metric_keys, read_metrics  # noqa: F401 (the report's names before the split)
from ..base.rundir import CHOOSE_FILE, CONFIG_FILE, METRICS_FILE, PLOTS_DIR, SUMMARY_FILE, SUMMARY_MD
from ..core.compile_guard import payback_step
from ..core.meter.table import figure
from ..core.precision.fp8_choice import FP8Choice
from ..loop.monitor.trackers import publish
from . import expert_report
from .plots import NO_FLOPS, PLOTS, PlotSpec, Series, plots_for, write_plots  # noqa: F401 (as above)
from .summary import steady_records, summarize_records, write_summary  # noqa: F401 (as above)


@dataclass
class RunFiles:
    """What was found in a run directory, and what was wrong with it."""

    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # one line each, shown to the user


def load_run(run_dir: str | Path) -> RunFiles:
    """Read a run directory. Raises TurbotrainError only when there is nothing to report on."""
    path = Path(run_dir)
    if not path.is_dir():
        raise TurbotrainError(
            f"run directory {path} does not exist; pass a directory made by `turbotrain train` (e.g. runs/NAME)"
        )
    data = RunFiles(path)
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


_fmt = partial(figure, missing="n/a")  # the report's missing figure


def _title(summary: dict[str, Any]) -> list[str]:
    lines = [f"# Run `{summary['run']}`: {summary['status']}", ""]
    if summary.get("steps") is not None:
        # tokens when its batches held token ids, samples otherwise (an image model's "0 tokens" says nothing)
        amount = f"{_fmt(summary.get('tokens'), ',d')} tokens"
        if not summary.get("tokens") and summary.get("samples"):
            amount = f"{summary['samples']:,d} samples"
        lines.append(
            f"{summary['steps']} of {summary.get('max_steps', '?')} optimizer steps, {amount}, "
            f"{_fmt(summary.get('elapsed_s'), '.1f', ' s')} in total."
            + (f" Stop reason: {summary['stop_reason']}." if summary.get("stop_reason") else "")
        )
        lines.append("")
    return lines


def _hardware(summary: dict[str, Any]) -> list[str]:
    hw, device = summary.get("hardware") or {}, (summary.get("resolved") or {}).get("device")
    if not hw:
        return ["## Hardware", "", f"- device: {device}" if device else "- not recorded"]
    sheet = hw.get("datasheet")
    return [
        "## Hardware",
        "",
        f"- device: {hw.get('device')} ({hw.get('name')})",
        f"- datasheet: {sheet.get('bf16_tflops')} TFLOP/s dense bf16, {sheet.get('tf32_tflops')} TF32, "
        f"{sheet.get('fp32_tflops')} fp32; {sheet.get('mem_bandwidth_gbs')} GB/s ({sheet.get('name')})"
        if sheet
        else "- datasheet: none for this device, so MFU is left out",
        f"- torch {hw.get('torch')}, CUDA {hw.get('cuda') or 'none'}"
        + (f", driver {hw['driver']}" if hw.get("driver") else "")
        + f"; CPU {hw.get('cpu')} ({hw.get('cpu_cores')} cores, {hw.get('torch_threads')} torch threads)",
    ]


def _optimizations(summary: dict[str, Any]) -> list[str]:
    resolved = summary.get("resolved") or {}
    keys = ("precision", "compile", "optimizer", "attention", "num_workers", "pin_memory")
    table = summary.get("optimizations") or {k: resolved[k] for k in keys if k in resolved}
    rows = ["| setting | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in table.items())]
    return _section("Optimizations in effect", rows if table else ["not recorded"])


def _section(title: str, lines: list[str]) -> list[str]:
    """A summary.md section after the first: none when it has no lines."""
    return ["", f"## {title}", "", *lines] if lines else []


def _fp8_layers(summary: dict[str, Any]) -> list[str]:
    """precision.fp8_layers = 'timed': the decision's line and table."""
    plan = (summary.get("resolved") or {}).get("fp8_layers")
    if not isinstance(plan, dict) or "layers" not in plan:
        return []
    return _section("fp8 per layer (timed)", [plan["line"], "", FP8Choice.from_dict(plan).table()])


def _performance(summary: dict[str, Any]) -> list[str]:
    steady = summary.get("steady_state") or {}
    sheet_pct = steady.get("mfu")
    tokens, windows = steady.get("tokens_per_s"), f"(median of {steady.get('windows', 0)} windows)"
    lines = [
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
    hfu = steady.get("hfu")
    if hfu is not None or steady.get("hw_tflops") is not None:
        lines.append(
            f"| HFU (hardware FLOPs: with activation checkpointing's recomputation) | "
            f"{_fmt(100 * hfu if hfu is not None else None, '.1f', ' %')} ({_fmt(steady.get('hw_tflops'), '.4g')} TFLOP/s) |"
        )
    if summary.get("flops_per_sample"):
        recompute = summary.get("recompute_flops_per_sample")
        lines.append(
            f"| training FLOPs per sample | {summary['flops_per_sample']:.4g} ({summary.get('flops_source', '')})"
            + (f"; recomputed: {recompute:.4g} more" if recompute else "")
            + " |"
        )
    if summary.get("flops_convention"):
        lines.append(f"| MFU counts | {summary['flops_convention']}; recomputation not counted |")
    return _section("Performance", lines)


def _losses(summary: dict[str, Any]) -> list[str]:
    return _section(
        "Losses",
        [
            f"- final train loss: {_fmt(summary.get('final_train_loss'), '.4f')} (step {summary.get('final_train_step', summary.get('steps', '?'))})",
            f"- final validation loss: {_fmt(summary.get('final_val_loss'), '.4f')} (step {summary.get('final_val_step')})",
            f"- best validation loss: {_fmt(summary.get('best_val_loss'), '.4f')}",
            *_best(summary.get("best")),
            *(f"- final validation {k}: {_fmt(v, '.4f')}" for k, v in more_metrics(summary, "final_val_")),
            *(
                f"- last logged train {k} (engine.log): {_fmt(v, '.4f')}"
                for k, v in more_metrics(summary, "final_train_")
            ),
        ],
    )


def more_metrics(summary: dict[str, Any], prefix: str) -> list[tuple[str, Any]]:
    """(name, value) of the metrics beyond the loss summary.json holds as ``<prefix>NAME`` (``final_val_``)."""
    skip = (f"{prefix}loss", f"{prefix}step")
    return [
        (k[len(prefix) :].replace("_", " "), v)
        for k, v in summary.items()
        if k.startswith(prefix) and k not in skip
    ]


def _best(best: dict[str, Any] | None) -> list[str]:
    """The watched metric's best pass and the checkpoint kept of it (``[best]``)."""
    if not best:
        return []
    kept = f"; its checkpoint: `{best['checkpoint']}`" if best.get("checkpoint") else ""
    return [
        f"- best {best['metric']} ({best['mode']}): {_fmt(best.get('value'), '.4f')} at step {best['step']}{kept}"
    ]


def _epochs(summary: dict[str, Any]) -> list[str]:
    epochs = summary.get("epochs") or []
    if not epochs:  # train.epochs: one row per epoch
        return []
    keys = [k for k in epochs[-1] if k.startswith("epoch_")]
    return _section(
        "Epochs",
        [
            "| epoch | step | " + " | ".join(k[len("epoch_") :].replace("_", " ") for k in keys) + " |",
            "|---|---|" + "---|" * len(keys),
            *(
                f"| {e['epoch']} | {e['step']} | " + " | ".join(_fmt(e.get(k), ".4g") for k in keys) + " |"
                for e in epochs
            ),
        ],
    )


def _compile(summary: dict[str, Any]) -> list[str]:
    comp = summary.get("compile") or {}
    if not (comp.get("frames_compiled") or comp.get("graph_breaks")):
        return []
    lines = [
        f"- frames compiled {comp['frames_compiled']}, recompilations {comp.get('recompiles')} "
        f"({_fmt(comp.get('recompiles_after_warmup'), 'd')} after warm-up), graph breaks {comp.get('graph_breaks')}",
    ]
    lines += [f"- recompiled because {r}" for r in comp.get("recompile_reasons", [])]
    lines += [f"- graph break: {r}" for r in comp.get("graph_break_reasons", [])]
    if comp.get("warning"):
        lines.append(f"- **warning**: {comp['warning']}")
    lines.append(
        f"- compiling took {_fmt(comp.get('compile_s'), '.1f', ' s')} (dynamo's timers), paid back at step "
        f"{_fmt(comp.get('paid_back_at_step'), ',d')} (against choose's eager step); {comp.get('warm_start', '')}"
    )
    return _section("Compile", lines)


def _choose(summary: dict[str, Any]) -> list[str]:
    """The decision table of the settings chosen by measurement (choose.measure)."""
    choose = summary.get("choose")
    return ["", "## Settings chosen by measurement", "", *choose["table"]] if choose else []


def _restarts(summary: dict[str, Any]) -> list[str]:
    restarts = summary.get("restarts") or {}
    if not restarts.get("count"):
        return []
    head = f"{restarts['count']} restart(s), each resuming by itself from its newest verified checkpoint:"
    return _section("Restarts", [head, ""]) + [
        f"- {r.get('time')}: resumed at step {r.get('step')} from {r.get('resumed_from') or 'the start (no checkpoint yet)'}"
        f" on {r.get('world_size')} process(es), {r.get('steps_redone')} logged step(s) trained again ({r.get('why')})"
        for r in restarts.get("each", [])
    ]


def _events(summary: dict[str, Any]) -> list[str]:
    events = summary.get("events") or []
    return _section("Events", [f"- step {e['step']}: {e['kind']}: {e['detail']}" for e in events])


def _plots_and_notes(summary: dict[str, Any]) -> list[str]:
    report = summary.get("report", {})
    plots = [f"![{Path(p).stem}]({p})" for p in report.get("plots", [])] or ["none"]
    notes = [f"- {n}" for n in report.get("skipped", []) + report.get("problems", [])]
    return _section("Plots", plots) + _section("Notes", notes)


def _config(summary: dict[str, Any]) -> list[str]:
    config = summary.get("config")
    return _section(
        "Resolved config", ["```json", json.dumps(config, indent=2, default=str), "```"] if config else []
    )


# summary.md, top to bottom: each a function of summary.json's dict that returns its lines
SECTIONS: list[Callable[[dict[str, Any]], list[str]]] = [
    _title,
    _hardware,
    _optimizations,
    _fp8_layers,
    _choose,
    _performance,
    _losses,
    _epochs,
    _compile,
    lambda summary: expert_report.markdown(summary.get("experts")),
    _restarts,
    _events,
    _plots_and_notes,
    _config,
]


def format_markdown(summary: dict[str, Any]) -> str:
    """summary.md: :data:`SECTIONS` in order."""
    return "\n".join(line for section in SECTIONS for line in section(summary)) + "\n"


@dataclass
class ReportResult:
    run_dir: Path
    plots: list[str]
    skipped: list[str]
    problems: list[str]
    summary: dict[str, Any]


def write_report(run_dir: str | Path) -> ReportResult:
    """Plots, summary.md and summary.json for ``run_dir``."""
    data = load_run(run_dir)
    name = data.summary.get("run") or data.path.name
    hw = data.summary.get("hardware", {}).get("name") or data.summary.get("resolved", {}).get("device", "")
    plots, skipped = write_plots(
        data.records, data.path / PLOTS_DIR, f"run {name}" + (f" on {hw}" if hw else "")
    )
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
    if (data.path / CHOOSE_FILE).is_file():  # settings chosen by measurement (choose.measure)
        known["choose"] = json.loads((data.path / CHOOSE_FILE).read_text())
        eager = next((r["step_ms"] for r in known["choose"]["rows"] if r.get("baseline")), None)
        steady = summarize_records(data.records).get("steady_state") or {} if data.records else {}
        if known.get("compile"):  # the step at which compiling paid back, against choose's eager step
            comp = known["compile"]
            comp["paid_back_at_step"] = payback_step(comp.get("compile_s"), eager, steady.get("step_ms"))
    summary = write_summary(
        data.path,
        known,
        data.records,
        report={"plots": plots, "skipped": skipped, "problems": data.problems},
        **({"experts": expert_report.summarize(experts)} if experts is not None else {}),
    )
    atomic_write(data.path / SUMMARY_MD, format_markdown(summary))
    # the experiment trackers the run logged to (trackers.json): the summary, the plots as artefacts
    files = [data.path / p for p in plots] + [data.path / SUMMARY_FILE, data.path / SUMMARY_MD]
    problems = data.problems + publish(data.path, summary, files)
    return ReportResult(data.path, plots, skipped, problems, summary)
