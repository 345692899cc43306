"""The experiment trackers: a `turbotrain train` run logged to W&B (offline), MLflow and trackio,
each read back with the tracker's own client; the metric history equals metrics.jsonl, the config
and the summary are there, the plots are artefacts.

W&B 0.31 has no Python reader for an offline run (the one in ``wandb.sdk.internal`` went with its
Go core): :func:`wandb_records` reads the run's ``.wandb`` transaction log (LevelDB log framing)
into W&B's own protobuf ``Record``. trackio's store directory is read from ``$TRACKIO_DIR`` once,
when trackio is first imported, so the run goes in a child process with its own ``TRACKIO_DIR``.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import HANG_S, tiny_overrides

from turbotrain.base.errors import TurbotrainError
from turbotrain.base.records import numbers, read_metrics
from turbotrain.loop.monitor import build_sinks
from turbotrain.loop.monitor.trackers import _import

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")
trackio = pytest.importorskip("trackio")

ROOT = Path(__file__).resolve().parents[2]


def wandb_records(path: Path) -> list:
    """The records of a ``.wandb`` file: a 7-byte header, then 32 KiB blocks of chunks (crc32,
    length, type: 1 full, 2 first, 3 middle, 4 last), each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data, pos, out, parts = path.read_bytes(), 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
    return out


