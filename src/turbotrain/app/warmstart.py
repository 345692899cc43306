"""Compile warm start: torch.compile's artefacts saved after a run and loaded at the next start of
the same model (also on a fresh machine), so its first step skips most of the compiling.

One blob in ``<cache>/compile/<key>.bin`` beside a ``<key>.json`` of what it was made for, keyed as
choose's cache keys; a stale, foreign or damaged blob is ignored with one warning, never an error.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import torch

from ..base.atomic import atomic_write
from ..base.config import RunConfig
from ..base.errors import TurbotrainError
from ..base.failure import one_line
from ..core.compile_guard import record_warm_start
from ..core.device import resolve_device
from ..core.meter.cache import key_of
from ..core.transforms import resolve_scope
from .choose import cache
from .prepare import Begun, PreparedRun

log = logging.getLogger(__name__)

FOLDER = "compile"
TORCH_CACHE_LOGGER = "torch.compiler._cache"  # where torch logs a blob it cannot read, with its traceback


@contextlib.contextmanager
def _held_back(name: str) -> Iterator[list[str]]:
    """Holds back a torch logger's records while a blob loads; yields them, each as one line."""
    said: list[str] = []

    def hold(record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        said.append(one_line(exc) if exc is not None else record.getMessage().splitlines()[0][:200])
        return False

    logger = logging.getLogger(name)
    logger.addFilter(hold)
    try:
        yield said
    finally:
        logger.removeFilter(hold)


class WarmStart:
    """``begin`` before training, ``save`` after it; nothing for a run that does not compile."""

    def __init__(self, config: RunConfig) -> None:
        device = resolve_device(config.run.device)
        self.active = resolve_scope(config.compile.scope, device) != "off"
        self.folder = cache.cache_dir(config).parent / FOLDER
        self.material: dict[str, Any] = cache.key_material(config, device) if self.active else {}
        self.key, self.note = key_of(self.material) if self.active else "", ""
        self.blob, self.described = self.folder / f"{self.key}.bin", self.folder / f"{self.key}.json"

    def begin(self) -> str:
        """Load the cached artefacts of this model, if any; returns (and records) one line saying so."""
        if not self.active:
            return ""
        if not hasattr(torch.compiler, "load_cache_artifacts"):
            return self._say(f"cold: torch {torch.__version__} has no torch.compiler.load_cache_artifacts")
        if not self.blob.is_file():
            return self._say(f"cold: no saved compile artefacts for this model yet ({self.blob})")
        try:
            described = json.loads(self.described.read_text())
            if described.get("material") != json.loads(json.dumps(self.material, default=str)):
                return self._say(
                    f"cold: ignoring {self.blob}: made for another model, device or version", warn=True
                )
            with _held_back(TORCH_CACHE_LOGGER) as torch_said:
                info = torch.compiler.load_cache_artifacts(self.blob.read_bytes())
        except Exception as exc:  # a damaged or foreign blob: torch's own error, in one line
            return self._say(f"cold: ignoring {self.blob} ({one_line(exc)})", warn=True)
        kinds = getattr(info, "artifacts", None)  # CacheInfo: {artefact type: [keys]}
        count = sum(len(v) for v in kinds.values()) if isinstance(kinds, dict) else 0
        if not count:  # torch logged its refusal (held back above) and loaded nothing
            why = (torch_said or ["torch loaded no compile artefacts from it"])[0]
            return self._say(f"cold: ignoring {self.blob} ({why})", warn=True)
        return self._say(f"warm: loaded {count} compile artefacts from {self.blob}")

    def save(self) -> str:
        """Write what this process compiled (nothing when it compiled nothing)."""
        if not self.active or not hasattr(torch.compiler, "save_cache_artifacts"):
            return ""
        result = torch.compiler.save_cache_artifacts()
        if result is None:
            return ""
        data, _ = result
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write(self.blob, data)
            atomic_write(self.described, json.dumps({"material": self.material}, default=str) + "\n")
        except (OSError, TurbotrainError) as exc:  # a full disk, a refused write: the run is done anyway
            log.warning("compile warm start: could not save %s (%s)", self.blob, exc)
            return ""
        log.info("compile warm start: saved %.1f MB of compile artefacts to %s", len(data) / 2**20, self.blob)
        return str(self.blob)

    def _say(self, note: str, warn: bool = False) -> str:
        self.note = note
        record_warm_start(note)
        (log.warning if warn else log.info)("compile warm start: %s", note)
        return note


def at_start(run: PreparedRun, settings: RunConfig) -> Begun:
    """The warm start as a start hook of ``turbotrain train``'s preparation: rank 0 loads before the
    model is built, saves at the end."""
    if not run.main:
        return Begun()
    warm = WarmStart(run.config)
    warm.begin()
    return Begun(end=warm.save)
