"""Sharded checkpoints through torch.distributed.checkpoint (DCP), for ddp and fsdp runs.

Why: under FSDP2 no rank holds the whole model, and under DDP one rank writing everything wastes
the others; DCP has every rank write its own shards (replicated tensors once), and the result does
not depend on the world size that wrote it: it loads into 1, 2 or N processes (resharding), and
into a plain model in a process with no process group at all (``turbotrain sample``).

One checkpoint is a directory ``step_XXXXXXXX/``:

- ``__R_I.distcp`` + ``.metadata``: the tensors of the model and the optimizer, keyed by the
  parameters' fully qualified names (``torch.distributed.checkpoint.state_dict`` strips DDP's
  ``module.`` prefix and turns FSDP2's DTensors into shards), so every world size reads them;
- ``state.pt`` (rank 0): everything else the run saves, replicated on every rank (engine, scheduler,
  config, the optimizer's param groups), plain types only;
- ``rankR.pt`` (each rank): per-rank state that does not survive a change of world size (RNG);
- ``finished.json``: the marker, written last by rank 0: world size and each file's size and sha256.

Atomic: every rank writes into ``.step_XXXXXXXX.partial/``, all ranks wait at a barrier, rank 0
hashes what was written (each rank hashes its own files, in parallel), writes the marker, renames
the folder into place and fsyncs. A folder without the marker is an unfinished save: never loaded,
removed at the next start (:func:`clean_unfinished`).

Safe loading: DCP unpickles ``.metadata`` and non-tensor values with plain pickle. Here only
tensors go through DCP (a load that meets a non-tensor value refuses it), ``.metadata`` is read by
an unpickler that admits only DCP's metadata classes, and the ``.pt`` files load with
``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..base.atomic import DISK_FULL_ERRNOS, DiskFullError, atomic_write, disk_full_cause
from ..base.errors import TurbotrainError
from ..core.distributed import (
    ReportedByAnotherRank,
    decided_by_main,
    in_group,
    is_loaded_instance,
    rank_world,
)
from ..parts.models.moe import EXTRA_STATE_KEY

FORMAT = 1
MARKER = "finished.json"
STATE_FILE = "state.pt"
_DIR = re.compile(r"^step_(\d{8,})$")
_PARTIAL = re.compile(r"^\.step_(\d{8,})\.partial$")
_SEP = "/"  # between a key's parts: parameter names contain dots
MODEL, OPTIM = "model", "optim"
# model state entries an older checkpoint may lack (a MoE layer's router-bias loads not applied yet)
OPTIONAL_SUFFIXES = ("." + EXTRA_STATE_KEY,)

# torch.distributed.checkpoint (it imports FSDP and DTensor) costs ~0.7 s to import: the functions
# that save or load through DCP import it when called, so a run that never does stays light.
if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata


# ---------------------------------------------------------------------------- names and the marker


def checkpoint_dir(folder: Path, step: int) -> Path:
    return folder / f"step_{step:08d}"


def partial_dir(folder: Path, step: int) -> Path:
    """Where a save at ``step`` writes before its marker exists and it is renamed into place."""
    return folder / f".step_{step:08d}.partial"


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def read_marker(path: Path) -> dict[str, Any] | None:
    """The finished marker of checkpoint folder ``path``, or None when the save never finished
    (or the marker is unreadable)."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("files"), dict) else None


def is_finished(path: Path) -> bool:
    return (path / MARKER).is_file()


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check(path: Path) -> str:
    """'' when every file the marker of ``path`` lists is there with its size and sha256, else why
    not (one line). Reads every byte: callers remember the answer (checkpoint.is_verified)."""
    marker = read_marker(path)
    if marker is None:
        return f"{path.name} has no finished marker ({MARKER}): its save did not finish"
    if marker.get("format") != FORMAT:
        return f"{path.name} is not a turbotrain sharded checkpoint (format {FORMAT})"
    for name, entry in marker["files"].items():
        file = path / name
        if not isinstance(entry, dict) or "/" in name or name in ("", ".", ".."):
            return f"{path.name}/{MARKER} is damaged (entry {name!r})"
        try:
            size = file.stat().st_size
            if size != entry.get("size"):
                return f"{path.name}/{name} has {size} bytes, its marker says {entry.get('size')} (truncated or replaced)"
            if _sha256(file) != entry.get("sha256"):
                return f"{path.name}/{name} does not match its checksum (corrupt)"
        except OSError as exc:
            return f"{path.name}/{name} cannot be read ({exc.strerror})"
    return ""


