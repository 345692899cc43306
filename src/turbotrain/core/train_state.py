"""The Engine's records of a run: its progress counters and the events that changed how it trains.

Both are saved with the engine's state (exact resume) and the events go to summary.json.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    """Progress counters (host integers, never synced from the device)."""

    step: int = 0  # optimizer steps taken (a skipped non-finite step counts: the schedule moves on)
    micro_step: int = 0  # forward/backward passes
    batches: int = 0  # loader batches consumed by forward_backward / train_window: the data position
    samples: int = 0
    tokens: int = 0


@dataclass
class Event:
    """Something that changed how the run trains (precision fallback, OOM recovery)."""

    step: int
    kind: str
    detail: str
