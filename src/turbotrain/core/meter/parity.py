"""The one loss-parity rule: how far two measurements' final losses may differ and still count as
the same training, and how much faster a candidate must be to be preferred (bench's tables and
recommendations, choose, tune and profile's verification all decide by it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Loss parity: the same recipe in the same arithmetic differs only by kernel summation order
# (fused vs foreach vs for-loop AdamW, clipping): 1e-3 nats after a few dozen steps is generous.
# Against 16-bit or TF32 arithmetic the rounding compounds: 0.05 nats or 1% of the loss.
SAME_PRECISION_TOL = 1e-3
MIXED_PRECISION_TOL = 0.05
MIXED_PRECISION_REL_TOL = 0.01
RECOMMEND_MIN_SPEEDUP = 1.05  # below this a faster candidate is within run-to-run noise: keep the reference
RULE = (
    f"|final loss - reference| <= {SAME_PRECISION_TOL} nats when both rows compute in fp32, "
    f"else <= max({MIXED_PRECISION_TOL} nats, {MIXED_PRECISION_REL_TOL:.0%} of the reference loss)"
)


def loss_tolerance(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest acceptable |final loss difference| between rows ``a`` and ``b`` (nats)."""
    if a.get("math_precision") == b.get("math_precision") == "fp32":
        return SAME_PRECISION_TOL
    return max(MIXED_PRECISION_TOL, MIXED_PRECISION_REL_TOL * abs(b.get("final_loss") or 0.0))


def interleaved(variants: int, repeats: int) -> Iterator[tuple[int, int]]:
    """(repeat, variant): every variant once a repeat, alternating direction, so load hits each alike."""
    for r in range(repeats):
        for i in range(variants) if r % 2 == 0 else reversed(range(variants)):
            yield r, i
