"""One training run from the request to the report: what ``turbotrain train`` (:func:`train_run`)
and ``turbotrain.train()`` (:func:`train`) share.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..base.batch import move_to
from ..base.config import SECTIONS, known_keys
from ..base.errors import ConfigError, TurbotrainError, logging_unless_configured
from ..base.launch import Launch, Topology
from ..base.records import read_metrics
from ..base.rundir import CHECKPOINTS, METRICS_FILE, truncate_metrics, write_launch
from ..base.runlock import LOCK_FILE, RunLock
from ..base.signals import StopSignals
from ..base.signals import held as held_signals
from ..core.engine import Engine, default_loss
from ..core.main_rank import ReportedByAnotherRank
from ..core.transforms import eager
from ..loop.checkpoint import checkpoint_step, latest_verified
from ..loop.checkpoint.remote import remote_store
from ..loop.monitor.trackers import TrackerOptions, check_stores
from ..loop.run_hooks import monitor_plan
from ..parts.data.sources import check_data_path
from . import warmstart
from .choose import session as choose
from .prepare import PreparedRun, PrepareStart, RunRequest, WorkloadLike, prepare_run
from .report import ReportResult, write_report
from .restart import batch_record, peer_lost
from .training import Training, stopped_by_signal, train_prepared

# the preparation's start hooks, in order: choose, then the warm start of what it chose
STARTS: tuple[PrepareStart, ...] = (choose.at_start, warmstart.at_start)


@dataclass
class RunOutcome:
    """How a run ended, for its caller to say."""

    run: PreparedRun | None = None
    summary: dict[str, Any] | None = None  # None: it did not train
    training: Training | None = None
    report: ReportResult | None = None
    signal: str = ""  # the first stop signal
    lost: str = ""  # another rank was lost, in one line
    quiet: bool = False  # another rank says why

    @property
    def stopped_by_signal(self) -> bool:
        """Stopped by SIGTERM/SIGINT/SIGUSR1 with its final checkpoint saved."""
        return self.summary is not None and stopped_by_signal(self.summary)


class _ReportStopped(KeyboardInterrupt):
    """A signal while the report was being made (each file is written whole or not at all)."""


def _stop_report(name: str) -> None:
    raise _ReportStopped(name)


def train_run(request: RunRequest) -> RunOutcome:
    """Prepare, train and (rank 0, no signal) report the run ``request`` asks for."""
    topology = Topology.from_env()
    # SIGTERM/SIGINT in any phase: one saves what there is to save and stops, two stop at once
    with held_signals() as signals:
        try:
            # the same mistake on every rank, said once by rank 0; the others end quietly
            run = prepare_run(request, signals, STARTS)
        except TurbotrainError:
            if topology.rank > 0:
                return RunOutcome(quiet=True)
            raise
        if not run.main:
            return _other_rank(run, signals)
        if run.resume:
            print(f"resuming {run.run_dir}" + (f" ({run.relaunch})" if run.relaunch else ""))
        with _locked(run):  # for the whole run, its report included
            launch = Launch.from_env()
            if launch.run_id or launch.slurm_job:  # the job a restart of this one finds the run by
                write_launch(run.run_dir, {**launch.record(), **batch_record(run.settings, run.plan)})
            if run.relaunch:
                record_restart(run.run_dir, run.relaunch, run.plan.world)
            # the mistakes said now rather than after start-up's measuring: a tracker's missing package or
            # a store that does not open (an MLflow server: within trackers.OPEN_TIMEOUT_S), run.remote
            # refusing, a missing --data path
            trackers = monitor_plan(run.config, run.run_dir)
            check_stores(trackers.trackers, run.run_dir, trackers.tracker_options or TrackerOptions())
            remote_store(run.config, run.run_dir)
            if run.config.data.path and not run.config.model.workload:
                check_data_path(run.config.data.path)
            return _main_rank(run, signals)


def _main_rank(run: PreparedRun, signals: StopSignals) -> RunOutcome:
    """Rank 0 trains the run and writes its report, as `turbotrain report RUN` would."""
    try:
        summary, training = train_prepared(run, signals)
    except Exception as exc:
        return _lost(exc, run, signals)
    written = None
    if not signals.received:  # a signal after training stops the report
        with contextlib.suppress(_ReportStopped):
            signals.on_first(_stop_report)
            written = write_report(run.run_dir)  # plots + summary.md
        signals.on_first(None)
    if training.mirror is not None:  # run.remote: the last uploads (the report's too), or what is missing
        training.mirror.close()
    return RunOutcome(training.prepared, summary, training, written, signals.first)


def _other_rank(run: PreparedRun, signals: StopSignals) -> RunOutcome:
    """A rank other than 0: the same training in rank 0's run directory, printing nothing but its errors."""
    try:
        summary, training = train_prepared(run, signals, progress=False)
    except ReportedByAnotherRank:
        return RunOutcome(run, quiet=True)  # rank 0 (or the rank that found it) failed and says why
    except TurbotrainError as exc:
        raise TurbotrainError(f"[rank {run.plan.rank}] {exc}") from None
    except Exception as exc:
        return _lost(exc, run, signals)
    return RunOutcome(run, summary, training, None, signals.first)


