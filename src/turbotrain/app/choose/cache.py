"""Where ``choose`` keeps its measurements between runs (docs/choose.md): the measuring kit's
decision cache, one file per key under ``<cache>/choose/``, keyed by every setting that changes a
step's speed and the workload file's bytes; the value is ``{candidate name: figures}``."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from ...base.config import RunConfig
from ...core.meter import cache
from ...parts.data.sources import default_cache_dir

FOLDER = "choose"
WHAT = "choose"
# the settings a step's speed does not depend on (left out of the key)
IGNORED = {
    "run": {"name", "out_dir", "seed"},
    "train": None,  # the whole section: steps, evaluation, checkpoints
    "monitor": None,
    "choose": None,
    "data": {"path", "val_fraction", "cache_dir"},
}


def cache_dir(config: RunConfig) -> Path:
    return Path(config.data.cache_dir or default_cache_dir()) / FOLDER


def key_material(config: RunConfig, device: torch.device) -> dict[str, Any]:
    """What the key is made of (also stored in the file, so a reader can check it matches)."""
    settings: dict[str, Any] = {}
    for section, values in config.to_dict().items():
        skip = IGNORED.get(section, set())
        if isinstance(values, dict) and skip is not None:
            settings[section] = {k: v for k, v in values.items() if k not in skip}
    workload = config.model.workload
    model: dict[str, Any] = {"workload": workload} if workload else {}
    if workload:
        path = Path(workload.rpartition(":")[0])
        model["file_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "(module)"
    return cache.material(settings, model, device)


def checked_rows(value: Any) -> dict[str, dict[str, Any]]:
    """The cached rows, checked: each a failure's reason or the figures a decision reads."""
    if not isinstance(value, dict):
        raise TypeError(f"rows are a JSON {type(value).__name__}, not an object of candidates")
    for name, row in value.items():
        if not isinstance(row, dict):
            raise TypeError(f"row {name!r} is a JSON {type(row).__name__}, not an object")
        if "failed" not in row:
            for figure in ("step_ms_median", "first_step_s"):
                if not isinstance(row.get(figure), (int, float)):
                    raise ValueError(f"row {name!r} has no number {figure!r}")
    return value
