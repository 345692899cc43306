"""What a checkpoint is on disk, whether its save finished and whether it is intact: a file
``step_XXXXXXXX.pt`` (one process) with its ``.sha256`` sidecar written after it, or a folder
``step_XXXXXXXX/`` (ddp, fsdp) whose ``finished.json`` marker, written last, lists the world size
and each file's size and sha256. A save finished when its sidecar (marker) exists; it is usable
when every byte matches. Plain files load with ``weights_only=True``."""

from __future__ import annotations

import hashlib
import json
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from ...base.errors import TurbotrainError

FORMAT = 1
MARKER = "finished.json"
STATE_FILE = "state.pt"
_NAME = re.compile(r"^step_(\d{8,})(\.pt)?$")  # a .pt file (one process) or a folder (sharded)
_PARTIAL = re.compile(r"^\.step_(\d{8,})\.partial$")


def checkpoint_path(folder: Path, step: int) -> Path:
    return folder / f"step_{step:08d}.pt"


def checkpoint_dir(folder: Path, step: int) -> Path:
    return folder / f"step_{step:08d}"


def partial_dir(folder: Path, step: int) -> Path:
    """Where a sharded save writes before its marker exists and it is renamed into place."""
    return folder / f".step_{step:08d}.partial"


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def checkpoint_step(path: Path) -> int:
    """The optimizer step of a checkpoint (file or folder), from its name."""
    m = _NAME.match(path.name)
    if m is None:
        raise ValueError(f"{path.name} is not a checkpoint file name")
    return int(m[1])


def _is_checkpoint(path: Path) -> bool:
    m = _NAME.match(path.name)
    return m is not None and (path.is_file() if m[2] else path.is_dir())


def is_unfinished_save(entry: Path) -> bool:
    """``entry`` is what a killed sharded save leaves: a ``.step_*.partial`` or unmarked folder."""
    if not entry.is_dir():
        return False
    return bool(_PARTIAL.match(entry.name)) or (_is_checkpoint(entry) and not is_finished(entry))


def list_checkpoints(folder: Path) -> list[Path]:
    """Checkpoints in ``folder``, ``.pt`` files and sharded folders, oldest (lowest step) first."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if _is_checkpoint(p)), key=checkpoint_step)


def finished_checkpoints(folder: Path) -> list[Path]:
    """Checkpoints whose save finished (a file's sidecar, a folder's marker), oldest first."""
    return [p for p in list_checkpoints(folder) if (is_finished(p) if p.is_dir() else sidecar(p).is_file())]


def read_marker(path: Path) -> dict[str, Any] | None:
    """The finished marker of checkpoint folder ``path``, or None (unfinished or unreadable)."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("files"), dict) else None


def is_finished(path: Path) -> bool:
    return (path / MARKER).is_file()


def saved_world(path: Path) -> int:
    """How many processes wrote checkpoint folder ``path`` (0 when its marker is unreadable)."""
    marker = read_marker(path)
    return int(marker.get("world", 0)) if marker else 0


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _check_folder(path: Path) -> str:
    """'' when every file the marker of ``path`` lists has its size and sha256, else why not."""
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
            if sha256_of(file) != entry.get("sha256"):
                return f"{path.name}/{name} does not match its checksum (corrupt)"
        except OSError as exc:
            return f"{path.name}/{name} cannot be read ({exc.strerror})"
    return ""


def _check_file(path: Path) -> str:
    """'' when ``path`` matches its sidecar, else why not (a damaged sidecar is a mismatch)."""
    try:
        raw = sidecar(path).read_bytes()
    except FileNotFoundError:
        return f"{path.name} has no checksum file"
    except OSError as exc:
        return f"{path.name}'s checksum file cannot be read ({exc.strerror})"
    words = raw.split()
    expected = words[0].decode("ascii", "replace") if words else ""
    try:
        actual = sha256_of(path)
    except OSError as exc:
        return f"{path.name} cannot be read ({exc.strerror})"
    return "" if actual == expected else f"{path.name} does not match its checksum (truncated or corrupt)"


def verify_problem(path: Path) -> str:
    """'' when checkpoint ``path`` (either kind) is intact, else why not, in one line."""
    return _check_folder(path) if path.is_dir() else _check_file(path)


