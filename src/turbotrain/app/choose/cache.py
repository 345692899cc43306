"""Where ``choose`` keeps its measurements between runs: one JSON file per key under
``<cache>/choose/`` (``<cache>`` is ``data.cache_dir``, else ``$XDG_CACHE_HOME/turbotrain``).

The key is what makes a measurement valid: the model (a preset's model section, or a workload
file's bytes and FUNC), the shapes of a step (micro-batch, accumulation, block size, batching),
every setting that changes a step's speed (precision, compile, memory, optimizer, data,
distributed sections as given), the device's name, and the torch and turbotrain versions. A file
that cannot be read, or whose key differs (a hash collision, a file from another version), is
ignored with one line and measured again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from ...base.atomic import atomic_write
from ...base.config import RunConfig
from ...base.errors import TurbotrainError
from ...base.version import __version__
from ...parts.data.sources import default_cache_dir
from ..environment import cpu_model

log = logging.getLogger(__name__)

FOLDER = "choose"
# the settings a step's speed does not depend on (left out of the key)
IGNORED = {
    "run": {"name", "out_dir", "seed"},
    "train": None,  # the whole section: steps, evaluation, checkpoints
    "monitor": None,
    "choose": None,
    "data": {"path", "val_fraction", "cache_dir"},
}


def device_name(device: torch.device) -> str:
    """The GPU's name as CUDA reports it, or the CPU's model name (part of the key)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def cache_dir(config: RunConfig) -> Path:
    return Path(config.data.cache_dir or default_cache_dir()) / FOLDER


def key_material(config: RunConfig, device_name: str) -> dict[str, Any]:
    """What the key is made of (also stored in the file, so a reader can check it matches)."""
    settings: dict[str, Any] = {}
    for section, values in config.to_dict().items():
        if not isinstance(values, dict):
            continue
        skip = IGNORED.get(section, set())
        if skip is None:
            continue
        settings[section] = {k: v for k, v in values.items() if k not in skip}
    workload = config.model.workload
    model: dict[str, Any] = {"workload": workload} if workload else {}
    if workload:
        path = Path(workload.rpartition(":")[0])
        model["file_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "(module)"
    return {
        "settings": settings,
        "model": model,
        "device": device_name,
        "torch": torch.__version__,
        "turbotrain": __version__,
    }


def key_of(material: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:20]


def load(folder: Path, key: str, material: dict[str, Any]) -> dict[str, Any] | None:
    """The cached measurements for ``key`` (``{candidate name: figures}``), or None: missing, or
    unreadable / foreign (one line says so)."""
    path = folder / f"{key}.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("material") != json.loads(json.dumps(material, default=str)):
            raise ValueError("its key material differs (another model, device or version)")
        rows = data["rows"]
        if not isinstance(rows, dict):
            raise ValueError("no rows")
        return rows
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("choose: ignoring the cached measurements in %s (%s); measuring again", path, exc)
        return None


def save(folder: Path, key: str, material: dict[str, Any], rows: dict[str, Any]) -> Path | None:
    """Write the measurements; a cache that cannot be written is one line, never an error."""
    path = folder / f"{key}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"material": material, "rows": rows}, indent=1, default=str) + "\n")
    except (OSError, TurbotrainError) as exc:  # a full disk, a refused write
        log.warning("choose: could not cache the measurements in %s (%s)", path, exc)
        return None
    return path
