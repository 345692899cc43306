"""One atomic file write for every file turbotrain leaves behind.

Why: a crash (or kill -9) mid-write must leave either the old file or the new one, never half of
one. The content goes to a temporary sibling, is fsynced, renamed over the target (atomic on
POSIX), and the folder is fsynced so the rename itself survives a power loss.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable

Content = bytes | str | Callable[[BinaryIO], object]


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
    outlives the call."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode("utf-8") if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)
