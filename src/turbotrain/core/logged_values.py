"""Scalars a user's loop logs through ``engine.log``: summed on the device (no sync per step), read at
the monitor's cadence."""

from __future__ import annotations

import torch


class LoggedValues:
    """``name -> (sum on the device, count)`` since the last :meth:`take`."""

    def __init__(self) -> None:
        self._sums: dict[str, tuple[torch.Tensor, int]] = {}

    @torch.no_grad()
    def add(self, name: str, value: torch.Tensor | float) -> None:
        """Add ``value`` (a tensor's mean, or a number) to ``name``'s sum; no host sync."""
        t = value.detach().float().mean() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        total, count = self._sums.get(name, (None, 0))
        self._sums[name] = (t if total is None else total + t.to(total.device), count + 1)

    def take(self) -> dict[str, torch.Tensor]:
        """The means since the last call, as device tensors named ``train_<name>``, and start over."""
        sums, self._sums = self._sums, {}
        return {f"train_{name}": total / count for name, (total, count) in sums.items()}
