"""Checkpoints that survive crashes and never execute code on load (docs/checkpoints.md): writing
and pruning are here (:class:`Checkpointer`, :func:`save_checkpoint`, :func:`prune`), restoring in
:mod:`.restore`, the other modules one concern each. The public names of the old
``loop/checkpoint.py`` and ``loop/sharded.py`` keep importing from here (``turbotrain.MOVED``)."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...base.atomic import atomic_write, clean_stale_temps, remove_leftovers
from ...base.config import TrainConfig
from ...base.seeds import rng_state, seed_all, set_rng_state
from ...core.distributed import Strategy
from ...core.process_group import in_group, new_gloo_group, rank_world
from ..hooks import FitContext, Hook, every
from .background import BackgroundWrite, stage_to_host
from .choose import ShapeMismatch, model_settings_changed, model_shapes, newest_usable, shape_problem
from .dcp import load_model_weights, read_metadata, saved_model_tensors, split_state
from .format import (
    FORMAT,
    MARKER,
    checkpoint_dir,
    checkpoint_path,
    checkpoint_step,
    finished_checkpoints,
    forget,
    is_finished,
    is_unfinished_save,
    is_verified,
    latest_verified,
    list_checkpoints,
    read_marker,
    remember_verified,
    saved_world,
    sha256_of,
    sidecar,
    unreadable,
)
from .restore import load_latest, load_latest_weights, restore_latest
from .sharded_write import save_folder
from .state import RunState, Stateful, reseed, run_state

log = logging.getLogger(__name__)


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


def save_checkpoint(folder: Path, step: int, payload: dict[str, Any], keep_last: int = 3) -> Path:
    """Write ``payload`` atomically as ``step_XXXXXXXX.pt`` with its checksum; prune old ones (lack
    of space raises DiskFullError, the older checkpoints untouched)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(folder, step)
    atomic_write(path, lambda f: torch.save({"format": FORMAT, **payload}, f))
    digest = sha256_of(path)  # read back from the disk: what the sidecar vouches for is what is there
    atomic_write(sidecar(path), f"{digest}  {path.name}\n")
    remember_verified(path)
    prune(folder, keep_last)
    return path


def sharded_parts(state: RunState) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(the model and optimizer tensors for DCP, the replicated entries, this rank's entries)."""
    tensors, rest = split_state(state.model, state.optimizer) if state.model is not None else ({}, {})
    replicated = {"entries": {name: state[name][0]() for name in state.replicated_keys}, **rest}
    per_rank = {name: state[name][0]() for name in state.per_rank}
    return tensors, replicated, per_rank


def save_sharded(folder: Path, step: int, state: RunState, keep_last: int = 3) -> Path:
    """Write ``state`` as a sharded checkpoint folder from every rank (a collective)."""
    return write_sharded(folder, step, sharded_parts(state), keep_last)


def write_sharded(
    folder: Path,
    step: int,
    parts: tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]],
    keep_last: int = 3,
    group: dist.ProcessGroup | None = None,
) -> Path:
    """Write :func:`sharded_parts` (or a copy) as a sharded folder; rank 0 prunes."""
    path = save_folder(folder, step, *parts, group=group)
    if rank_world()[0] == 0:
        remember_verified(path)
        prune(folder, keep_last)
    return path


