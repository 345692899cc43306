"""One atomic file write for every file turbotrain leaves behind.

Why: a crash (or kill -9) mid-write must leave either the old file or the new one, never half of
one. The content goes to a temporary sibling (``.NAME.tmpPID``), is fsynced, renamed over the
target (atomic on POSIX), and the folder is fsynced so the rename itself survives a power loss.

A write that fails leaves no temporary file; one that fails for lack of space (a full file system,
a quota, or a ``ulimit -f`` file-size limit) raises :class:`DiskFullError`, one line naming the
file. A process killed mid-write cannot clean up: :func:`clean_stale_temps` removes what such a
process left, and the run's start calls it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from .errors import TurbotrainError

Content = bytes | str | Callable[[BinaryIO], object]

# ENOSPC: the file system is full; EDQUOT: the user's quota is; EFBIG: the file-size limit
# (``ulimit -f``, RLIMIT_FSIZE) or the file system's largest file is reached.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp(?P<pid>\d+)$")


class DiskFullError(TurbotrainError):
    """A write failed for lack of space. ``path`` is the file; ``note`` (added by whoever knows
    it, e.g. the run's last intact checkpoint) goes at the end of the one-line message."""

    def __init__(self, path: Path | str, reason: str, note: str = "") -> None:
        self.path, self.reason, self.note = Path(path), reason, note
        message = f"cannot write {path}: {reason}; free space on that disk (or raise the file-size limit, ulimit -f)"
        super().__init__(message + (f"; {note}" if note else ""))

    def with_note(self, note: str) -> "DiskFullError":
        return DiskFullError(self.path, self.reason, note)


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
def reporting_disk_full(path: Path | str) -> Iterator[None]:
    """Within the block, a write that fails for lack of space raises :class:`DiskFullError`
    naming ``path`` (for files appended to in place, such as metrics.jsonl)."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as exc:
        full = disk_full_cause(exc)
        if full is None:
            raise
        raise DiskFullError(path, full.strerror or os.strerror(full.errno or errno.ENOSPC)) from None


def temp_path(path: Path) -> Path:
    """The temporary sibling this process writes ``path`` through."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path | str, content: Content) -> None:
    """Write ``content`` (bytes, UTF-8 text, or a ``write(file)`` callable given a binary file)
    to ``path`` atomically: temp sibling, fsync, rename, fsync of the folder. The temp file never
    outlives the call (not even a KeyboardInterrupt); lack of space raises :class:`DiskFullError`."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        with reporting_disk_full(path):
            with open(tmp, "wb") as f:
                if callable(content):
                    content(f)
                else:
                    f.write(content.encode("utf-8") if isinstance(content, str) else content)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


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
    folder = Path(folder)
    removed: list[Path] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _TEMP.match(entry.name)
        if m and int(m["pid"]) != os.getpid() and not _alive(int(m["pid"])):
            with contextlib.suppress(OSError):
                entry.unlink()
                removed.append(entry)
    return removed
