"""One line for a failure inside a user's workload (``--model FILE.py:FUNC``), instead of a
traceback, and the cause read back from a dead trial process's log.
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
        if not f.filename.startswith((PACKAGE_DIR, "<"))
        and not any(lib in f.filename for lib in ("site-packages", "/lib/python"))
    ]
    if not own:
        return ""
    f = own[-1]
    return f" ({Path(f.filename).name}:{f.lineno}, in {f.name})"


def first_line(text: object, empty: str = "") -> str:
    """The first line of ``str(text)``, stripped; ``empty`` when there is none."""
    stripped = str(text).strip()
    return stripped.splitlines()[0] if stripped else empty


def one_line(exc: BaseException) -> str:
    """``exc`` as one line: its type, first line of its message and where in the user's code
    (``RuntimeError: broken (wl.py:10, in forward)``); a DataLoader worker's re-raised error is its cause."""
    if isinstance(exc, StopIteration):
        return EMPTY_LOADER
    text = str(exc).strip()
    # re-raised from a DataLoader worker: its last line is the cause
    if text.startswith("Caught ") and "Traceback" in text:
        return text.splitlines()[-1].strip()[:300]
    if isinstance(exc, TurbotrainError):
        return first_line(text, type(exc).__name__)[:300]
    first = first_line(text)
    return (f"{type(exc).__name__}: {first}"[:300] if first else type(exc).__name__) + _where(exc)


def workload_failed(
    what: str, exc: BaseException, after: str = "", *, in_user_code: bool = True
) -> TurbotrainError | None:
    """The one line for the user's own code failing, a :class:`TurbotrainError`; else None."""
    if not isinstance(exc, Exception) or isinstance(exc, TurbotrainError) or not _where(exc):
        return None
    return TurbotrainError(f"{what}: the workload failed: {one_line(exc)}{after}")


def no_setting_fixes(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure no searched setting changes (a study stops at once)."""
    return isinstance(exc, (LossError, StopIteration)) or "yielded no batch" in str(exc)


_EXC_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|StopIteration)\b")


def cause_in_log(text: str, code: int | None) -> str:
    """The cause of a dead process: its last traceback's exception line, an error line, or its exit."""
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
