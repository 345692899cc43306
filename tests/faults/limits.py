"""Limits a test puts on the disk: ``ulimit -f`` for this process, a small or read-only tmpfs."""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def file_size_limit(n_bytes: int) -> Iterator[None]:
    """``ulimit -f``: writes past ``n_bytes`` fail with EFBIG (Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@contextlib.contextmanager
def tmpfs(folder: Path, options: str) -> Iterator[bool]:
    """A tmpfs mounted at ``folder`` with mount ``options`` (``size=800k``, ``ro,size=1m``):
    True where the tests run as root with mount rights, else False (nothing mounted)."""
    folder.mkdir(parents=True, exist_ok=True)
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True
        ).returncode
        != 0
    ):
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)
