"""One atomic file write for every file turbotrain leaves behind.

Why: a crash (or kill -9) mid-write must leave either the old file or the new one, never half of
one. The content goes to a temporary sibling (``.NAME.tmpPID``), is fsynced, renamed over the
target (atomic on POSIX), and the folder is fsynced so the rename itself survives a power loss.

A write that fails leaves no temporary file; one that fails for lack of space (a full file system,
a quota, or a ``ulimit -f`` file-size limit) raises :class:`DiskFullError`, and one refused by the
file system (a read-only folder, a path through a file, no permission) :class:`UnwritableError`:
each one line naming the file. Content is written with ``file.write`` (bytes, text, or any buffer
such as a numpy array): numpy's ``tofile`` reports a short write as an OSError without an errno,
which no one can tell from any other failure. :func:`make_dirs` creates a folder with the same
one-line errors. A process killed mid-write cannot clean up: :func:`clean_stale_temps` removes what such a
process left, and the run's start calls it.
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

# ENOSPC: the file system is full; EDQUOT: the user's quota is; EFBIG: the file-size limit
# (``ulimit -f``, RLIMIT_FSIZE) or the file system's largest file is reached.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# the file system refuses the write whatever the space: no permission, read-only, a path through
# a file (ENOTDIR), a file where a folder must be (EEXIST from mkdir), a folder where a file must be
REFUSED_ERRNOS = frozenset(
    {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.EISDIR}
)
_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp(?P<pid>\d+)$")


class DiskFullError(TurbotrainError):
    """A write failed for lack of space. ``path`` is the file; ``note`` (added by whoever knows
    it, e.g. the run's last intact checkpoint) goes at the end of the one-line message."""

    def __init__(self, path: Path | str, reason: str, note: str = "") -> None:
        self.path, self.reason, self.note = Path(path), reason, note
        message = f"cannot write {path}: {reason}; free space on that disk (or raise the file-size limit, ulimit -f)"
        super().__init__(message + (f"; {note}" if note else ""))

    def with_note(self, note: str) -> DiskFullError:
        return DiskFullError(self.path, self.reason, note)


class UnwritableError(TurbotrainError, OSError):
    """The file system refused a write (see REFUSED_ERRNOS): one line naming the path, the reason
    and ``hint`` (what to change, e.g. the setting that chose the folder)."""

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
    """The OSError with a disk-full errno in ``exc`` or its causes, if any. ``torch.save``
    reports a failed write as ``RuntimeError: ... unexpected pos``: the OSError is its context."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def reporting_disk_full(path: Path | str, hint: str = "") -> Iterator[None]:
    """Within the block, a write that fails for lack of space raises :class:`DiskFullError`
    naming ``path`` (for files appended to in place, such as metrics.jsonl); one the file system
    refuses (permission, read-only, a file in the way) :class:`UnwritableError` with ``hint``."""
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
    """``mkdir -p folder``, its failures one line: :class:`UnwritableError` (read-only, no
    permission, a file in the way) or :class:`DiskFullError`."""
    folder = Path(folder)
    if folder.is_dir():
        return folder
    with reporting_disk_full(folder, hint):
        folder.mkdir(parents=True, exist_ok=True)
    return folder


def temp_path(path: Path) -> Path:
    """The temporary sibling this process writes ``path`` through."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in ``folder`` durable, where the file system allows it (one
    that cannot open or fsync a folder is left as it is)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path | str, content: Content, hint: str = "") -> None:
    """Write ``content`` (bytes, UTF-8 text, a buffer such as a contiguous numpy array, or a
    ``write(file)`` callable given a binary file) to ``path`` atomically: temp sibling, fsync,
    rename, fsync of the folder. The temp file never outlives the call (not even a
    KeyboardInterrupt); lack of space raises :class:`DiskFullError`, a refused write
    :class:`UnwritableError` (with ``hint``, what to change)."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with reporting_disk_full(path, hint):
            with open(tmp, "wb") as f:
                if callable(content):
                    content(f)
                elif isinstance(content, str):
                    f.write(content.encode("utf-8"))
                else:
                    _write_all(f, memoryview(content).cast("B"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def _write_all(f: BinaryIO, view: memoryview) -> None:
    """Every byte of ``view``, in 64 MiB pieces (a short write raises the OSError with its errno)."""
    piece = 64 << 20
    for start in range(0, len(view), piece):
        f.write(view[start : start + piece])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def clean_stale_temps(folder: Path | str) -> list[Path]:
    """Remove the temporary files that writers killed mid-write (kill -9, power loss) left in
    ``folder``: those whose process is gone. A live process's temp file is left alone, so this
    is safe on folders shared between runs (the data cache). Returns what was removed."""

    def stale(entry: Path) -> bool:
        m = _TEMP.match(entry.name)
        return m is not None and int(m["pid"]) != os.getpid() and not _alive(int(m["pid"]))

    return remove_leftovers(folder, stale)


def remove_leftovers(folder: Path | str, leftover: Callable[[Path], bool]) -> list[Path]:
    """The one scan for what a killed writer left behind: remove each entry of ``folder`` that
    ``leftover(entry)`` names (a file, or a folder with all it holds). Returns what was removed."""
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
