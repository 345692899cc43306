"""A run directory: the names of the files a run leaves behind, and finding or creating one.

``turbotrain train`` writes ``config.toml``, ``metrics.jsonl``, ``checkpoints/`` and
``summary.json``; ``turbotrain report`` adds ``summary.md`` and ``plots/``. Every module that
reads or writes them takes the names from here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .config import RunConfig, load_config
from .errors import TurbotrainError

CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
SUMMARY_MD = "summary.md"
CHECKPOINTS = "checkpoints"
PLOTS_DIR = "plots"
TENSORBOARD_DIR = "tensorboard"
BATCH_CACHE = "batch_size.json"  # the batch finder's answers for this run's settings


def new_run_dir(config: RunConfig) -> Path:
    """A fresh run directory; refuses to reuse one that already holds a run."""
    name = config.run.name or f"{config.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = Path(config.run.out_dir) / name
    try:
        if path.exists() and any(path.iterdir()):
            raise TurbotrainError(f"run directory {path} already exists; pass --resume to continue it or choose another --run.name")
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # out_dir is a file, not writable, ...
        raise TurbotrainError(f"cannot create run directory {path} ({exc.strerror}); choose another --run.out_dir") from None
    return path


def find_run_dir(out_dir: str, name: str = "") -> Path:
    """The named run, or the most recently modified run under ``out_dir`` that has a config."""
    if name:
        path = Path(out_dir) / name
        if not (path / CONFIG_FILE).is_file():
            path = Path(name)  # a path given directly
        if not (path / CONFIG_FILE).is_file():
            raise TurbotrainError(f"no run named {name!r} in {out_dir}/ and no run directory at that path "
                                  f"(no {CONFIG_FILE}); check the name given to --resume or --run.name")
        return path
    runs = [p for p in Path(out_dir).glob("*") if (p / CONFIG_FILE).is_file()]
    if not runs:
        raise TurbotrainError(f"no run to resume in {out_dir}/; start one with `turbotrain train`")
    return max(runs, key=lambda p: (p / CONFIG_FILE).stat().st_mtime)


def resume_config(run_dir: Path, overrides: Any = ()) -> RunConfig:
    """The run's saved config with ``overrides`` applied (for example a longer max_steps)."""
    return load_config(str(run_dir / CONFIG_FILE), overrides)
