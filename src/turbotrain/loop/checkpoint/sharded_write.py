"""Writing a sharded checkpoint folder from every rank, atomically: every rank writes and hashes
its files in ``.step_XXXXXXXX.partial/``; all gather, so a failure on any rank is said once and
no rank waits forever; rank 0 writes the marker, renames the folder into place and fsyncs."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ...base.atomic import DISK_FULL_ERRNOS, DiskFullError, atomic_write, disk_full_cause, fsync_dir
from ...base.errors import TurbotrainError
from ...core.main_rank import ReportedByAnotherRank
from ...core.process_group import in_group, rank_world
from .dcp import describe, is_dcp_failure
from .format import FORMAT, MARKER, STATE_FILE, checkpoint_dir, partial_dir, rank_file, sha256_of


def save_folder(
    folder: Path,
    step: int,
    tensors: dict[str, torch.Tensor],
    replicated: dict[str, Any],
    per_rank: dict[str, Any],
    group: dist.ProcessGroup | None = None,
) -> Path:
    """Write one sharded checkpoint at ``step`` from every rank (a collective); returns the finished
    folder. ``group``: of its collectives (a background save's own: never interleaved with training's)."""
    from torch.distributed.checkpoint import CheckpointException

    rank, world = rank_world()
    final, tmp = checkpoint_dir(folder, step), partial_dir(folder, step)
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save at this step that was killed
        tmp.mkdir()
    _barrier(group)  # the folder exists (and is empty) before anyone writes into it
    failure: BaseException | None = None
    claimed: dict[str, Any] = {}
    try:
        claimed = _write_own(tmp, tensors, replicated, per_rank, group)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - told to every rank below: none waits forever
        failure = exc
    problem = describe(failure) if failure is not None else ""
    gathered: list[tuple[str, dict[str, Any]]] = [(problem, claimed)]
    if world > 1:  # also the barrier: every rank's files are complete (and hashed) after it
        gathered = [("", {}) for _ in range(world)]
        dist.all_gather_object(gathered, (problem, claimed), group=group)
    failed = [(r, why) for r, (why, _) in enumerate(gathered) if why]
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        _raise_failed(step, final, failed, failure)
    if rank == 0:
        _publish(folder, step, world, gathered)
    _barrier(group)  # nobody goes on (or reads the folder) before it is in place
    return final


def _write_own(
    tmp: Path,
    tensors: dict[str, torch.Tensor],
    replicated: dict[str, Any],
    per_rank: dict[str, Any],
    group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """This rank's part of the save into ``tmp``; returns the entries (hashes) of the files it wrote."""
    import torch.distributed.checkpoint as dcp  # costly (~0.7 s): imported when a sharded run saves
    from torch.distributed.checkpoint import FileSystemWriter

    rank, world = rank_world()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: as intended
        # a collective: a failure on any rank raises on every rank
        writer = FileSystemWriter(tmp, sync_files=True)
        dcp.save(tensors, storage_writer=writer, process_group=group, no_dist=not in_group())
    atomic_write(
        tmp / rank_file(rank),
        lambda f: torch.save({"format": FORMAT, "rank": rank, "world": world, **per_rank}, f),
    )
    mine = [rank_file(rank)]
    if rank == 0:
        atomic_write(tmp / STATE_FILE, lambda f: torch.save({"format": FORMAT, **replicated}, f))
        mine.append(STATE_FILE)
    # each rank hashes what it wrote, in parallel; rank 0 hashes whatever nobody claimed (.metadata)
    return {name: _entry(tmp / name) for name in mine + [n.name for n in tmp.glob(f"__{rank}_*.distcp")]}


def _raise_failed(
    step: int, final: Path, failed: list[tuple[int, str]], failure: BaseException | None
) -> NoReturn:
    """The save failed on some rank: said once, by the first rank that failed."""
    from torch.distributed.checkpoint import CheckpointException

    first, first_why = failed[0]
    text = f"the checkpoint at step {step} was not saved: rank {first} failed ({first_why})"
    if rank_world()[0] != first:
        raise ReportedByAnotherRank(text)
    full = _disk_full_reason(failure) if failure is not None else ""
    if full:
        raise DiskFullError(final, full) from None
    if failure is not None and not isinstance(failure, CheckpointException):
        raise failure  # a bug here: its traceback
    raise TurbotrainError(text)


def _publish(folder: Path, step: int, world: int, gathered: list[tuple[str, dict[str, Any]]]) -> None:
    """Rank 0: the marker listing every file's entry, then the finished folder in its place."""
    tmp, final = partial_dir(folder, step), checkpoint_dir(folder, step)
    files = {k: v for _, part in gathered for k, v in part.items()}
    for path in tmp.iterdir():
        if path.name not in files and not path.name.startswith("."):
            files[path.name] = _entry(path)
    files[".metadata"] = _entry(tmp / ".metadata")
    marker = {"format": FORMAT, "step": step, "world": world, "files": dict(sorted(files.items()))}
    atomic_write(tmp / MARKER, json.dumps(marker, indent=1) + "\n")
    if final.exists():  # an older save at this step (unfinished or corrupt): the new one replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(folder)


def _disk_full_reason(exc: BaseException) -> str:
    """Why a failed save failed when it was for lack of space ('' otherwise); other ranks'
    exceptions arrive without their causes, so their text is read too."""
    excs = [exc, *(e for e, _ in exc.failures.values())] if is_dcp_failure(exc) else [exc]
    for e in excs:
        full = disk_full_cause(e)
        if full is not None:
            return full.strerror or os.strerror(full.errno or 0)
        text = str(e)
        for code in DISK_FULL_ERRNOS:
            if os.strerror(code) in text:
                return os.strerror(code)
        if "unexpected pos" in text:
            return "a write stopped short (no space left on the device, or a file-size limit)"
    return ""


def _entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": sha256_of(path)}


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if in_group():
        dist.barrier(group=group)
