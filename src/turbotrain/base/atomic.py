"""One atomic file write for every file turbotrain leaves behind: a crash (or kill -9) mid-write
leaves the old file or the new one, never half. Lack of space raises :class:`DiskFullError`, a
refused write :class:`UnwritableError`, each one line naming the file. Content goes through
``file.write``: numpy's ``tofile`` reports a short write as an OSError without an errno.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from .errors import TurbotrainError

# Any: an object with the buffer protocol (numpy array)
Content = bytes | str | memoryview | Any | Callable[[BinaryIO], object]

# a full file system, a quota, the file-size limit (ulimit -f)
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# refused whatever the space: permission, read-only, a file or folder in the way
REFUSED_ERRNOS = frozenset(
    {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.EISDIR}
)
_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp(?P<pid>\d+)$")


class DiskFullError(TurbotrainError):
    """A write failed for lack of space; ``note`` (e.g. the last intact checkpoint) ends the line."""

    def __init__(self, path: Path | str, reason: str, note: str = "") -> None:
        self.path, self.reason, self.note = Path(path), reason, note
        message = f"cannot write {path}: {reason}; free space on that disk (or raise the file-size limit, ulimit -f)"
        super().__init__(message + (f"; {note}" if note else ""))

    def with_note(self, note: str) -> DiskFullError:
        return DiskFullError(self.path, self.reason, note)


class UnwritableError(TurbotrainError, OSError):
    """The file system refused a write: one line naming the path, the reason and ``hint``."""

    def __init__(self, path: Path | str, reason: str, hint: str = "") -> None:
        self.path, self.reason = Path(path), reason
        super().__init__(
            f"cannot write {path}: {reason}; " + (hint or "make that folder writable or choose another")
        )


def _refused(exc: OSError) -> str:
    if exc.errno == errno.EEXIST:
        return "a file is in the way where a folder must be"
    if exc.errno == errno.ENOTDIR:
        return "a file is in the way where a folder must be (Not a directory)"
    return exc.strerror or os.strerror(exc.errno or errno.EACCES)


def disk_full_cause(exc: BaseException | None) -> OSError | None:
    """The OSError with a disk-full errno in ``exc`` or its causes (torch.save wraps it)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def reporting_disk_full(path: Path | str, hint: str = "") -> Iterator[None]:
    """Within the block, a failed write raises :class:`DiskFullError` or :class:`UnwritableError`."""
    try:
        yield
    except (DiskFullError, UnwritableError):
        raise
    except Exception as exc:
        full = disk_full_cause(exc)
        if full is not None:
            raise DiskFullError(path, full.strerror or os.strerror(full.errno or errno.ENOSPC)) from None
        if isinstance(exc, OSError) and exc.errno in REFUSED_ERRNOS:
            named = exc.filename if exc.filename and not _TEMP.match(Path(exc.filename).name) else path
            raise UnwritableError(named, _refused(exc), hint) from None
        raise


def make_dirs(folder: Path | str, hint: str = "") -> Path:
    """``mkdir -p folder``, its failures one line."""
    folder = Path(folder)
    if folder.is_dir():
        return folder
    with reporting_disk_full(folder, hint):
        folder.mkdir(parents=True, exist_ok=True)
    return folder


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in ``folder`` durable, where the file system allows it."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path | str, content: Content, hint: str = "") -> None:
    """Write ``content`` (bytes, text, a buffer, or a ``write(file)`` callable) to ``path`` atomically:
    temp sibling, fsync, rename, fsync of the folder; the temp file never outlives the call."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")  # _TEMP's form
    try:
        with reporting_disk_full(path, hint):
            with open(tmp, "wb") as f:
                if callable(content):
                    content(f)
                elif isinstance(content, str):
                    f.write(content.encode("utf-8"))
                else:  # in 64 MiB pieces (a short write raises the OSError with its errno)
                    view = memoryview(content).cast("B")
                    for start in range(0, len(view), 64 << 20):
                        f.write(view[start : start + (64 << 20)])
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def clean_stale_temps(folder: Path | str) -> list[Path]:
    """Remove the temp files of writers killed mid-write (a live process's are kept); what was removed."""

    def stale(entry: Path) -> bool:
        m = _TEMP.match(entry.name)
        return m is not None and int(m["pid"]) != os.getpid() and not _alive(int(m["pid"]))

    return remove_leftovers(folder, stale)


def remove_leftovers(folder: Path | str, leftover: Callable[[Path], bool]) -> list[Path]:
    """The one scan for what a killed writer left: remove each entry ``leftover(entry)`` names."""
    removed: list[Path] = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for entry in entries:
        if leftover(entry):
            with contextlib.suppress(OSError):
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
                removed.append(entry)
    return removed
