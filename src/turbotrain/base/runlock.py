"""One lock per run directory: a second process cannot train, resume or start a run in it. A POSIX
record lock (``lockf``) on ``RUN/.lock``: the kernel drops it however the process dies, forked workers
do not inherit it (unlike ``flock``); re-entrant in a process (closing any descriptor would drop it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from pathlib import Path
from types import TracebackType

from .config_fields import setting
from .errors import TurbotrainError

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"

_HELD: dict[str, list[int]] = {}  # real path of a run directory -> [fd, depth] for locks this process holds


class RunInUseError(TurbotrainError):
    """Another live process holds the run directory's lock."""


def _holder(fd: int) -> str:
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return text if text.isdigit() else "unknown"


class RunLock:
    """``with RunLock(run_dir):`` holds ``run_dir``'s lock for the block (the folder must exist)."""

    def __init__(self, run_dir: Path | str) -> None:
        self.run_dir = Path(run_dir)
        self._key = os.path.realpath(self.run_dir)

    def acquire(self) -> RunLock:
        held = _HELD.get(self._key)
        if held is not None:
            held[1] += 1
            return self
        try:
            fd = os.open(self.run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise self._cannot(exc) from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):  # no POSIX locks on this file system
                os.close(fd)
                raise self._cannot(exc) from None
            pid = _holder(fd)
            os.close(fd)
            raise RunInUseError(
                f"run directory {self.run_dir} is in use by process {pid} (training or resuming it); wait for it "
                f"to finish, stop it (kill -TERM {pid} saves a checkpoint first), or choose another {setting('run.name', 'NAME')}"
            ) from None
        previous = _holder(fd)
        if previous not in ("unknown", str(os.getpid())):
            log.info(
                "run directory %s: taking over the lock of process %s, which ended without releasing it",
                self.run_dir,
                previous,
            )
        with contextlib.suppress(OSError):  # the PID is for messages only: a full disk must not stop the run
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _HELD[self._key] = [fd, 1]
        return self

    def _cannot(self, exc: OSError) -> TurbotrainError:
        return TurbotrainError(
            f"cannot lock run directory {self.run_dir} ({exc.strerror}); "
            f"choose another {setting('run.out_dir', 'DIR')} on a local disk"
        )

    def release(self) -> None:
        held = _HELD.get(self._key)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _HELD[self._key]
            with contextlib.suppress(OSError):  # empty: its last holder ended cleanly; a PID: it died
                os.ftruncate(held[0], 0)
            os.close(held[0])  # drops the lock; the file stays, unlocked

    @property
    def held(self) -> bool:
        """Whether this process holds the lock."""
        return self._key in _HELD

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