class Checkpointer(Hook):
    """Saves ``state`` every ``interval`` steps and when the fit ends (also at a stop); at the start
    removes what killed writes left. ``strategy`` (default ``state.strategy``, else whether a process
    group exists) picks one ``.pt`` file or a sharded folder written by every rank (every rank runs
    this hook). ``async_write``: interval checkpoints are staged in host memory and written in the
    background (the final one and an exception wait for it); a failed write is raised at the next step
    (one process) or the next checkpoint (ddp/fsdp: every rank alike)."""

    def __init__(
        self,
        folder: Path,
        interval: int,
        keep_last: int,
        state: RunState,
        before_save: Callable[[], None] | None = None,
        strategy: Strategy | None = None,
        async_write: bool = TrainConfig.async_checkpoint,
    ) -> None:
        self.folder, self.interval, self.keep_last, self.state = folder, interval, keep_last, state
        self.before_save = before_save  # flush the metrics: a resume starts after the checkpoint
        self.saved_step = -1
        strategy = strategy if strategy is not None else getattr(state, "strategy", None)
        self.sharded = strategy.name != "single" if strategy is not None else in_group()
        self.background = BackgroundWrite() if async_write else None
        self._buffers: dict[str, torch.Tensor] = {}  # host copies of a .pt checkpoint's tensors, reused
        self._stager: Any = None  # a DCP DefaultStager, made at the first background sharded checkpoint
        self._group: dist.ProcessGroup | None = None

    def _finished(self, ctx: FitContext, path: Path | None) -> None:
        if path is not None:
            ctx.metrics["checkpoint"] = str(path)

    def save(self, ctx: FitContext) -> None:
        """A checkpoint now, written before this returns (after the write in flight, if any)."""
        self._save(ctx, background=False)

    def written(self, ctx: FitContext) -> Path:
        """The checkpoint of this step, on disk when this returns (a collective when sharded)."""
        self.save(ctx)
        if self.background is not None:
            self._finished(ctx, self.background.wait())
        step = ctx.engine.state.step
        return checkpoint_dir(self.folder, step) if self.sharded else checkpoint_path(self.folder, step)

    def _save(self, ctx: FitContext, background: bool) -> None:
        step = ctx.engine.state.step
        if step == self.saved_step or step == 0:
            return
        start = time.perf_counter()
        if self.background is not None:
            self._finished(ctx, self.background.wait())  # the previous write first (its failure raised here)
        if self.before_save is not None:
            self.before_save()
        if background and self.background is not None:
            self.background.start(self._staged_write(step))
        elif self.sharded:
            self._finished(ctx, save_sharded(self.folder, step, self.state, self.keep_last))
        else:
            self._finished(ctx, save_checkpoint(self.folder, step, self.state.state_dict(), self.keep_last))
        ctx.side_s += time.perf_counter() - start
        self.saved_step = step

    def _stage_shards(self, tree: Any) -> Any:
        """A sharded checkpoint's parts copied to the host through DCP's stager (it keeps its buffers)."""
        if self._stager is None:
            # costly to import: when used
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            options = StagingOptions(cuda, False, False, cuda)  # pinned, shared, async, non-blocking
            self._stager = DefaultStager(options)
        return self._stager.stage(tree)

    def _staged_write(self, step: int) -> Callable[[], Path]:
        """Copy the state now (training changes it right after); the write of the copy, for the thread."""
        folder, keep_last = self.folder, self.keep_last
        if not self.sharded:
            payload = stage_to_host(self.state.state_dict(), self._buffers)
            return lambda: save_checkpoint(folder, step, payload, keep_last)
        parts = self._stage_shards(sharded_parts(self.state))
        # every rank saves at the same steps: created at the same point
        if self._group is None and in_group():
            self._group = new_gloo_group()  # left at exit (core.process_group.shutdown)
        group = self._group
        return lambda: write_sharded(folder, step, parts, keep_last, group=group)

    def on_fit_start(self, ctx: FitContext) -> None:
        if self.background is not None and self.sharded and self._group is None and in_group():
            # the background writes' own group, made now on every rank: later (at the first save) the
            # launcher's store may be gone (orphaned ranks still save at their stop)
            self._group = new_gloo_group()  # left at exit (core.process_group.shutdown)
        for path in clean_stale_temps(self.folder):
            log.info("removed %s, left by a checkpoint write that was killed", path)
        if rank_world()[0] == 0:  # one process cleans; no save runs before every rank reaches it
            for path in clean_unfinished(self.folder):
                log.info("removed %s, a sharded checkpoint whose save did not finish", path)

    def on_step_end(self, ctx: FitContext) -> None:
        if self.background is not None and not self.sharded:
            self._finished(ctx, self.background.poll())  # a failed write stops the run at the next step
        if every(ctx.engine.state.step, self.interval):
            self._save(ctx, background=True)

    def on_fit_end(self, ctx: FitContext) -> None:
        self.save(ctx)
        if self.background is not None:  # the final step was saved already: the write in flight
            self._finished(ctx, self.background.wait())

    def on_exception(self, ctx: FitContext, exc: BaseException) -> None:
        """The write in flight ends before the exception goes on (a resume finds it)."""
        if self.background is None:
            return
        try:
            self.background.wait()
        except Exception as failure:  # noqa: BLE001 - the training's exception is the one to raise
            log.warning("the checkpoint write in flight failed too: %s", failure)
