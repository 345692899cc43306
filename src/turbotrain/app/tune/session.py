"""One ``turbotrain tune``: the run folder, the search space, the study, and the files at the end.

The run folder (``run.out_dir/run.name``, default ``tune-<preset or FUNC>-<time>``) holds the study
(``study.db``, SQLite: run the same command with the same ``--run.name`` to continue it), each
trial's spec, log and metrics under ``trials/``, and ``tune.json``, ``tune.md``, ``tune.png`` and
``best.toml`` (or ``--out``). They are written at the end, and also when Ctrl-C or SIGTERM stops the study.
"""

from __future__ import annotations

import copy
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from ...base.atomic import atomic_write
from ...base.config import RunConfig, flat, to_toml
from ...base.errors import ConfigError
from ...base.failure import EMPTY_LOADER, workload_failed
from ...base.rundir import new_run_dir
from ...core.device import resolve_device
from ...core.meter.table import DASH, figure, render_table
from ...core.precision import DeviceCaps, resolve_precision
from ...core.window import default_loss
from ...parts.models.blocks import repeated_blocks
from ...parts.models.workload_spec import WorkloadSpec
from ...parts.workload import Workload, load_workload
from ..measure import Target
from .runner import ProcessRunner, TuneOptions
from .space import MICRO, Dim, ModelFacts, build_space, micro_choices, to_changes
from .study import STUDY_DB, STUDY_NAME, Log, Study, StudyStopped, require_optuna

BEST_FILE, JSON_FILE, MD_FILE, PLOT_FILE = "best.toml", "tune.json", "tune.md", "tune.png"

COLORS = {
    "ok": "tab:green",
    "pruned": "tab:gray",
    "over budget": "tab:red",
    "predicted over budget": "salmon",
    "oom": "darkred",
    "loss parity": "tab:orange",
    "failed": "black",
    "timeout": "black",
    "invalid": "tab:purple",
}


def _param(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: str(r["params"].get(key, DASH))


def trials_table(rows: list[dict[str, Any]], keys: list[str]) -> str:
    """Markdown: one row per trial with its parameters and figures."""
    columns: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("#", lambda r: str(r["number"]) + (" (baseline)" if r.get("baseline") else "")),
        ("status", lambda r: r.get("status", r["state"])),
    ]
    columns += [(k.split(".", 1)[1], _param(k)) for k in keys]
    columns += [
        (
            "throughput",
            lambda r: DASH if not r.get("throughput") else f"{r['throughput']:,.0f} {r.get('unit') or ''}",
        ),
        ("peak MiB", lambda r: figure(r.get("peak_bytes") and r["peak_bytes"] / 2**20, ",.1f")),
        ("Δ loss", lambda r: figure(r.get("loss_diff"), "+.4f")),
        ("first step s", lambda r: figure(r.get("first_step_s"), ".1f")),
        ("note", lambda r: r.get("reason") or ""),
    ]
    return render_table(rows, columns)


def write_plot(rows: list[dict[str, Any]], limit_bytes: float | None, unit: str, path: Path) -> None:
    """tune.png: throughput per trial (a pruned trial at its last window; penalised trials
    hollow), and throughput against peak memory with the limit."""
    from matplotlib.figure import Figure  # a dependency, imported when drawing (no pyplot: no global state)
    from matplotlib.patches import Patch

    fig = Figure(figsize=(11, 4))
    left, right = fig.subplots(1, 2)
    rows = [r for r in rows if r.get("status") != "duplicate"]
    for r in rows:
        status = r.get("status", r["state"])
        value = r.get("throughput") or (r.get("windows") or [0.0])[-1]
        color = COLORS.get(status, "tab:blue")
        left.bar(
            r["number"], value, color=color if r.get("feasible") else "none", edgecolor=color, linewidth=1.5
        )
        if r.get("peak_bytes") is not None:
            right.scatter(
                r["peak_bytes"] / 2**20, value, color=color, marker="o" if r.get("feasible") else "x"
            )
    seen = [s for s in COLORS if any(r.get("status", r["state"]) == s for r in rows)]
    left.legend(handles=[Patch(color=COLORS[s], label=s) for s in seen], fontsize=7)
    left.set(xlabel="trial", ylabel=unit, title="throughput per trial (hollow: penalised or pruned)")
    right.set(xlabel="peak memory (MiB)", ylabel=unit, title="throughput against memory")
    if limit_bytes:
        right.axvline(limit_bytes / 2**20, color="tab:red", linestyle="--", label="memory limit")
        right.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, text)


