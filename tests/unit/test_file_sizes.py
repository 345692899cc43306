"""Files that hold one concern: no source file of the package is over 600 lines (issue 33: the big
files regrew to 820-995 lines between reviews). A file that outgrows the limit is split by
concern (a package of small modules), never trimmed by squeezing lines."""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "turbotrain"
MAX_LINES = 600


def test_no_source_file_is_over_600_lines():
    sizes = {p.relative_to(SRC).as_posix(): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    assert len(sizes) > 100  # the package was found
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"split these by concern (over {MAX_LINES} lines): {over}"
