"""The experiment trackers as sinks beside ``metrics.jsonl``: W&B, MLflow and trackio
(docs/monitoring.md). ``trackers.json`` names the tracker runs, so a resumed run continues them.
MLflow writes on the training thread, so its records are batched every ``flush_every_s``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...base.atomic import atomic_write
from ...base.config import flat
from ...base.errors import TurbotrainError, required_module
from ...base.failure import one_line
from ...base.records import numbers
from ...base.rundir import METRICS_FILE, TENSORBOARD_DIR, TRACKERS_FILE
from .sinks import JsonlSink, TensorBoardSink

log = logging.getLogger(__name__)

TRACKERS = ("wandb", "mlflow", "trackio")  # the experiment trackers, by their config field's name
SINKS = ("jsonl", "tensorboard", *TRACKERS)  # what build_sinks knows


@dataclass
class TrackerOptions:
    """How the tracker runs are named and where they are written (``monitor.*`` in a config)."""

    project: str = "turbotrain"  # W&B project, MLflow experiment, trackio project
    name: str = ""  # the tracker run's name; "" = the run directory's name
    config: dict[str, Any] = field(default_factory=dict)  # the run's config, logged once
    wandb_mode: str = "offline"  # offline: written under RUN/wandb, `wandb sync` uploads it later
    mlflow_uri: str = ""  # "" = $MLFLOW_TRACKING_URI, else sqlite:///<the run's parent>/mlflow.db
    flush_every_s: float = 5.0  # MLflow: seconds between batched writes


def _import(tracker: str) -> Any:
    """The tracker's package (its extra has its name), or one line naming the extra to install."""
    return required_module(
        tracker,
        f"monitor.{tracker} = true needs the {tracker} package: pip install 'turbotrain[{tracker}]' "
        f"(or drop --monitor.{tracker})",
    )


def require_trackers(names: Iterable[str]) -> None:
    """Each named tracker's package imports, or one line: checked before anything slow."""
    for name in names:
        _import(name)


def _read_ids(run_dir: Path) -> dict[str, Any]:
    path = run_dir / TRACKERS_FILE
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        loaded = json.loads(path.read_text())
        return loaded if isinstance(loaded, dict) else {}
    return {}


def _write_ids(run_dir: Path, tracker: str, ids: dict[str, Any]) -> None:
    known = _read_ids(run_dir)
    known[tracker] = ids
    atomic_write(run_dir / TRACKERS_FILE, json.dumps(known, indent=2) + "\n")


def _wandb_init(wandb: Any, run_dir: Path, ids: dict[str, Any], **more: Any) -> Any:
    """The W&B run ``ids`` names (its id, project and mode), resumed where it exists."""
    # no console capture, no system-metrics sampler (NVML is the monitor's), no git or code upload
    settings = wandb.Settings(
        silent=True, console="off", x_disable_stats=True, save_code=False, disable_git=True
    )
    mode, project = ids.get("mode", "offline"), ids.get("project")
    return wandb.init(
        project=project, id=ids["id"], resume="allow", mode=mode, dir=str(run_dir), settings=settings, **more
    )


class _StepLoggedRun:
    """A W&B or trackio run: the records' numbers at their steps; close finishes it."""

    run: Any

    def write(self, record: dict[str, Any]) -> None:
        values = numbers(record)
        if values:
            self.run.log(values, step=record["step"])

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class WandbSink(_StepLoggedRun):
    """A W&B run (``monitor.wandb``): the records as history at their steps, the config once."""

    def __init__(self, run_dir: Path, options: TrackerOptions) -> None:
        self.wandb = _import("wandb")
        ids = _read_ids(run_dir).get("wandb") or {"id": uuid.uuid4().hex[:12]}
        ids.update(project=options.project, mode=options.wandb_mode)
        _write_ids(run_dir, "wandb", ids)
        self.run = _wandb_init(
            self.wandb, run_dir, ids, name=options.name or run_dir.name, config=options.config
        )

    def close(self) -> None:
        if self.run is not None:
            super().close()
            self.wandb.teardown()  # ends the wandb-core service and its threads


