"""Removing checkpoints: the one pruning rule and the clean-up of saves that never finished."""

from __future__ import annotations

import shutil
from pathlib import Path

from ...base.atomic import remove_leftovers
from .format import (
    MARKER,
    checkpoint_step,
    forget,
    is_unfinished_save,
    is_verified,
    list_checkpoints,
    sidecar,
)


def prune(folder: Path, keep_last: int) -> list[Path]:
    """Keep the newest ``keep_last`` checkpoints that verify and delete every older one (one that does
    not verify never counts as kept); returns them."""
    candidates = list_checkpoints(folder)
    kept: list[Path] = []
    for path in reversed(candidates):  # newest first; stops hashing once enough are found
        if len(kept) == keep_last:
            break
        if is_verified(path):
            kept.append(path)
    if not kept:
        return []
    oldest = checkpoint_step(kept[-1])
    deleted = [p for p in candidates if checkpoint_step(p) < oldest]
    for old in deleted:
        if old.is_dir():  # the marker first: a half-deleted folder is then an unfinished save
            (old / MARKER).unlink(missing_ok=True)
            shutil.rmtree(old, ignore_errors=True)
            continue
        old.unlink(missing_ok=True)  # the checkpoint first: an orphaned checksum file is harmless
        sidecar(old).unlink(missing_ok=True)
    for orphan in folder.glob("step_*.pt.sha256"):
        if not orphan.with_name(orphan.name[: -len(".sha256")]).exists():
            orphan.unlink(missing_ok=True)
    forget(folder, {str(p) for p in candidates} - {str(p) for p in deleted})
    return deleted


def clean_unfinished(folder: Path) -> list[Path]:
    """Remove the folders of sharded saves that never finished; at the start, on one process."""
    return remove_leftovers(folder, is_unfinished_save)
