"""The Engine's records of a run: its progress counters and the events that changed how it trains.

Both are saved with the engine's state (exact resume) and the events go to summary.json.
"""

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
        """Add a batch's samples and tokens; any structure. Tokens are the real ones
        (:func:`~turbotrain.base.batch.real_tokens`: an attention mask's ones, padding left out;
        else from shapes). A batch counted while it is still on the host costs no sync (the
        engine's loader counts each so); a mask already on an accelerator is read there."""
        self.samples += batch_size(batch)
        self.tokens += int(real_tokens(batch))  # host-device sync point only for a mask on a device


@dataclass
class Event:
    """Something that changed how the run trains (precision fallback, OOM recovery)."""

    step: int
    kind: str
    detail: str
