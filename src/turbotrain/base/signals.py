"""SIGTERM, SIGINT and SIGUSR1 for a whole command: handled from the moment it starts until it exits.

One signal means "save what there is to save, then stop"; each phase says what that takes with
:meth:`StopSignals.on_first`: start-up raises ``StoppedBySignal``, training stops after the current
step with a checkpoint, the end only records it (exit 75 each). SIGUSR1 does the same, and
``turbotrain train`` exits with the requeue code (79): SLURM's ``--signal=USR1@90``. A second
signal means "stop now": :class:`KeyboardInterrupt` (exit 130). The first is acknowledged at once
with one line on stderr (``os.write``, rank 0 only). A SIGINT ignored at start stays ignored.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
REQUEUE_SIGNAL = (
    "SIGUSR1"  # SLURM's warning before the time limit (--signal=USR1@SECONDS): save, stop, requeue
)

_ACTIVE: list[StopSignals] = []  # the installed controller (one per process, the innermost last)


class StopSignals:
    """The process's SIGTERM/SIGINT/SIGUSR1 handlers from :meth:`install` to :meth:`restore`."""

    def __init__(self) -> None:
        self.received: list[str] = []  # signal names, in order
        self._action: Callable[[str], None] | None = None
        self._acted = False
        self._previous: dict[int, Any] = {}

    @property
    def first(self) -> str:
        """The first signal's name ("SIGTERM"), or "" when none came."""
        return self.received[0] if self.received else ""

    def install(self) -> StopSignals:
        try:
            for sig in SIGNALS:
                if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # inherited as ignored: stays ignored
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: signals stay as they are
            self.restore()
            return self
        _ACTIVE.append(self)
        return self

    def restore(self) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        self._previous.clear()
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def on_first(self, action: Callable[[str], None] | None) -> None:
        """The first signal calls ``action(name)`` from now on (a signal not acted on yet: now)."""
        self._action = action
        if action is not None and self.received and not self._acted:
            self._acted = True
            action(self.received[0])

    def _handle(self, signum: int, frame: Any) -> None:
        self.received.append(signal.Signals(signum).name)
        if len(self.received) > 1:
            self.restore()
            raise KeyboardInterrupt  # the second: stop now
        if self._action is not None:
            self._acted = True
            # start-up's raises (its own message); training's asks the loop to stop
            self._action(self.received[0])
            acknowledge(self.received[0], "stopping after this step (it saves a checkpoint)")
        else:
            acknowledge(self.received[0], "finishing what is being written")


def acknowledge(name: str, what: str) -> None:
    """Say at once, from a handler, that ``name`` was heard and what happens next (``os.write``, rank 0)."""
    if os.environ.get("RANK", "0") != "0":
        return
    again = "Ctrl-C again" if name == "SIGINT" else f"a second {name}"
    with contextlib.suppress(OSError):  # stderr closed: nothing to tell
        os.write(2, f"\nturbotrain: {name} received: {what}; {again} to abort\n".encode())


def active() -> StopSignals | None:
    """The installed controller, if a command (or :func:`held`) installed one."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def held() -> Iterator[StopSignals]:
    """The installed controller, or one installed for the block (and restored after it)."""
    current = active()
    if current is not None:
        yield current
        return
    controller = StopSignals().install()
    try:
        yield controller
    finally:
        controller.restore()