def _publish_wandb(run_dir: Path, ids: dict[str, Any], summary: dict[str, Any], files: list[Path]) -> None:
    wandb = _import("wandb")
    run = _wandb_init(wandb, run_dir, ids)
    try:
        run.summary.update({k: v for k, v in flat(summary).items() if isinstance(v, (int, float, str, bool))})
        artifact = wandb.Artifact(f"{run_dir.name}-report", type="report")
        for f in files:
            artifact.add_file(str(f), name=str(f.relative_to(run_dir)))
        run.log_artifact(artifact)
    finally:
        run.finish()
        wandb.teardown()


def _mlflow_uri(run_dir: Path, options: TrackerOptions) -> str:
    uri = options.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    return uri or f"sqlite:///{run_dir.resolve().parent / 'mlflow.db'}"


def _mlflow_client(uri: str) -> Any:
    _import("mlflow")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


class MlflowSink:
    """An MLflow run (``monitor.mlflow``): metric histories at their steps, the config as params."""

    def __init__(self, run_dir: Path, options: TrackerOptions) -> None:
        mlflow = _import("mlflow")
        self.Metric = mlflow.entities.Metric
        uri = _mlflow_uri(run_dir, options)
        self.client = _mlflow_client(uri)
        ids = _read_ids(run_dir).get("mlflow") or {}
        if ids.get("uri") == uri and ids.get("run_id"):
            self.run_id = ids["run_id"]  # a resumed run continues its MLflow run
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = self.client.get_experiment_by_name(options.project)
            # a new experiment's artifacts beside the store (MLflow's default: ./mlartifacts of the working directory)
            store = run_dir.resolve().parent / "mlartifacts"
            artifacts = store.as_uri() if uri.startswith("sqlite:") else None
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment(options.project, artifact_location=artifacts)
            )
            self.run_id = self.client.create_run(
                experiment_id, run_name=options.name or run_dir.name
            ).info.run_id
            params = [mlflow.entities.Param(k, str(v)[:6000]) for k, v in flat(options.config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])
            _write_ids(run_dir, "mlflow", {"uri": uri, "run_id": self.run_id, "experiment": options.project})
        self.flush_every_s = options.flush_every_s
        self._pending: list[Any] = []
        # a store failing mid-run is one warning (Guarded), not also MLflow's own logged traceback
        self._quiet = logging.getLogger("mlflow.store.db.utils")
        self._level = self._quiet.level
        self._quiet.setLevel(logging.CRITICAL)
        self._flushed_at = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        now_ms = int(time.time() * 1000)
        self._pending += [self.Metric(k, v, now_ms, record["step"]) for k, v in numbers(record).items()]
        if time.monotonic() - self._flushed_at >= self.flush_every_s:
            self.flush()

    def flush(self, client: Any = None) -> None:
        """The batched records to the store (``client``: the one :meth:`close` took over)."""
        client = client or self.client
        if client is None:
            return
        pending, self._pending = self._pending, []
        self._flushed_at = time.monotonic()
        for i in range(0, len(pending), 1000):  # MLflow takes at most 1000 metrics a batch
            client.log_batch(self.run_id, metrics=pending[i : i + 1000])

    def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            try:
                self.flush(client)
                client.set_terminated(self.run_id)
            finally:
                self._quiet.setLevel(self._level)


def _publish_mlflow(run_dir: Path, ids: dict[str, Any], summary: dict[str, Any], files: list[Path]) -> None:
    client = _mlflow_client(ids["uri"])
    run_id = ids["run_id"]
    client.log_dict(run_id, summary, "summary.json")
    for f in files:
        parent = str(f.relative_to(run_dir).parent)
        client.log_artifact(run_id, str(f), None if parent == "." else parent)
    status = str(summary.get("status", ""))
    client.set_terminated(
        run_id, "FINISHED" if status == "completed" else "KILLED" if status == "stopped" else "FAILED"
    )


