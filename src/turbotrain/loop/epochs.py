"""The epoch log (``train.epochs``): after each epoch's last optimizer step (Evaluate has just
validated there) an event record ``{"event": "epoch", "epoch", "step", "epoch_s",
"epoch_train_loss", "epoch_val_loss", "epoch_val_<metric>", "epoch_peak_mem_gib"}`` to
metrics.jsonl, one log line, and the device's peak memory started over. ``epoch_train_loss``: the
mean of the epoch's finite step losses (summed on the device, read once per epoch: a host-device
sync point). After a resume mid-epoch, ``epoch_s`` and the mean count from the resume."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from .hooks import FitContext, Hook
from .monitor.hook import Monitor
from .monitor.memory import MemoryProbe

log = logging.getLogger(__name__)


class EpochLog(Hook):
    """See the module docstring; ``epochs`` is the run's total, for the line."""

    def __init__(self, monitor: Monitor, steps_per_epoch: int, epochs: int) -> None:
        self.monitor, self.steps_per_epoch, self.epochs = monitor, steps_per_epoch, epochs
        self._start = time.perf_counter()
        self._memory = next((p for p in monitor.probes if isinstance(p, MemoryProbe)), None)
        self._losses: list[torch.Tensor] = []  # this epoch's step losses, on the device

    def on_fit_start(self, ctx: FitContext) -> None:
        self._start = time.perf_counter()

    def _take_mean_loss(self) -> float | None:
        """The mean of the epoch's finite step losses, or None; and start over."""
        losses, self._losses = self._losses, []
        if not losses:
            return None
        stacked = torch.stack(losses).float()
        finite = torch.isfinite(stacked)
        # host-device sync point (once per epoch)
        summed, n = torch.stack((stacked.where(finite, 0.0).sum(), finite.sum().float())).tolist()
        return summed / n if n else None

    def on_step_end(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        if ctx.engine.last_loss is not None:  # a device copy: a CUDA-graph replay overwrites it
            self._losses.append(ctx.engine.last_loss.detach().clone())
        if step % self.steps_per_epoch:
            return
        now = time.perf_counter()
        record: dict[str, Any] = {
            "step": step,
            "event": "epoch",
            "epoch": step // self.steps_per_epoch,
            "epoch_s": round(now - self._start, 3),
        }
        mean_loss = self._take_mean_loss()
        if mean_loss is not None:
            record["epoch_train_loss"] = mean_loss
        m = ctx.metrics
        if m.get("val_step") == step:
            record["epoch_val_loss"] = m["val_loss"]
            record.update({f"epoch_{k}": v for k, v in (m.get("val_metrics") or {}).items()})
        if self._memory is not None:
            record["epoch_peak_mem_gib"] = self._memory.read()["peak"] / 2**30
            self._memory.reset_peak()  # the next epoch's peak starts here
        self.monitor.write_event(record)
        log.info("%s", format_epoch(record, self.epochs))
        self._start = time.perf_counter()


def format_epoch(record: dict[str, Any], epochs: int) -> str:
    """``epoch 2/5 | 12.3 s | train loss 1.2345 | val loss 1.3000 | val accuracy 0.8125 | peak 1.20 GiB``."""
    parts = [f"epoch {record['epoch']}/{epochs}", f"{record['epoch_s']:.1f} s"]
    for key, value in record.items():
        if key.startswith("epoch_") and key not in ("epoch_s", "epoch_peak_mem_gib") and value is not None:
            parts.append(f"{key[len('epoch_') :].replace('_', ' ')} {value:.4f}")
    if record.get("epoch_peak_mem_gib") is not None:
        parts.append(f"peak {record['epoch_peak_mem_gib']:.2f} GiB")
    return " | ".join(parts)
