"""The bench's loss-parity rule: how far two rows' final losses may differ and still count as the
same training (used by the bench's tables and by ``choose``'s decision)."""

from __future__ import annotations

from typing import Any

# Loss parity: the same recipe in the same arithmetic differs only by kernel summation order
# (fused vs foreach vs for-loop AdamW, clipping): 1e-3 nats after a few dozen steps is generous.
# Against 16-bit or TF32 arithmetic the rounding compounds: 0.05 nats or 1% of the loss.
SAME_PRECISION_TOL = 1e-3
MIXED_PRECISION_TOL = 0.05
MIXED_PRECISION_REL_TOL = 0.01


def loss_tolerance(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest acceptable |final loss difference| between rows ``a`` and ``b`` (nats)."""
    if a.get("math_precision") == b.get("math_precision") == "fp32":
        return SAME_PRECISION_TOL
    return max(MIXED_PRECISION_TOL, MIXED_PRECISION_REL_TOL * abs(b.get("final_loss") or 0.0))
