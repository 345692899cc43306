"""The one decision cache (choose, the batch finder, fp8's layer timing): one key (:func:`material`),
one format ``{"material": ..., "value": ...}``; a file unreadable, of another shape or material is
ignored with one line naming it, and the tool measures again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from ...base.atomic import atomic_write
from ...base.errors import TurbotrainError
from ...base.failure import first_line
from ...base.version import __version__
from ...parts.hardware import device_name

log = logging.getLogger(__name__)
T = TypeVar("T")


def material(settings: dict[str, Any], model: Any, device: torch.device | str) -> dict[str, Any]:
    """What a measured answer depends on: settings, the model's fingerprint, the device, versions."""
    name = device if isinstance(device, str) else device_name(device)
    return {
        "settings": settings,
        "model": model,
        "device": name,
        "torch": torch.__version__,
        "turbotrain": __version__,
    }


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def key_of(material: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()[:20]


def read(
    path: Path, what: str, material: dict[str, Any], check: Callable[[Any], T], key: str | None = None
) -> T | None:
    """The cached value for ``material`` through ``check``; None when none, unreadable or foreign."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if key is not None:
            if not isinstance(data, dict):
                raise TypeError(f"a JSON {type(data).__name__}, not an object of entries by key")
            if key not in data:
                return None
            data = data[key]
        if not isinstance(data, dict) or "material" not in data or "value" not in data:
            raise TypeError("not an entry {'material': ..., 'value': ...}")
        if data["material"] != _plain(material):
            raise ValueError("its key material differs (another model, device, settings or version)")
        return check(data["value"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        reason = first_line(exc, type(exc).__name__)[:200]
        log.warning("%s: ignoring the cached measurements in %s (%s); measuring again", what, path, reason)
        return None


def write(path: Path, what: str, material: dict[str, Any], value: Any, key: str | None = None) -> Path | None:
    """Keep ``value`` for ``material`` (beside the other keys' entries when ``key`` is given)."""
    entry = {"material": material, "value": value}
    try:
        if key is not None:
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                data = {}
            entry = {**(data if isinstance(data, dict) else {}), key: entry}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(entry, indent=1, default=str) + "\n")
    except (OSError, TurbotrainError) as exc:  # a full disk, a refused write: the answer stands
        log.warning("%s: could not cache the measurements in %s (%s)", what, path, exc)
        return None
    return path