def model_facts(target: Target) -> ModelFacts:
    """What the target allows searching; a workload is loaded here once, so a wrong
    ``--model`` fails before any trial starts."""
    if not target.is_workload:
        return ModelFacts(gpt=True, blocks=True, own_optimizer=False, dataloader=True)
    w = target.workload or load_workload(target.model or "")
    _check_first_batch(w, target.label)
    return ModelFacts(
        gpt=False,
        blocks=repeated_blocks(w.model) is not None,
        own_optimizer=w.optimizer is not None,
        dataloader=isinstance(w.train_loader, DataLoader),
        loader_workers=w.train_loader.num_workers if isinstance(w.train_loader, DataLoader) else None,
    )


def _check_first_batch(w: Workload, label: str) -> None:
    """The workload's loss on its first batch, once (on a copy, in training mode): a bug in the
    user's code is one line naming their file, not the same failure in every trial's process."""
    try:
        batch = next(iter(w.train_loader))
    except StopIteration:
        raise ConfigError(f"tune --model {label}: {EMPTY_LOADER}") from None
    model = copy.deepcopy(w.model).train()
    try:
        (w.loss_fn or default_loss)(model, batch)
    except Exception as exc:  # noqa: BLE001 - the user's code: one line when it is theirs
        failed = workload_failed(f"tune --model {label} (its loss on one batch)", exc)
        if failed is None:
            raise
        raise failed from None


def global_batch(base: RunConfig, target: Target) -> int:
    """Samples per optimizer step, kept by every trial: ``batch.global_size`` when given, else
    the base config's micro-batch x accumulation."""
    if target.is_workload:
        return 1  # a workload's batch is its DataLoader's: not searched
    if base.batch.global_size > 0:
        return base.batch.global_size
    if not isinstance(base.batch.micro, int):
        raise ConfigError(
            "tune keeps the global batch while it searches the micro-batch: give --batch.global_size=N "
            "(or a whole --batch.micro, which is then not searched)"
        )
    return base.batch.micro * base.batch.accumulation


def open_run_dir(target: Target, base: RunConfig) -> tuple[Path, bool]:
    """(folder, resuming): an existing folder with a study is resumed, a new one is created."""
    name = base.run.name or f"tune-{target.label}-{time.strftime('%Y%m%d-%H%M%S')}"
    folder = Path(base.run.out_dir) / name
    if (folder / STUDY_DB).is_file():
        return folder, True
    return new_run_dir(base.replace(run={"name": name})), False


def saved_space(folder: Path) -> list[dict[str, Any]] | None:
    """The search space stored in a study being resumed (so the finder need not run again)."""
    optuna = require_optuna()
    try:
        study = optuna.load_study(study_name=STUDY_NAME, storage=f"sqlite:///{folder / STUDY_DB}")
    except KeyError:
        return None
    identity = study.user_attrs.get("identity") or {}
    return identity.get("space")


def tune(target: Target, options: TuneOptions, out: Path | None, log: Log) -> dict[str, Any]:
    """Run the study (see :mod:`.study`) and write the files; returns the tune document. Ctrl-C
    or SIGTERM end the running trial, write what was measured and return (``doc["interrupted"]``
    names the signal). A trial that fails for a reason no setting changes stops the study: the
    files are written, then :class:`StudyStopped` (one line) is raised."""
    require_optuna()
    base = target.config()
    device = resolve_device(base.run.device)
    facts = model_facts(target)
    g = global_batch(base, target)
    folder, resuming = open_run_dir(target, base)
    runner = ProcessRunner(target, folder, options, status=lambda line: log(line, transient=True))
    space, fits = None, None
    if resuming:
        stored = saved_space(folder)
        space = [Dim(d["key"], tuple(d["choices"]), d["base"]) for d in stored] if stored else None
    if space is None:
        space, fits = _new_space(target, base, device, facts, runner, g, log)
    if not space:
        raise ConfigError(
            "nothing to search: every setting tune would try is fixed on the command line or has one value here"
        )
    precision = resolve_precision(base.precision.mode, DeviceCaps.of(device), base.precision)
    more: dict[str, Any] = {"base_precision": precision, "headroom": base.batch.headroom, "fits_micro": fits}
    study = Study(target, base, space, options, folder, runner, log, g, **more)
    study.open()
    log(
        f"tune {target.label} on {device}: {options.trials} trials of {options.warmup} warm-up + {options.steps} timed steps, "
        f"searching {', '.join(d.key for d in space)} ({folder})"
    )
    interrupted, confirmation, stopped = _run_study(study, options)
    doc = write_outputs(study, folder, out, device.type, confirmation)
    doc["interrupted"] = interrupted
    doc["resume"] = f"--run.out_dir={folder.parent} --run.name={folder.name}"
    if stopped is not None:
        raise StudyStopped(f"{stopped} (trials so far: {folder / JSON_FILE})") from None
    return doc


