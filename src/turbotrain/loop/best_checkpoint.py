"""The best checkpoint: the run's checkpoint at its best validation pass, in ``checkpoints/best/``
beside the last ``train.keep_last``, never pruned by them (docs/early-stopping.md). Its files are
hard-linked from the main folder (copied where the file system has no hard links), so pruning the
main folder removes only its own names; ``best/best.json`` says which step, metric and value. It
holds an ordinary checkpoint, so everything that reads checkpoints reads it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..base.atomic import atomic_write
from ..base.config import setting
from ..base.errors import TurbotrainError
from ..base.rundir import CHECKPOINTS
from ..core.process_group import rank_world
from .checkpoint.format import (
    checkpoint_dir,
    checkpoint_path,
    is_verified,
    latest_verified,
    list_checkpoints,
    sidecar,
)
from .checkpoint.restore import load_latest_weights, restore_latest
from .early_stop import EarlyStopping, MetricWatch
from .hooks import FitContext, Hook

if TYPE_CHECKING:
    from .checkpoint import Checkpointer
    from .checkpoint.state import RunState

log = logging.getLogger(__name__)

BEST_DIR = "best"  # under a run's checkpoints/
BEST_FILE = "best.json"


def best_folder(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINTS / BEST_DIR


class KeepBest(Hook):
    """After each validation pass that improves ``watch``, make that step's checkpoint the best one
    (every rank: a sharded save is a collective). After the Checkpointer (a background write of the
    step is waited for, not written twice) and the Monitor (the step's record is on disk first)."""

    def __init__(self, watch: MetricWatch, checkpointer: Checkpointer) -> None:
        self.watch, self.checkpointer = watch, checkpointer
        self.kept_step = -1
        self.kept: Path | None = None

    def _keep(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        if self.watch.best_step != step or self.kept_step == step:
            return
        path = self.checkpointer.written(ctx)
        if rank_world()[0] == 0:
            self._link(path)
        self.kept_step = step

    def _link(self, path: Path) -> None:
        """Checkpoint ``path`` into ``best/`` with its best.json; then the previous best goes."""
        best = self.checkpointer.folder / BEST_DIR
        self.kept = _link_in(path, best)
        record = {"checkpoint": self.kept.name, **self.watch.facts()}
        atomic_write(best / BEST_FILE, json.dumps(record, indent=1) + "\n")
        for old in list_checkpoints(best):  # the previous best, now that the new one is in place
            if old != self.kept:
                _remove(old)

    def on_fit_start(self, ctx: FitContext) -> None:
        """A resume finishes the update a kill interrupted (the best step's checkpoint not in ``best/``)."""
        step, best = self.watch.best_step, self.checkpointer.folder / BEST_DIR
        if rank_world()[0] != 0 or step < 0 or not best.is_dir():
            return
        for tmp in best.glob(".*.partial"):  # a link killed half-way
            _remove(tmp)
        name = (checkpoint_dir if self.checkpointer.sharded else checkpoint_path)(Path(), step).name
        held = latest_verified(best)
        if held is not None and held.name == name and (best / BEST_FILE).is_file():
            self.kept, self.kept_step = held, step
            return
        source = self.checkpointer.folder / name
        if is_verified(source):
            log.info("best checkpoint: linking %s, which a stopped run had not linked yet", name)
            self._link(source)
            self.kept_step = step

    def on_step_end(self, ctx: FitContext) -> None:
        self._keep(ctx)

    def on_fit_end(self, ctx: FitContext) -> None:
        self._keep(ctx)  # a final validation pass that was the best


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:  # no hard links here (some network and FAT file systems): a copy
        shutil.copy2(src, dest)


def _link_in(path: Path, best: Path) -> Path:
    """Checkpoint ``path`` linked into ``best`` the way a save finishes: a file before its checksum
    file, a folder complete before it is renamed into place."""
    best.mkdir(parents=True, exist_ok=True)
    final = best / path.name
    _remove(final)  # a best at this step from an earlier invocation of the run
    tmp = best / f".{path.name}.partial"
    if path.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for file in path.iterdir():
            _link_or_copy(file, tmp / file.name)
        os.replace(tmp, final)
        return final
    for src, dest in ((path, final), (sidecar(path), sidecar(final))):
        tmp = best / f".{src.name}.partial"
        tmp.unlink(missing_ok=True)
        _link_or_copy(src, tmp)
        os.replace(tmp, dest)
    return final


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
        return
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        sidecar(path).unlink(missing_ok=True)


def best_checkpoint(run_dir: Path) -> Path | None:
    """The best checkpoint of run ``run_dir`` (``checkpoints/best/``) when one verifies, else None."""
    return latest_verified(best_folder(run_dir))


def load_best_weights(run_dir: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The model weights of run ``run_dir``'s best checkpoint as one plain state dict, read alone."""
    if not list_checkpoints(best_folder(run_dir)):
        how = setting("best.checkpoint", "true")
        own_loop = "" if how.startswith("--") else ", or pass KeepBest to fit/track"  # a Python caller's
        raise TurbotrainError(
            f"{run_dir} has no best checkpoint ({best_folder(run_dir)} holds none); train with "
            f"{how} (and a validation set){own_loop}"
        )
    return load_latest_weights(best_folder(run_dir))


def restore_best(run_dir: Path, state: RunState) -> Path:
    """Load run ``run_dir``'s best checkpoint into ``state`` as a resume loads the latest; its path."""
    return restore_latest(best_folder(run_dir), state)


def watched(hooks: Iterable[Hook]) -> dict[str, Any]:
    """For the run's summary: ``{"best": {metric, mode, value, step, checkpoint}}`` when a metric was
    watched ({} otherwise); ``checkpoint``: the best's path in the run directory (None if none kept)."""
    hooks = list(hooks)
    keep = next((h for h in hooks if isinstance(h, KeepBest)), None)
    stop = next((h for h in hooks if isinstance(h, EarlyStopping)), None)
    watch = keep.watch if keep is not None else stop.watch if stop is not None else None
    if watch is None:
        return {}
    name = keep.kept.name if keep is not None and keep.kept is not None else None
    if keep is not None and name is None:  # a resumed run whose best came before the resume
        with contextlib.suppress(OSError, ValueError):
            name = json.loads((keep.checkpointer.folder / BEST_DIR / BEST_FILE).read_text())["checkpoint"]
    where = f"{CHECKPOINTS}/{BEST_DIR}/{name}" if name else None
    return {"best": {**watch.facts(), "checkpoint": where}}