class TrackioSink(_StepLoggedRun):
    """A trackio run (``monitor.trackio``) in trackio's local store (``$TRACKIO_DIR``)."""

    def __init__(self, run_dir: Path, options: TrackerOptions) -> None:
        self.trackio = _import("trackio")
        name = options.name or run_dir.name
        resumed = "trackio" in _read_ids(run_dir)
        self.run = self.trackio.init(
            project=options.project,
            name=name,
            config=options.config,
            resume="allow" if resumed else "never",
            embed=False,
            auto_log_gpu=False,  # NVML is the monitor's
            auto_log_cpu=False,
        )
        _write_ids(run_dir, "trackio", {"project": options.project, "name": name})


def _publish_trackio(run_dir: Path, ids: dict[str, Any], summary: dict[str, Any], files: list[Path]) -> None:
    trackio = _import("trackio")
    run = trackio.init(project=ids["project"], name=ids["name"], resume="must", embed=False)
    try:
        artifact = trackio.Artifact(f"{run_dir.name}-report", type="report")
        for f in files:
            artifact.add_file(f, name=str(f.relative_to(run_dir)))
        run.log_artifact(artifact)
    finally:
        run.finish()


OPEN_TIMEOUT_S = 10  # a tracker server's answer at the start (docs/monitoring.md states it)