def _new_space(
    target: Target,
    base: RunConfig,
    device: torch.device,
    facts: ModelFacts,
    runner: ProcessRunner,
    g: int,
    log: Log,
) -> tuple[list[Dim], int | None]:
    """A new study's search space, and the micro-batch the batch finder found to fit (None when
    the micro-batch is not searched: a workload's, or fixed on the command line)."""
    fixed = set(flat(target.overrides))  # section.key settings the user fixed: not searched
    micros, fits = None, None
    if not target.is_workload and MICRO not in fixed and "batch.accumulation" not in fixed:
        log(
            "batch finder: the largest micro-batch that fits, bounding the micro-batch choices",
            transient=True,
        )
        found = runner.find({"batch": {"micro": "auto", "global_size": g, "accumulation": 1}})
        fits = int(found["found"])
        micros = micro_choices(g, fits)
        log(f"batch finder: micro-batch {found['found']} fits; trying {', '.join(map(str, micros))}")
    return build_space(base, device, facts, fixed, micros), fits


def _run_study(study: Study, options: TuneOptions) -> tuple[str, dict[str, Any] | None, StudyStopped | None]:
    """Run the trials and confirm the best: (the interrupting signal or '', confirmation, stop reason)."""
    interrupted, confirmation, stopped = "", None, None
    try:
        study.run()
        best = study.best()
        if (
            best is not None
            and options.confirm
            and not best.get("baseline")
            and study.baseline_row() is not None
        ):
            confirmation = study.confirm(best, options.confirm)
    except KeyboardInterrupt:
        interrupted = "Ctrl-C"
    except SystemExit as exc:  # SIGTERM (turbotrain.base.process.exit_on_sigterm): the running trial is ended; write what was measured
        interrupted = "SIGTERM" if exc.code == 128 + signal.SIGTERM else f"exit {exc.code}"
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one does not cut the files being written
    except StudyStopped as exc:
        stopped = exc
    return interrupted, confirmation, stopped


def write_outputs(
    study: Study, folder: Path, out: Path | None, device_type: str, confirmation: dict[str, Any] | None = None
) -> dict[str, Any]:
    """tune.json, tune.md, tune.png and the best preset (when a trial was feasible). A best
    trial that the confirmation runs did not find faster than the baseline is not written: the
    preset then holds the baseline's settings, and says why."""
    rows = study.rows()
    best = study.best()
    baseline = study.baseline_row()
    ref = study.reference or {}
    limit = study._limit(ref.get("budget_bytes"))
    unit = next((r["unit"] for r in rows if r.get("unit")), "throughput")
    keys = [d.key for d in study.space]
    doc: dict[str, Any] = {
        "schema": "turbotrain-tune/1",
        "run_dir": str(folder),
        "target": study.target.to_dict(),
        "device": device_type,
        "options": study.options.__dict__,
        "space": [d.to_dict() for d in study.space],
        "global_batch": study.global_batch,
        "reference": ref,
        "memory_limit_bytes": limit,
        "trials": rows,
        "best": best,
        "preset": None,
        "counted_trials": study.counted(),
        "confirmation": confirmation,
    }
    if best is not None:
        doc.update(_write_preset(study, folder, out, device_type, best, baseline, confirmation, unit))
    write_text(folder / JSON_FILE, json.dumps(doc, indent=1, default=str) + "\n")
    write_text(
        folder / MD_FILE, f"## turbotrain tune: {study.target.label}\n\n" + trials_table(rows, keys) + "\n"
    )
    write_plot(rows, limit, unit, folder / PLOT_FILE)
    doc["plot"] = str(folder / PLOT_FILE)
    return doc