def saved_world(path: Path) -> int:
    """How many processes wrote checkpoint folder ``path``."""
    marker = read_marker(path)
    return int(marker.get("world", 0)) if marker else 0


def clean_unfinished(folder: Path) -> list[Path]:
    """Remove the folders of saves that never finished (``.step_*.partial``, or a ``step_*`` folder
    without its marker): a process killed mid-save leaves them; nothing ever loads them. Call it
    at the start of a run, on one process, before any save. Returns what was removed."""
    removed: list[Path] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for entry in entries:
        unfinished = _PARTIAL.match(entry.name) or (_DIR.match(entry.name) and not is_finished(entry))
        if unfinished and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


# ---------------------------------------------------------------------------- state <-> flat tensors


def _flatten(
    tree: dict[str, Any], prefix: str, tensors: dict[str, torch.Tensor], objects: dict[str, Any]
) -> None:
    for key, value in tree.items():
        name = f"{prefix}{_SEP}{key}"
        if isinstance(value, dict):
            _flatten(value, name, tensors, objects)
        elif isinstance(value, torch.Tensor):
            tensors[name] = value
        else:
            objects[name] = value


def _unflatten(flat: dict[str, Any], prefix: str) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    start = prefix + _SEP
    for name, value in flat.items():
        if not name.startswith(start):
            continue
        *parents, leaf = name[len(start) :].split(_SEP)
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def split_state(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's and optimizer's state keyed by parameter names, independent of the wrapping and
    of the world size: (tensors for DCP, everything else for ``state.pt``)."""
    # costly: see the imports
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
    )

    if optimizer is None:
        from_model, from_optim = get_model_state_dict(model), {}
    else:
        from_model, from_optim = get_state_dict(model, optimizer)
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    _flatten(from_model, MODEL, tensors, objects)
    _flatten(from_optim.get("state", {}), OPTIM, tensors, objects)
    rest = {"objects": objects, "param_groups": from_optim.get("param_groups", [])}
    return tensors, rest


def _set(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    model_sd: dict[str, Any],
    optim_sd: dict[str, Any],
    full: bool,
    source: str,
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    options = StateDictOptions(full_state_dict=full)
    try:
        if optimizer is None:
            set_model_state_dict(model, model_sd, options=options)
        else:
            set_state_dict(
                model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
            )
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        detail = " ".join(str(exc).split())[:300]
        raise TurbotrainError(
            f"{source}: its model state does not fit the model this config builds ({detail}); "
            "resume without overrides that change --model.* settings"
        ) from None


def load_full(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    model_sd: dict[str, Any],
    optim_sd: dict[str, Any] | None,
    source: str,
) -> None:
    """Load a one-process (``torch.save``) model and optimizer state into a possibly wrapped and
    sharded ``model`` (DDP, FSDP2): every rank holds the full state; each keeps its part. The
    optimizer's state is keyed by position (``optimizer.state_dict()``); it is re-keyed by the
    parameter names of this optimizer's groups, whose order the one-process run shared."""
    names = _param_names(model)
    if optimizer is not None and optim_sd is not None:
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        try:
            optim_sd = {
                "state": {order[int(i)]: s for i, s in optim_sd["state"].items()},
                "param_groups": [
                    {**g, "params": [order[int(i)] for i in g["params"]]} for g in optim_sd["param_groups"]
                ],
            }
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise TurbotrainError(
                f"{source}: its optimizer state does not fit this optimizer ({exc!r})"
            ) from None
    _set(model, optimizer, model_sd, optim_sd or {}, True, source)


def _param_names(model: nn.Module) -> dict[int, str]:
    """Parameter id -> the name a plain (unwrapped, uncompiled) model gives it."""
    # compile, checkpointing, FSDP1
    wrappers = {
        "_orig_mod",
        "_checkpoint_wrapped_module",
        "_fsdp_wrapped_module",
    }
    ddp = isinstance(model, DistributedDataParallel)  # its "module." prefix
    out = {}
    for name, p in model.named_parameters():
        parts = [part for part in name.split(".") if part not in wrappers]
        out[id(p)] = ".".join(parts[1:] if ddp and parts[0] == "module" else parts)
    return out


# ---------------------------------------------------------------------------- save


def save(
    folder: Path,
    step: int,
    tensors: dict[str, torch.Tensor],
    replicated: dict[str, Any],
    per_rank: dict[str, Any],
    group: dist.ProcessGroup | None = None,
) -> Path:
    """Write one sharded checkpoint at ``step`` from every rank (a collective: every rank calls it
    with its own shards and per-rank state; ``replicated`` is taken from rank 0). Returns the
    finished folder. Lack of space raises :class:`turbotrain.base.atomic.DiskFullError`. ``group``: the
    process group of its collectives (default: the default group); a save in a background thread
    passes a group of its own, so its collectives never interleave with the training's."""
    import torch.distributed.checkpoint as dcp  # costly: see the imports
    from torch.distributed.checkpoint import CheckpointException, FileSystemWriter

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
        with warnings.catch_warnings():
            # one process: as intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            # a collective: a failure on any rank raises on every rank
            dcp.save(
                tensors,
                storage_writer=FileSystemWriter(tmp, sync_files=True),
                process_group=group,
                no_dist=not in_group(),
            )
        atomic_write(
            tmp / rank_file(rank),
            lambda f: torch.save({"format": FORMAT, "rank": rank, "world": world, **per_rank}, f),
        )
        mine = [rank_file(rank)]
        if rank == 0:
            atomic_write(tmp / STATE_FILE, lambda f: torch.save({"format": FORMAT, **replicated}, f))
            mine.append(STATE_FILE)
        # each rank hashes what it wrote, in parallel; rank 0 hashes whatever nobody claimed (.metadata)
        claimed = {
            name: _entry(tmp / name) for name in mine + [n.name for n in tmp.glob(f"__{rank}_*.distcp")]
        }
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
        # said once, by the first rank that failed (a full disk fails them all alike)
        if rank != failed[0][0]:
            raise ReportedByAnotherRank(
                f"the checkpoint at step {step} was not saved: rank {failed[0][0]} failed ({failed[0][1]})"
            )
        full = _disk_full_reason(failure) if failure is not None else ""
        if full:
            raise DiskFullError(final, full) from None
        if failure is not None and not isinstance(failure, CheckpointException):
            raise failure  # a bug here: its traceback
        r, why = failed[0]
        raise TurbotrainError(f"the checkpoint at step {step} was not saved: rank {r} failed ({why})")
    if rank == 0:
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
        _fsync_dir(folder)
    _barrier(group)  # nobody goes on (or reads the folder) before it is in place
    return final


def describe(exc: BaseException) -> str:
    """One line for ``exc``; for DCP's CheckpointException (a multi-line traceback per rank) the
    failures themselves."""
    if _dcp_failure(exc):
        return "; ".join(
            f"rank {r}: {type(e).__name__}: {' '.join(str(e).split())}" for r, (e, _) in exc.failures.items()
        )[:400]
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:400]


