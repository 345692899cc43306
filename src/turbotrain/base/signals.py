"""SIGTERM, SIGINT and SIGUSR1 for a whole command: handled from the moment it starts until it exits.

One signal means "save what there is to save, then stop"; what that takes depends on the phase
the command is in, so each phase says it with :meth:`StopSignals.on_first`:

- start-up (arguments, config, the process group, building the run): stop at once by raising
  :class:`turbotrain.app.prepare.StoppedBySignal` (nothing trained yet; exit 75);
- training: ask the loop to stop after the current step, which writes the final checkpoint
  (:class:`turbotrain.loop.hooks.StopOnSignal`; exit 75);
- the end (summary, report): only recorded; the summary is still written, the command ends 75.

SIGUSR1 does the same as SIGTERM; ``turbotrain train`` then exits with the requeue code (79)
instead of 75: it is the signal a SLURM job asks for before its time limit
(``#SBATCH --signal=USR1@90``), and the batch script requeues the job on that code.

A second signal, in any phase, means "stop now": :class:`KeyboardInterrupt` (exit 130), and the
previous actions come back (a third signal gets them).

The first signal is acknowledged at once, in the handler, with one line on stderr (``os.write``:
no buffered stream is touched inside a handler) when the stop waits for something: "stopping after
this step; Ctrl-C again to abort" (rank 0 only under torchrun). Start-up's stop says itself.

A process that starts with SIGINT ignored (a background job of a non-interactive shell, or a
launcher that ignores it on purpose) keeps ignoring SIGINT in every phase, as POSIX intends;
SIGTERM is always handled.
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
        """From now on the first signal calls ``action(name)`` (None: it is only recorded). A
        signal that came before and was not acted on yet is acted on now, so none is lost
        between two phases."""
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
    """Say at once, from a signal handler, that signal ``name`` was heard and what happens next:
    one line on stderr by ``os.write`` (safe in a handler), on rank 0 only (the others would repeat it)."""
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