def _write_preset(
    study: Study,
    folder: Path,
    out: Path | None,
    device_type: str,
    best: dict[str, Any],
    baseline: dict[str, Any] | None,
    confirmation: dict[str, Any] | None,
    unit: str,
) -> dict[str, Any]:
    """Write the preset (see :func:`write_outputs`), headed by how it was found."""
    chosen = best
    ratio = best["throughput"] / baseline["throughput"] if baseline else None
    speedup = f", {ratio:.2f}x the baseline" if ratio is not None else ""
    header = [
        f"turbotrain tune: the fastest feasible of {study.counted()} trials on {device_type} "
        f"(trial {best['number']}: {best['throughput']:,.0f} {unit}{speedup})"
    ]
    if confirmation is not None:
        header.append(
            f"re-measured against the baseline, {confirmation['repeats']} interleaved run(s) each: "
            + (f"{confirmation['speedup']:.2f}x" if "speedup" in confirmation else "no figure")
            + (
                " (confirmed)"
                if confirmation["confirmed"]
                else f" (under {confirmation['min_speedup']:.2f}x: within noise; these are the BASELINE's settings)"
            )
        )
        if not confirmation["confirmed"] and baseline is not None:
            chosen = baseline
    header.append(f"searched: {', '.join(d.key for d in study.space)}; study: {folder}")
    header.append(
        "train with: turbotrain train --preset THIS.toml"
        if not study.target.is_workload
        else f"train with: turbotrain train --model {study.target.model} --preset THIS.toml; an own loop: "
        "Engine(turbotrain.load_config('THIS.toml'))"
    )
    path = out or folder / BEST_FILE
    # the preset ``turbotrain train --preset PATH.toml`` reads, headed by how it was found
    write_text(path, "".join(f"# {line}\n" for line in header) + to_toml(_preset_config(study, chosen)))
    return {"preset": str(path), "preset_trial": chosen["number"], "speedup_over_baseline": ratio}


def _preset_config(study: Study, chosen: dict[str, Any]) -> RunConfig:
    """The full training config of the chosen trial (without the study's run name); a workload's
    names the workload and the micro-batch it was measured with (its loader's unless searched)."""
    changes = to_changes(chosen["params"], study.global_batch)
    changes["memory"].pop("on_oom")
    config = study.target.config(changes).replace(run={"name": ""})
    if study.target.model:
        micro = (
            config.batch.micro
            if "batch.micro" in chosen["params"]
            else WorkloadSpec(study.target.model).micro_batch(config.run.seed)
        )
        config = config.replace(
            model={"workload": study.target.model}, batch={"micro": micro or config.batch.micro}
        )
    return config


def summary(doc: dict[str, Any]) -> str:
    """The lines the command prints at the end."""
    rows = doc["trials"]
    keys = [d["key"] for d in doc["space"]]
    lines = [trials_table(rows, keys), ""]
    best = doc.get("best")
    if best is None:
        lines.append("no feasible trial: nothing was written (see the notes above)")
    else:
        params = ", ".join(f"{k}={v}" for k, v in best["params"].items())
        speed = (
            f" ({doc['speedup_over_baseline']:.2f}x the baseline)" if doc.get("speedup_over_baseline") else ""
        )
        lines.append(
            f"best: trial {best['number']}: {best['throughput']:,.0f} {best.get('unit') or ''}{speed}: {params}"
        )
        c = doc.get("confirmation")
        if c and "speedup" in c:
            verdict = (
                "(confirmed)"
                if c["confirmed"]
                else "(within noise: the preset keeps the baseline's settings)"
            )
            lines.append(f"re-measured, interleaved with the baseline: {c['speedup']:.2f}x {verdict}")
        model = (doc.get("target") or {}).get("model")
        how = f"--model {model} " if model else ""
        lines.append(f"wrote {doc['preset']}: turbotrain train {how}--preset {doc['preset']}")
    lines.append(f"study, table and plot: {doc['run_dir']}")
    return "\n".join(lines)