def _dcp_failure(exc: BaseException) -> bool:
    """``exc`` is DCP's CheckpointException (DCP imported only where it raised one)."""
    return is_loaded_instance(exc, "torch.distributed.checkpoint", "CheckpointException")


def _disk_full_reason(exc: BaseException) -> str:
    """Why a failed save failed when it was for lack of space ('' otherwise). Exceptions gathered
    from other ranks arrive without their causes, so their text is read too (torch.save reports a
    short write as 'unexpected pos')."""
    excs = [exc, *(e for e, _ in exc.failures.values())] if _dcp_failure(exc) else [exc]
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
    return {"size": path.stat().st_size, "sha256": _sha256(path)}


def _barrier(group: dist.ProcessGroup | None = None) -> None:
    if in_group():
        dist.barrier(group=group)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------- load


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what DCP's ``.metadata`` holds: its metadata classes, tensor sizes, dtypes and
    layouts, paths. Anything else (a function to call, a foreign class) is refused."""

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": None,  # any name: plain dataclasses and enums
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
    }

    def find_class(self, module: str, name: str) -> Any:
        allowed = self._ALLOWED.get(module, set())
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in self._ALLOWED and (allowed is None or name in allowed):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def read_metadata(folder: Path, load_id: str | None = None) -> Metadata:
    """The DCP ``.metadata`` of checkpoint folder ``folder``, read by a restricted unpickler (a
    ``.metadata`` holding anything else is refused: a one-line TurbotrainError)."""
    from torch.distributed.checkpoint.metadata import Metadata  # costly: see the imports

    path = folder / ".metadata"
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
        raise TurbotrainError(f"{path} cannot be read: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(metadata, Metadata):
        raise TurbotrainError(f"{path} is not DCP metadata")
    if load_id is not None and getattr(metadata, "storage_meta", None) is not None:
        metadata.storage_meta.load_id = load_id
    return metadata


def saved_model_tensors(folder: Path) -> dict[str, TensorStorageMetadata]:
    """Name (as a plain model names it) -> DCP's metadata (``.size``, ``.properties.dtype``) of each
    model tensor in checkpoint folder ``folder``, from its ``.metadata`` (:func:`read_metadata`)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    start = MODEL + _SEP
    return {
        name[len(start) :]: meta
        for name, meta in read_metadata(folder).state_dict_metadata.items()
        if name.startswith(start) and isinstance(meta, TensorStorageMetadata)
    }


