"""Memory units: one definition of a GiB and of the rounding reports use."""

from __future__ import annotations

GIB = 1024**3  # bytes


def gib(n_bytes: float | None) -> float | None:
    """Bytes -> GiB (2**30 bytes), rounded to 4 decimals; None stays None."""
    return None if n_bytes is None else round(n_bytes / GIB, 4)
