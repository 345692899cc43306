"""The Engine's records of a run (saved with its state): progress counters and events."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..base.batch import batch_size, real_tokens


@dataclass
class TrainState:
    """Progress counters (host integers, never synced from the device)."""

    step: int = 0  # optimizer steps taken (a skipped non-finite step counts: the schedule moves on)
    micro_step: int = 0  # forward/backward passes
    batches: int = 0  # loader batches consumed by forward_backward / train_window: the data position
    samples: int = 0
    tokens: int = 0

    def count(self, batch: Any) -> None:
        """Add a batch's samples and real tokens (padding left out); no sync for a batch on the host."""
        self.samples += batch_size(batch)
        self.tokens += int(real_tokens(batch))  # host-device sync point only for a mask on a device


@dataclass
class Event:
    """Something that changed how the run trains (precision fallback, OOM recovery)."""

    step: int
    kind: str
    detail: str