@functools.cache
def _dcp_load_types() -> tuple[type[FileSystemReader], type]:
    """DCP's file reader with :func:`read_metadata` for ``.metadata``, and a load planner for
    tensors only (a non-tensor value would be unpickled by plain pickle, so it is refused); defined
    on first use, as subclasses of DCP's classes (costly to import: see the imports)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            return read_metadata(Path(self.path), self.load_id)

    class TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            raise TurbotrainError(
                f"{read_item.dest_index.fqn} is stored as a pickled object; turbotrain checkpoints "
                "hold tensors only"
            )

    return SafeReader, TensorsOnly


def _dcp_load(path: Path, tensors: dict[str, torch.Tensor], source: str) -> None:
    import torch.distributed.checkpoint as dcp  # costly: see the imports
    from torch.distributed.checkpoint import CheckpointException

    read_metadata(path)  # an unreadable or foreign .metadata says so, not "does not fit"
    reader, tensors_only = _dcp_load_types()
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(tensors, storage_reader=reader(path), planner=tensors_only(), no_dist=not in_group())
    except TurbotrainError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP wraps every rank's failure in CheckpointException
        detail = describe(exc)[:300]
        raise TurbotrainError(
            f"{source}: its model or optimizer state does not fit the ones this config builds "
            f"({detail}); resume without overrides that change --model.* settings"
        ) from None


def read_state(path: Path) -> dict[str, Any]:
    """``state.pt`` of checkpoint folder ``path``: the replicated non-tensor state."""
    return _torch_load(path / STATE_FILE)


def read_rank_state(path: Path, rank: int, world: int) -> dict[str, Any] | None:
    """This rank's per-rank state, or None when ``path`` was written by another world size."""
    if saved_world(path) != world:
        return None
    return _torch_load(path / rank_file(rank))


def _torch_load(file: Path) -> dict[str, Any]:
    try:
        payload = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means an unusable file
        raise TurbotrainError(
            f"{file.parent.name}/{file.name} cannot be read: {' '.join(str(exc).split())[:200]}"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise TurbotrainError(
            f"{file.parent.name}/{file.name} is not part of a turbotrain checkpoint (format {FORMAT})"
        )
    return payload


def load_into(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]
) -> None:
    """Load the model and optimizer of checkpoint folder ``path`` into ``model`` and ``optimizer``
    as they are wrapped here (plain, DDP or FSDP2, any world size). ``state`` is its
    :func:`read_state`. A collective under a process group: every rank calls it."""
    tensors, _ = split_state(model, optimizer)  # targets shaped as here: DCP fills them (reshards)
    # an unreadable or refused .metadata is said once, by rank 0; then each rank reads its own
    decided_by_main(lambda: read_metadata(path) and None)
    saved = read_metadata(path).state_dict_metadata
    # written by newer versions only: an older checkpoint leaves them as the model has them
    absent = {n for n in tensors if n not in saved and n.rsplit(_SEP, 1)[-1].endswith(OPTIONAL_SUFFIXES)}
    _dcp_load(path, {n: t for n, t in tensors.items() if n not in absent}, path.name)
    flat = {**tensors, **state.get("objects", {})}
    optim_sd = {"state": _unflatten(flat, OPTIM), "param_groups": state.get("param_groups", [])}
    _set(model, optimizer, _unflatten(flat, MODEL), optim_sd, False, path.name)


def load_model_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model's weights in checkpoint folder ``path`` as one plain state dict (full tensors, the
    names of an unwrapped model), read in this process alone: no process group, no model needed."""
    start = MODEL + _SEP
    tensors = {
        start + name: torch.empty(meta.size, dtype=meta.properties.dtype)
        for name, meta in saved_model_tensors(path).items()
    }
    _dcp_load(path, tensors, path.name)
    return {name[len(start) :]: t for name, t in tensors.items()}
