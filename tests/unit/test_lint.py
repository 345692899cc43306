"""The tree stays formatted and lint-clean: ``ruff format`` and ``ruff check`` (configured in
pyproject.toml) over the code the project ships and tests, so the README's test command (and with
it ``.ci/run``) fails on a file that drifts. Seconds; ruff comes with the ``dev`` extra."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from conftest import HANG_S

ROOT = Path(__file__).resolve().parents[2]
TREES = ["src", "tests", "benchmarks", "examples"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    ruff = shutil.which("ruff")
    assert ruff is not None, 'ruff is missing: pip install -e ".[dev]" installs it'
    return subprocess.run([ruff, *args, *TREES], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)


def test_the_tree_is_formatted_and_lint_clean():
    formatted = _ruff("format", "--check")
    assert formatted.returncode == 0, (
        f"run `ruff format {' '.join(TREES)}`:\n{formatted.stdout}{formatted.stderr}"
    )
    lint = _ruff("check", "--output-format", "concise")
    assert lint.returncode == 0, f"ruff check (fix with `ruff check --fix`):\n{lint.stdout}{lint.stderr}"
