"""The package version and the commit its code came from, in one place."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
from pathlib import Path
from typing import Any

__version__ = "0.1.0"

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def package_version(name: str) -> str | None:
    """The installed version of the distribution ``name``; None where it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=PACKAGE_ROOT, capture_output=True, text=True, timeout=10)


def collect_git() -> dict[str, Any]:
    """The commit this package's code came from: ``TT_COMMIT`` (a device machine's), else git's."""
    if os.environ.get("TT_COMMIT"):
        return {"commit": os.environ["TT_COMMIT"], "source": "TT_COMMIT"}
    try:
        commit = _git("rev-parse", "--show-toplevel", "HEAD")
        if commit.returncode != 0:
            return {"commit": None, "detail": commit.stderr.strip()[:200]}
        top, head = commit.stdout.split()
        # installed inside another project's checkout
        if Path(top).resolve() / "src" / "turbotrain" != PACKAGE_ROOT:
            return {
                "commit": None,
                "detail": f"turbotrain is installed, not run from its checkout (the git tree at {top} is another's)",
            }
        status = _git("status", "--porcelain", "--untracked-files=no")
        return {"commit": head, "dirty": bool(status.stdout.strip()), "source": "git"}
    except (OSError, subprocess.SubprocessError) as exc:
        return {"commit": None, "detail": str(exc)[:200]}
