"""turbotrain under Ray Train (docs/cluster.md): a run of ``turbotrain train`` as the per-worker
function of ``ray.train.torch.TorchTrainer``. :func:`loop_config` takes what :func:`turbotrain.train`
takes; :func:`train_loop` runs it on each worker in Ray's process group. Checkpoints are turbotrain's
own, in its store (``run.remote``, else ``<storage_path>/<name>/turbotrain``); Ray is told of each by
a small :data:`POINTER` file that names the run, so a restarted group resumes from the store exactly."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..app.prepare import PreparedRun, RunRequest, WorkloadLike
from ..app.run import overrides_of, train_request
from ..base.config import load_config
from ..base.errors import ConfigError
from ..loop.hooks import FitContext, Hook, every

try:
    import ray.train
except ImportError:  # one line naming the extra, not a chain of tracebacks
    raise ImportError("turbotrain.integrations.ray needs ray: pip install 'turbotrain[ray]'") from None

__all__ = ["POINTER", "ReportToRay", "loop_config", "store_of_ray", "train_loop"]

POINTER = "turbotrain.json"  # the file of the checkpoint Ray keeps: the run, its store, its step
SCHEMES = {"local": "file://", "s3": "s3://", "gcs": "gs://"}  # pyarrow's file systems as fsspec URIs


def loop_config(
    workload: WorkloadLike | None = None, *, preset: str | None = None, **settings: Any
) -> dict[str, Any]:
    """``train_loop_config`` for :func:`train_loop`: what :func:`turbotrain.train` takes, checked on
    the driver (a mistake is one line before Ray starts a worker), and the driver's working directory,
    where the workers run."""
    overrides = overrides_of(settings)
    load_config(RunRequest(preset, workload=workload).base_preset, overrides)  # a wrong value: one line, here
    return {"workload": workload, "preset": preset, "overrides": overrides, "cwd": os.getcwd()}


def train_loop(config: dict[str, Any]) -> dict[str, Any]:
    """Ray's per-worker function: the run :func:`loop_config` describes, or the one
    ``ray.train.get_checkpoint()`` names after a restart. Returns the run's summary (rank 0's; Ray
    sends it to the driver, so not the trained model)."""
    context = ray.train.get_context()
    os.environ.update(  # the torchrun variables turbotrain reads its place from (Ray sets the same)
        RANK=str(context.get_world_rank()),
        LOCAL_RANK=str(context.get_local_rank()),
        WORLD_SIZE=str(context.get_world_size()),
        LOCAL_WORLD_SIZE=str(context.get_local_world_size()),
    )
    if config.get("cwd") and Path(config["cwd"]).is_dir():
        os.chdir(config["cwd"])  # Ray starts each worker in a folder of its session
    return dict(train_request(_request(config, context)))


def _request(config: dict[str, Any], context: Any) -> RunRequest:
    """The run of ``config``: a new one, or after a restart the one Ray's checkpoint names."""
    workload, preset = config.get("workload"), config.get("preset")
    overrides = {section: dict(values) for section, values in config.get("overrides", {}).items()}
    given = load_config(RunRequest(preset, workload=workload).base_preset, overrides).run
    run = overrides.setdefault("run", {})
    run.setdefault("remote", given.remote or store_of_ray(context))
    checkpoint = ray.train.get_checkpoint()  # the one Ray hands a restarted group
    if checkpoint is None:
        run.setdefault("name", given.name or context.get_experiment_name())
        return RunRequest(preset, overrides, None, workload, hooks=_reporting)
    with checkpoint.as_directory() as folder:
        pointer = json.loads((Path(folder) / POINTER).read_text())
    run.pop("name", None)  # the run is named by its place in the store
    why = f"Ray Train started the worker group again; its checkpoint names step {pointer['step']}"
    # a FILE.py:FUNC workload is in the run's config.toml; a live one comes along again
    live = None if isinstance(workload, str) else workload
    return RunRequest(preset, overrides, pointer["resume"], live, relaunch=why, hooks=_reporting)


def store_of_ray(context: Any) -> str:
    """turbotrain's store in Ray's experiment folder, ``<storage_path>/<name>/turbotrain``, as a URI."""
    storage = context.get_storage()  # a DeveloperAPI of Ray's: the storage_path's file system and path
    kind = storage.storage_filesystem.type_name
    if kind not in SCHEMES:
        raise ConfigError(
            f"Ray's storage_path is on a {kind!r} file system, which turbotrain's store cannot name: give "
            "run.remote=URI (s3://, gs://, az://, file://) for the run's checkpoints"
        )
    return f"{SCHEMES[kind]}{storage.experiment_fs_path.rstrip('/')}/turbotrain"


def _reporting(run: PreparedRun) -> Sequence[Hook]:
    return [ReportToRay(run)]


class ReportToRay(Hook):
    """Tells Ray of the run at its start, each checkpoint and the end (``ray.train.report`` on every
    rank, a barrier; rank 0's with :data:`POINTER`): a restart before the first checkpoint resumes the
    run. No host-device sync: the metrics are values the monitor has read already."""

    def __init__(self, run: PreparedRun) -> None:
        c = run.config
        self.interval, self.main = c.train.checkpoint_every, run.main
        self.run = {
            "run": run.run_dir.name,
            "resume": f"{c.run.remote.rstrip('/')}/{run.run_dir.name}",
            "run_dir": str(run.run_dir.resolve()),
        }
        self.reported = -1

    def _report(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        self.reported = step
        metrics = {k: v for k, v in ctx.metrics.items() if isinstance(v, (int, float, str))}
        metrics["step"] = step
        if not self.main:
            ray.train.report(metrics)
            return
        with tempfile.TemporaryDirectory(prefix="turbotrain-ray-") as folder:
            (Path(folder) / POINTER).write_text(json.dumps({**self.run, "step": step}))
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))

    def on_fit_start(self, ctx: FitContext) -> None:
        self._report(ctx)

    def on_step_end(self, ctx: FitContext) -> None:
        if every(ctx.engine.state.step, self.interval):
            self._report(ctx)

    def on_fit_end(self, ctx: FitContext) -> None:
        if ctx.engine.state.step != self.reported:
            self._report(ctx)
