"""One line for a failure inside a user's workload (``--model FILE.py:FUNC``): what ``profile`` and
``tune`` print instead of a traceback, and what tune reads back from a trial process that died.

- :func:`one_line`: ``RuntimeError: my forward is broken (wl.py:10, in forward)``: the exception
  and the last frame of the user's own code; an empty loader's bare ``StopIteration`` says so; a
  DataLoader worker's re-raised error is its cause, not "Caught ... in DataLoader worker process 0".
- :func:`workload_failed`: that line as the error every command raises (train, profile, bench,
  tune, memory, ``turbotrain.train()``): exit 2, no traceback.
- :func:`no_setting_fixes`: failures that no setting tune or profile changes can fix (the loss is
  not a scalar, the loader yields nothing): a study stops at once instead of proposing more.
- :func:`cause_in_log`: the cause in a dead process's log: the last traceback's exception line,
  not the log's last line (often a warning's source line).
"""

from __future__ import annotations

import re
import signal
import traceback
from pathlib import Path

from .errors import LossError, TurbotrainError

PACKAGE_DIR = str(Path(__file__).resolve().parents[1])
EMPTY_LOADER = "the train_loader yielded no batch (it is empty)"


def _where(exc: BaseException) -> str:
    """``file:line, in function`` of the last frame of the user's code (not torch's, not ours)."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    own = [
        f
        for f in frames
        if not (
            f.filename.startswith(PACKAGE_DIR)
            or "site-packages" in f.filename
            or f.filename.startswith("<")
            or "/lib/python" in f.filename
        )
    ]
    if not own:
        return ""
    f = own[-1]
    return f" ({Path(f.filename).name}:{f.lineno}, in {f.name})"


def one_line(exc: BaseException) -> str:
    """``exc`` as one line: its type, first line of its message and where in the user's code."""
    if isinstance(exc, StopIteration):
        return EMPTY_LOADER
    text = str(exc).strip()
    # re-raised from a DataLoader worker: its last line is the cause
    if text.startswith("Caught ") and "Traceback" in text:
        return text.splitlines()[-1].strip()[:300]
    if isinstance(exc, TurbotrainError):
        return text.splitlines()[0][:300] if text else type(exc).__name__
    first = text.splitlines()[0] if text else ""
    return (f"{type(exc).__name__}: {first}"[:300] if first else type(exc).__name__) + _where(exc)


def workload_failed(
    what: str, exc: BaseException, after: str = "", *, in_user_code: bool = True
) -> TurbotrainError | None:
    """The one line every command says when the user's own code fails (the forward or the loss on
    the example batch): ``WHAT: the workload failed: RuntimeError: ... (file.py:28, in loss)AFTER``,
    a :class:`TurbotrainError` (exit 2, no traceback); None when ``exc`` is not the user's code
    failing (ours, or a mistake already said in one line), to be raised as it is."""
    if not isinstance(exc, Exception) or isinstance(exc, TurbotrainError) or not _where(exc):
        return None
    return TurbotrainError(f"{what}: the workload failed: {one_line(exc)}{after}")


def no_setting_fixes(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure no searched setting changes (see the module docstring)."""
    return isinstance(exc, (LossError, StopIteration)) or "yielded no batch" in str(exc)


_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|StopIteration)\b")


def cause_in_log(text: str, code: int | None) -> str:
    """The cause of a process's failure from its log ``text`` and exit ``code``: the exception
    line of the last traceback; else the last line that names an error; else how it exited."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    last_tb = max(
        (i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")),
        default=None,
    )
    if last_tb is not None:
        after = [line for line in lines[last_tb + 1 :] if not line.startswith((" ", "\t"))]
        if after:
            return after[0].strip()[:300]
    errors = [line.strip() for line in lines if _EXC_LINE.match(line.strip()) or " error: " in line]
    if errors:
        return errors[-1][:300]
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + (
            " (out of memory? the kernel's OOM killer sends it)" if -code == signal.SIGKILL else ""
        )
    return f"exit code {code} with no error in its log"