@contextlib.contextmanager
def _bounded_http() -> Any:
    """MLflow's HTTP without retries, OPEN_TIMEOUT_S timeout (unless set): an unreachable server is
    said in seconds, not after its 7 retries (~4.5 min)."""
    keys = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(OPEN_TIMEOUT_S)}
    added = {k: v for k, v in keys.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _writable(folder: Path) -> None:
    """``folder``, or its nearest existing parent (the tracker makes it), takes a file; else OSError."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise (FileExistsError if existing == folder else NotADirectoryError)(f"{existing} is a file")
    probe = existing / f".turbotrain-probe-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()


def _trackio_dir() -> Path:
    return Path(os.environ.get("TRACKIO_DIR") or _import("trackio").utils.TRACKIO_DIR)


def _check(name: str, run_dir: Path, options: TrackerOptions) -> None:
    """Tracker ``name``'s store opens (an MLflow server answers, a local folder takes a file)."""
    if name == "mlflow":
        with _bounded_http():
            _mlflow_client(_mlflow_uri(run_dir, options)).search_experiments(max_results=1)
    elif name == "trackio":
        _writable(_trackio_dir())
    elif options.wandb_mode == "offline":
        _writable(run_dir / "wandb")


def _store(name: str, run_dir: Path, options: TrackerOptions) -> str:
    """Tracker ``name``'s store, named by the setting that chose it."""
    if name == "mlflow":
        uri = _mlflow_uri(run_dir, options)
        if options.mlflow_uri:
            return f"monitor.mlflow_uri = {uri!r}"
        return f"$MLFLOW_TRACKING_URI = {uri!r}" if os.environ.get("MLFLOW_TRACKING_URI") else repr(uri)
    if name == "wandb":
        return f"{str(run_dir / 'wandb')!r} (monitor.wandb_mode = {options.wandb_mode})"
    return f"$TRACKIO_DIR = {str(_trackio_dir())!r}"


def _first_line(exc: BaseException) -> str:
    """``exc`` in one line, or the system's error under it (which the tracker's message buries)."""
    chain = [exc]
    while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 10:
        chain.append(cause)
    system = (e for e in reversed(chain) if isinstance(e, OSError) or type(e).__name__ == "OperationalError")
    return one_line(next((e for e in system if str(e).strip()), exc))


def _store_error(name: str, run_dir: Path, options: TrackerOptions, exc: BaseException) -> TurbotrainError:
    return TurbotrainError(
        f"monitor.{name} = true: its store {_store(name, run_dir, options)} cannot be opened "
        f"({_first_line(exc)}); fix it or drop --monitor.{name}"
    )


def check_stores(names: Iterable[str], run_dir: Path, options: TrackerOptions) -> None:
    """Each named tracker's store opens, or one line naming the setting: before any training."""
    require_trackers(names := [n for n in names if n in TRACKERS])
    for name in names:
        try:
            _check(name, run_dir, options)
        except Exception as exc:  # noqa: BLE001 - any store's own error, said in one line
            raise _store_error(name, run_dir, options, exc) from None


class Guarded:
    """A tracker sink whose first failure is one warning and drops it; training goes on."""

    def __init__(self, name: str, sink: Any) -> None:
        self.name, self.sink = name, sink

    def _call(self, method: str, *args: Any) -> None:
        if self.sink is None:
            return
        try:
            getattr(self.sink, method, lambda *a: None)(*args)
        except Exception as exc:  # noqa: BLE001 - a tracker's failure never stops the run
            log.warning(
                "monitor.%s: its store failed (%s); the run goes on without it (metrics.jsonl has every record)",
                self.name,
                _first_line(exc),
            )
            sink, self.sink = self.sink, None
            if method != "close":
                with contextlib.suppress(Exception):  # its threads ended all the same
                    sink.close()

    def write(self, record: dict[str, Any]) -> None:
        self._call("write", record)

    def close(self) -> None:
        self._call("close")
        self.sink = None


_SINKS = {"wandb": WandbSink, "mlflow": MlflowSink, "trackio": TrackioSink}
_PUBLISH = {"wandb": _publish_wandb, "mlflow": _publish_mlflow, "trackio": _publish_trackio}


def _open(name: str, run_dir: Path, options: TrackerOptions) -> Any:
    """Tracker ``name``'s sink; its store's failure to open is one line naming the setting."""
    try:
        with _bounded_http() if name == "mlflow" else contextlib.nullcontext():
            return _SINKS[name](run_dir, options)
    except TurbotrainError:
        raise
    except Exception as exc:  # noqa: BLE001 - the tracker's own error, said in one line
        raise _store_error(name, run_dir, options, exc) from None


def build_sinks(names: Iterable[str], run_dir: Path, options: TrackerOptions | None = None) -> list[Any]:
    """The sinks named (of ``SINKS``) for ``run_dir``; a wrong name or missing package: one line first."""
    names = list(dict.fromkeys(names))
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise TurbotrainError(f"unknown sink {unknown[0]!r}; choose from: {', '.join(SINKS)}")
    require_trackers(n for n in names if n in TRACKERS)
    options = options or TrackerOptions()
    run_dir.mkdir(parents=True, exist_ok=True)
    sinks: list[Any] = []
    try:
        for name in names:
            if name == "jsonl":
                sinks.append(JsonlSink(run_dir / METRICS_FILE))
            elif name == "tensorboard":
                sinks.append(TensorBoardSink(run_dir / TENSORBOARD_DIR))
            else:
                sinks.append(Guarded(name, _open(name, run_dir, options)))
    except BaseException:
        for sink in sinks:  # what opened before the failure: closed, its threads ended
            with contextlib.suppress(Exception):
                sink.close()
        raise
    return sinks


def publish(run_dir: Path, summary: dict[str, Any], files: Iterable[Path]) -> list[str]:
    """The summary and ``files`` to the tracker runs of ``run_dir``; one line per one unreachable."""
    problems: list[str] = []
    files = [Path(f) for f in files if Path(f).is_file()]
    for tracker, ids in _read_ids(run_dir).items():
        if tracker not in _PUBLISH or not isinstance(ids, dict):
            continue
        try:
            _PUBLISH[tracker](run_dir, ids, summary, files)
        except Exception as exc:  # an optional upload: the report stands without it
            problems.append(f"{tracker}: summary and plots not published ({type(exc).__name__}: {exc})")
            log.warning("%s", problems[-1])
    return problems
