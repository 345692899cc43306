"""The environment of a ``python -m turbotrain`` subprocess that gets a fault injected
(``sitecustomize.py`` in this folder reads TT_FAULT; see its docstring)."""

from __future__ import annotations

import os
from pathlib import Path

FAULTS = Path(__file__).resolve().parent


def fault_env(fault: str = "", marker: Path | None = None) -> dict[str, str]:
    """This process's environment with this folder first on PYTHONPATH and ``fault``
    (``POINT:N``; empty = none) and the pause ``marker`` file set."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH", "")])),
    }
    env.pop("TT_FAULT", None)
    env.pop("TT_FAULT_MARKER", None)
    if fault:
        env["TT_FAULT"] = fault
    if marker is not None:
        env["TT_FAULT_MARKER"] = str(marker)
    return env
