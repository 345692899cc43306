"""A run directory: the names of the files a run leaves behind (every module takes them from here),
and finding or creating one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from .atomic import atomic_write
from .config import RunConfig, load_config
from .config_fields import said
from .errors import TurbotrainError
from .runlock import LOCK_FILE

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
SUMMARY_MD = "summary.md"
CHECKPOINTS = "checkpoints"
PLOTS_DIR = "plots"
TENSORBOARD_DIR = "tensorboard"
TRACKERS_FILE = "trackers.json"  # the experiment-tracker runs (W&B, MLflow, trackio) this run writes to
BATCH_CACHE = "batch_size.json"  # the batch finder's answers for this run's settings
TOKENIZER_FILE = "tokenizer.json"  # the run's subword tokenizer (none: bytes)
EXPERTS_FILE = "experts.json"  # a mixture-of-experts run: tokens per expert over training, placement
CHOOSE_FILE = "choose.json"  # the measured choice of the run's auto settings (before training: no run yet)
CHOOSE_MD = "choose.md"  # its decision table
LAUNCH_FILE = ".launch.json"  # the launcher job that last started the run: a restart of that job resumes it


def run_name(config: RunConfig) -> str:
    """``run.name``, or ``<preset>-<timestamp>`` (a workload: ``<FILE>-`` or ``<module>-<timestamp>``)."""
    label = workload_label(config.model.workload) if config.model.workload else config.preset
    return config.run.name or f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"


def workload_label(ref: str) -> str:
    """A workload's short name: ``FILE`` of ``FILE.py:FUNC``, ``module`` of ``package.module:FUNC``."""
    module = ref.rpartition(":")[0] or ref
    return Path(module).stem if module.endswith(".py") else module.rpartition(".")[2]


def holds_a_run(path: Path) -> bool:
    """Whether ``path`` holds anything of a run (the lock, launch and choose files alone are not a run)."""
    try:
        return any(p.name not in (LOCK_FILE, LAUNCH_FILE, CHOOSE_FILE, CHOOSE_MD) for p in path.iterdir())
    except OSError:
        return False


def new_run_dir(config: RunConfig) -> Path:
    """A fresh run directory; refuses one that holds a run (check again under the run's lock)."""
    path = Path(config.run.out_dir) / run_name(config)
    try:
        if path.exists() and holds_a_run(path):
            raise already_exists(path)
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # out_dir is a file, not writable, ...
        raise TurbotrainError(
            f"cannot create run directory {path} ({exc.strerror}); choose another --run.out_dir"
        ) from None
    return path


def already_exists(path: Path) -> TurbotrainError:
    return TurbotrainError(
        f"run directory {path} already exists; pass --resume to continue it or choose another --run.name"
    )


def find_run_dir(out_dir: str, name: str = "") -> Path:
    """The named run, or the most recently modified run under ``out_dir`` that has a config."""
    if name:
        path = Path(out_dir) / name
        if not (path / CONFIG_FILE).is_file():
            path = Path(name)  # a path given directly
        if not (path / CONFIG_FILE).is_file():
            raise TurbotrainError(
                f"no run named {name!r} in {out_dir}/ and no run directory at that path "
                f"(no {CONFIG_FILE}); check the name given to "
                + said("--resume or --run.name", "resume= or run.name")
            )
        return path
    runs = [p for p in Path(out_dir).glob("*") if (p / CONFIG_FILE).is_file()]
    if not runs:
        start = said("`turbotrain train`", "turbotrain.train() without resume=")
        raise TurbotrainError(f"no run to resume in {out_dir}/; start one with {start}")
    return max(runs, key=lambda p: (p / CONFIG_FILE).stat().st_mtime)


def write_launch(run_dir: Path, record: dict[str, Any]) -> None:
    """Keep ``record`` (:meth:`turbotrain.base.launch.Launch.record`) as the job that last started the run."""
    atomic_write(run_dir / LAUNCH_FILE, json.dumps(record) + "\n")


def read_launch(run_dir: Path) -> dict[str, Any] | None:
    """The job that last started the run, or None (none recorded, or unreadable)."""
    try:
        record = json.loads((run_dir / LAUNCH_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def resume_config(run_dir: Path, overrides: Any = ()) -> RunConfig:
    """The run's saved config with ``overrides`` applied (for example a longer max_steps)."""
    return load_config(str(run_dir / CONFIG_FILE), overrides)


def truncate_metrics(path: Path, step: int) -> int:
    """Before a resume from ``step``: drop later and torn records, atomically; the lines dropped."""
    try:
        lines = path.read_bytes().splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    keep = [line for line in lines if line.endswith(b"\n") and not _after(line, step)]
    if len(keep) != len(lines):
        atomic_write(path, b"".join(keep))
    return len(lines) - len(keep)


def _after(line: bytes, step: int) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False  # not a record: left for the report to name
    value = record.get("step") if isinstance(record, dict) else None
    return isinstance(value, int) and value > step