def _stamp(path: Path) -> tuple[str, int, int, int] | None:
    """What a remembered verification is tied to: sizes and modification times."""
    try:
        if path.is_dir():
            stats = [p.stat() for p in path.iterdir()]
            return (
                str(path),
                sum(st.st_size for st in stats),
                max((st.st_mtime_ns for st in stats), default=0),
                (path / MARKER).stat().st_mtime_ns,
            )
        st, side = path.stat(), sidecar(path).stat()
    except OSError:
        return None
    return str(path), st.st_size, st.st_mtime_ns, side.st_mtime_ns


_VERIFIED: dict[tuple[str, int, int, int], bool] = {}  # (path, size, mtimes) -> intact


def is_verified(path: Path) -> bool:
    """Whether checkpoint ``path`` matches its checksums; remembered, so each is hashed once."""
    stamp = _stamp(path)
    if stamp is None:
        return False
    if stamp not in _VERIFIED:
        _VERIFIED[stamp] = not verify_problem(path)
    return _VERIFIED[stamp]


def remember_verified(path: Path) -> None:
    """Mark ``path``, just written and hashed by its writer, as verified (no second read)."""
    stamp = _stamp(path)
    if stamp is not None:
        _VERIFIED[stamp] = True


def forget(folder: Path, live: set[str]) -> None:
    """Forget the verifications of deleted checkpoints in ``folder``."""
    for stamp in [k for k in _VERIFIED if k[0] not in live and Path(k[0]).parent == folder]:
        del _VERIFIED[stamp]


def require_verified(path: Path) -> None:
    """A one-line TurbotrainError saying why, unless checkpoint ``path`` verifies."""
    if not is_verified(path):
        raise TurbotrainError(verify_problem(path) or f"{path.name} does not verify")


def latest_verified(folder: Path) -> Path | None:
    return next((p for p in reversed(list_checkpoints(folder)) if is_verified(p)), None)


_REFUSED_GLOBAL = re.compile(r"Unsupported (?:global|class): (?:GLOBAL )?([\w.]+)")


def unreadable(name: str, exc: BaseException) -> str:
    """Why ``torch.load(..., weights_only=True)`` refused ``name``, in one line (not torch's advice)."""
    text = " ".join(str(exc).split())
    if isinstance(exc, pickle.UnpicklingError) or "weights_only" in text or "WeightsUnpickler" in text:
        found = _REFUSED_GLOBAL.search(text)
        what = f" ({found[1]})" if found else ""
        return (
            f"{name} holds objects that are refused{what}: it was not loaded (a checkpoint holds tensors and "
            "plain types only; anything else could run code when read)"
        )
    return f"{name} cannot be read: {text[:200]}"


def _load_plain(file: Path, name: str, what: str) -> dict[str, Any]:
    """``file`` loaded with ``weights_only=True``, or a one-line TurbotrainError naming ``name``."""
    try:
        payload = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means an unusable file
        raise TurbotrainError(unreadable(name, exc)) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise TurbotrainError(f"{name} is not {what} (format {FORMAT})")
    return payload


def read_payload(path: Path, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """What one-process checkpoint ``path`` holds, verified; else a one-line TurbotrainError."""
    problem = _check_file(path)
    if problem:
        raise TurbotrainError(problem)
    payload = _load_plain(path, path.name, "a turbotrain checkpoint")
    missing = [key for key in required if key not in payload]
    if missing:
        raise TurbotrainError(f"{path.name} holds no {', '.join(missing)} state")
    return payload


def read_state(path: Path) -> dict[str, Any]:
    """``state.pt`` of checkpoint folder ``path``: the replicated non-tensor state."""
    return _load_plain(path / STATE_FILE, f"{path.name}/{STATE_FILE}", "part of a turbotrain checkpoint")


def read_rank_state(path: Path, rank: int, world: int) -> dict[str, Any] | None:
    """This rank's state in checkpoint folder ``path``, or None when another world size wrote it."""
    if saved_world(path) != world:
        return None
    name = rank_file(rank)
    return _load_plain(path / name, f"{path.name}/{name}", "part of a turbotrain checkpoint")
