"""Every test here starts several processes (torchrun with gloo, or a worker launched twice): they
are marked ``slow``, so ``pytest -m "not slow"`` is the quick run and the full suite runs them."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.slow)
