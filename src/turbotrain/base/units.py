"""Memory units: one definition of a GiB and of the rounding reports use."""

from __future__ import annotations

GIB = 1024**3  # bytes
MIB = 1024**2
KIB = 1024


def unit_for(n_bytes: float) -> tuple[str, int]:
    """The unit a table of sizes up to ``n_bytes`` reads in (no column of 0.000 GiB)."""
    return ("GiB", GIB) if n_bytes >= GIB else ("MiB", MIB) if n_bytes >= MIB else ("KiB", KIB)


def gib(n_bytes: float | None) -> float | None:
    """Bytes -> GiB (2**30 bytes), rounded to 4 decimals; None stays None."""
    return None if n_bytes is None else round(n_bytes / GIB, 4)