def _lost(exc: Exception, run: PreparedRun, signals: StopSignals) -> RunOutcome:
    """Another rank lost (one line), else ``exc`` raised again."""
    lost = peer_lost(exc, run.plan.topology, run.run_dir)
    if lost is None:
        raise exc
    return RunOutcome(run, lost=lost, signal=signals.first)


def record_restart(run_dir: Path, why: str, world: int) -> None:
    """An event record in metrics.jsonl for a relaunch, at the step the resume loads."""
    newest = latest_verified(run_dir / CHECKPOINTS)
    step = checkpoint_step(newest) if newest is not None else 0
    metrics = run_dir / METRICS_FILE
    before = read_metrics(metrics)[0] if metrics.is_file() else []
    reached = max((r["step"] for r in before if "event" not in r), default=step)  # logged before the failure
    truncate_metrics(metrics, step)  # as the resume will: the later steps and a torn last line go first
    record = {
        "step": step,
        "event": "restart",
        "restart": 1 + sum(r.get("event") == "restart" for r in before if r["step"] <= step),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "why": why,
        "resumed_from": newest.name if newest is not None else "",
        "steps_redone": max(0, reached - step),
        "world_size": world,
    }
    with open(metrics, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


class TrainedRun(dict):
    """What :func:`train` returns: the run's summary (this dict) and the trained run."""

    def __init__(self, outcome: RunOutcome) -> None:
        super().__init__(outcome.summary or {})
        self.outcome = outcome
        self.run_dir: Path | None = outcome.run.run_dir if outcome.run is not None else None

    @property
    def training(self) -> Training:
        if self.outcome.training is None:
            raise TurbotrainError("this process trained nothing (another rank reported why)")
        return self.outcome.training

    @property
    def model(self) -> nn.Module:
        """The trained model (wrapped as it trained: compiled, DDP/FSDP)."""
        return self.training.model

    @property
    def engine(self) -> Engine:
        return self.training.engine

    def evaluate(
        self,
        loader: Iterable[Any],
        loss_fn: Callable[[nn.Module, Any], Any] | None = None,
        metrics_fn: Callable[[nn.Module, Any], Mapping[str, torch.Tensor]] | None = None,
    ) -> dict[str, float]:
        """Mean loss (``"loss"``) and metrics over ``loader`` under the run's precision and no_grad,
        with the run's loss and metrics unless given; one host-device sync, at the end."""
        if isinstance(loader, (torch.Tensor, str, bytes)) or not isinstance(loader, Iterable):
            raise TurbotrainError(
                f"evaluate(): loader = {loader!r:.60} is not an iterable of batches; pass a DataLoader or a list of batches"
            )
        t = self.training
        return t.engine.evaluate_metrics(
            t.model,
            loader,
            loss_fn or t.spec.loss_fn() or default_loss,
            metrics_fn if metrics_fn is not None else t.spec.metrics_fn(),
        )

    def predict(
        self, loader: Iterable[Any], forward: Callable[[nn.Module, Any], Any] | None = None
    ) -> list[Any]:
        """The model's outputs for each batch of ``loader`` (on the host), under the run's precision,
        inference and eval mode. ``forward(model, batch)``; default: the model on the batch's inputs
        (the first item of a tuple or list; a mapping as keyword arguments)."""
        t = self.training
        model, engine = t.model, t.engine
        was_training = model.training
        model.eval()
        outputs: list[Any] = []
        try:
            with torch.inference_mode(), engine.autocast(), eager():
                for batch in loader:
                    batch = move_to(batch, engine.device, non_blocking=True)
                    out = (forward or _inputs_forward)(model, batch)
                    outputs.append(move_to(out, torch.device("cpu")))  # host-device sync point (per batch)
        finally:
            model.train(was_training)
        return outputs


def _inputs_forward(model: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(batch[0])
    return model(batch)


@contextlib.contextmanager
def _locked(run: PreparedRun) -> Iterator[None]:
    """The run's lock for the block; a new run that ends before it wrote anything leaves no folder."""
    try:
        with RunLock(run.run_dir):
            yield
    except BaseException:
        left = {p.name for p in run.run_dir.iterdir()} if run.run_dir.is_dir() else {LOCK_FILE}
        if not run.resume and left <= {LOCK_FILE}:  # the start-up's own clean-up may have removed it
            shutil.rmtree(run.run_dir, ignore_errors=True)
        raise


def train(
    workload: WorkloadLike | None = None,
    *,
    preset: str | None = None,
    resume: str | bool | None = None,
    **settings: Any,
) -> TrainedRun:
    """Train ``workload`` (``FILE.py:FUNC``, FUNC itself or a Workload; None: the preset's GPT on
    its data) as ``turbotrain train --model`` does, and return the :class:`TrainedRun` (the
    summary). ``settings``: config fields by name (``max_steps=64``: a name one section holds) or
    whole sections (``optim={"lr": 1e-3}``); ``preset``: a name or .toml path; ``resume``: True (the
    newest run, or ``run.name``'s) or a run name or directory. A mistake raises a one-line
    TurbotrainError; a signal before the first step :class:`StoppedBySignal`; a rank lost under
    torchrun a TurbotrainError saying how the run continues."""
    resumed = None if resume in (None, False) else ("" if resume is True else str(resume))
    return train_request(RunRequest(preset, overrides_of(settings), resumed, workload))


def train_request(request: RunRequest) -> TrainedRun:
    """:func:`train` of a :class:`RunRequest` (an integration's, with its hooks)."""
    with logging_unless_configured():
        outcome = train_run(request)
    if outcome.lost:
        raise TurbotrainError(outcome.lost)
    return TrainedRun(outcome)


def overrides_of(settings: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``{"max_steps": 64, "optim": {...}}`` -> ``{"train": {"max_steps": 64}, "optim": {...}}``."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in settings.items():
        if key in SECTIONS and isinstance(value, Mapping):
            _once(out, key, value)
            continue
        owners = [name for name in SECTIONS if key in known_keys(name)]
        if len(owners) != 1:
            raise ConfigError(
                f"train(): {key}= is not a config field; give a field by its name or a whole section, e.g. "
                "max_steps=64 or optim={'lr': 1e-3} (`turbotrain train --help-config` lists them)"
                if not owners
                else f"train(): {key}= is a field of several sections ({', '.join(owners)}); give the section, "
                f"e.g. {owners[0]}={{{key!r}: {value!r}}}"
            )
        _once(out, owners[0], {key: value})
    return out


def _once(out: dict[str, dict[str, Any]], section: str, values: Mapping[str, Any]) -> None:
    """``values`` into ``out[section]``; a field given twice is refused in one line."""
    given = out.setdefault(section, {})
    twice = [k for k in values if k in given]
    if twice:
        k = twice[0]
        raise ConfigError(
            f"train(): {section}.{k} is given twice ({given[k]!r} and {values[k]!r}: as {k}= and in "
            f"{section}={{...}}); give it once"
        )
    given.update(values)