@dataclass
class WandbRun:
    """What an offline W&B run holds, read from its ``.wandb`` files: the history per key (W&B's
    own ``_step``/``_runtime``/``_timestamp`` left out), the config, the summary, the artefacts."""

    files: list[Path]
    history: dict[str, list[tuple[int, Any]]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    artifacts: list[str] = field(default_factory=list)


def read_wandb_run(run: Path, run_id: str) -> WandbRun:
    """Every ``.wandb`` file of W&B run ``run_id`` under ``run/wandb``: the training's, then the
    report's, which resumes it (started in the same second, W&B names its folder
    ``offline-run-<time>-<id>-1``: the trailing * of the pattern)."""
    out = WandbRun(sorted(run.glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb")))
    for path in out.files:
        for r in wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                for i in r.history.item:
                    key = i.key or "/".join(i.nested_key)
                    if not key.startswith("_"):
                        out.history.setdefault(key, []).append((r.history.step.num, json.loads(i.value_json)))
            elif kind in ("run", "summary"):
                items = r.run.config.update if kind == "run" else r.summary.update
                target = out.config if kind == "run" else out.summary
                target.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
            elif kind == "artifact":
                out.artifacts += [c.path for c in r.artifact.manifest.contents]
    return out


def expected_history(run: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as per-key histories: what every tracker must hold."""
    history: dict[str, list[tuple[int, float]]] = {}
    for record in read_metrics(run / "metrics.jsonl")[0]:
        for key, value in numbers(record).items():
            history.setdefault(key, []).append((record["step"], value))
    return history


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory) -> tuple[Path, Path]:
    """One `turbotrain train` run with all three trackers, in a child process (see the module)."""
    tmp = tmp_path_factory.mktemp("trackers")
    text = tmp / "corpus.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(600)))
    args = [sys.executable, "-m", "turbotrain", "train", "--no-progress"]
    for section, values in tiny_overrides(tmp, data={"path": str(text)}).items():
        args += [f"--{section}.{k}={v}" for k, v in values.items() if k != "progress"]
    args += [
        "--monitor.wandb=true",
        "--monitor.mlflow=true",
        "--monitor.trackio=true",
        "--monitor.project=tt",
    ]
    env = {
        **os.environ,
        "TRACKIO_DIR": str(tmp / "trackio"),
        "WANDB_SILENT": "true",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "1",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    done = subprocess.run(args, env=env, cwd=tmp, capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "runs" / "t", tmp / "trackio"


def test_wandb_offline_holds_the_metrics_config_summary_and_plots(tracked_run):
    run, _ = tracked_run
    ids = json.loads((run / "trackers.json").read_text())["wandb"]
    w = read_wandb_run(run, ids["id"])
    assert len(w.files) == 2  # the training's, then the report's (summary and artefact)
    history, config, summary, artifacts = w.history, w.config, w.summary, w.artifacts
    assert history == expected_history(run)
    assert config["model"]["d_model"] == 32 and config["train"]["max_steps"] == 6
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert "plots/loss.png" in artifacts and "summary.md" in artifacts


def test_mlflow_holds_the_metrics_config_summary_and_plots(tracked_run):
    from mlflow.tracking import MlflowClient

    run, _ = tracked_run
    ids = json.loads((run / "trackers.json").read_text())["mlflow"]
    assert ids["uri"] == f"sqlite:///{run.parent / 'mlflow.db'}"  # the default store: beside the runs
    client = MlflowClient(tracking_uri=ids["uri"])
    info = client.get_run(ids["run_id"])
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(ids["run_id"], key)]
        for key in info.data.metrics
    }
    assert history == expected_history(run)
    assert info.data.params["model.d_model"] == "32" and info.info.status == "FINISHED"
    assert info.info.run_name == "t" and client.get_experiment(info.info.experiment_id).name == "tt"
    local = Path(client.download_artifacts(ids["run_id"], "", str(run.parent / "dl")))
    assert json.loads((local / "summary.json").read_text())["steps"] == 6
    assert (local / "plots" / "loss.png").stat().st_size > 0


def test_trackio_holds_the_metrics_config_and_plots(tracked_run, monkeypatch):
    import trackio.sqlite_storage

    run, store = tracked_run
    monkeypatch.setattr(trackio.sqlite_storage, "TRACKIO_DIR", store)  # the child's TRACKIO_DIR
    (found,) = list(trackio.Api().runs("tt"))
    assert found.name == "t" and found.config["model"]["d_model"] == 32
    history: dict[str, list[tuple[int, float]]] = {}
    for row in trackio.sqlite_storage.SQLiteStorage.get_logs("tt", "t"):
        for key, value in row.items():
            if key not in ("step", "timestamp") and value is not None:
                history.setdefault(key, []).append((row["step"], value))
    assert {k: sorted(v) for k, v in history.items()} == expected_history(run)
    assert (store / "artifacts" / "tt").is_dir()  # the report's files, as a trackio artefact


def test_a_missing_tracker_package_is_one_line_naming_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    with pytest.raises(TurbotrainError, match=r"pip install 'turbotrain\[mlflow\]'") as caught:
        _import("mlflow")
    assert "\n" not in str(caught.value)
    with pytest.raises(TurbotrainError, match=r"unknown sink 'neptune'; choose from: jsonl, tensorboard"):
        build_sinks(["jsonl", "neptune"], tmp_path)


def test_build_sinks_opens_and_closes_trackers_without_leaving_threads(tmp_path, monkeypatch):
    """A callback's way in: sinks by name; closed, no tracker thread is left running."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    before = {t.ident for t in threading.enumerate()}
    sinks = build_sinks(["jsonl", "wandb"], tmp_path / "r")
    for step in (1, 2):
        for sink in sinks:
            sink.write({"step": step, "loss": 1.0 / step, "precision": "fp32"})
    for sink in sinks:
        sink.close()
    assert read_metrics(tmp_path / "r" / "metrics.jsonl")[0][1]["loss"] == 0.5
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not [n for n in left if "wandb" in n.lower()], left


def test_track_logs_an_own_loop_to_wandb_with_the_config_and_the_report(tmp_path):
    """``track(..., trackers=("wandb",), config=...)``: an own loop's records, its hyperparameters
    and, from the report at the end, the summary and plots, in one offline W&B run."""
    import torch

    from turbotrain import Engine, track
    from turbotrain.parts.models.mlp import TinyMLP, synthetic_batches

    engine = Engine({"run": {"device": "cpu"}})
    model = TinyMLP()
    model, optimizer, loader = engine.setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), synthetic_batches(6)
    )
    run_dir = tmp_path / "own"
    with track(
        engine,
        model,
        optimizer,
        run_dir,
        log_every=2,
        progress=False,
        nvml=False,
        trackers=("wandb",),
        config={"lr": 0.1},
    ):
        for x, y in loader:
            engine.backward(model(x, y))
            engine.step(optimizer)
    ids = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    w = read_wandb_run(run_dir, ids["id"])
    history, config, artifacts = w.history, w.config, w.artifacts
    assert history == expected_history(run_dir) and history["loss"]
    assert config["lr"] == 0.1 and "summary.json" in artifacts and "plots/loss.png" in artifacts


@pytest.mark.slow  # W&B starts its wandb-core process, twice
def test_a_resumed_run_continues_the_same_wandb_and_mlflow_runs_with_their_whole_history(
    tmp_path, monkeypatch
):
    """The sinks opened again for the same run directory (a resume) write into the runs the first
    opening made (trackers.json keeps their ids): one W&B run and one MLflow run, steps 1 to 4."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = tmp_path / "r"
    for steps in ((1, 2), (3, 4)):  # the first run, then its resume
        sinks = build_sinks(["wandb", "mlflow"], run)
        for step in steps:
            for sink in sinks:
                sink.write({"step": step, "loss": 1.0 / step})
        for sink in sinks:
            sink.close()
    ids = json.loads((run / "trackers.json").read_text())
    recorded = read_wandb_run(run, ids["wandb"]["id"])
    assert len(recorded.files) == 2 and recorded.history["loss"] == [(s, 1.0 / s) for s in (1, 2, 3, 4)]
    assert len(list(run.glob("wandb/offline-run-*"))) == 2  # no W&B run of another id
    client = mlflow.tracking.MlflowClient(ids["mlflow"]["uri"])
    assert len(client.search_runs([client.get_experiment_by_name("turbotrain").experiment_id])) == 1
    history = client.get_metric_history(ids["mlflow"]["run_id"], "loss")
    assert sorted((m.step, m.value) for m in history) == [(s, 1.0 / s) for s in (1, 2, 3, 4)]
