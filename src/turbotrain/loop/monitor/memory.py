"""Memory in each record: the CUDA caching allocator's counters (no sync), a one-time warning
when the peak reserved memory nears the limit, and the process's host memory (RSS)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ...base.units import gib
from ...parts.hardware import device_total_bytes, process_rss_bytes
from ..hooks import every

log = logging.getLogger(__name__)

MEMORY_WARNING = "memory_warning"  # the record key and engine event kind of the high-memory warning


def collect_cuda_memory(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocator's counters in bytes (no sync)."""
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak": torch.cuda.max_memory_allocated(device),
        "peak_reserved": torch.cuda.max_memory_reserved(device),
    }


class MemoryProbe:
    """GPU memory in GiB (allocated, reserved, peak since the start or :meth:`reset_peak`), and a
    warning once when the peak reserved reaches ``warn_fraction`` of the limit (the device's total,
    or ``cap_fraction`` of it). ``every``: None = in each record; N = every N-th step; 0 = never.
    ``read`` and ``limit_bytes``: the CUDA device's by default."""

    def __init__(
        self,
        device: torch.device,
        *,
        every: int | None = None,
        warn_fraction: float = 0.9,
        cap_fraction: float = 0.0,
        limit_bytes: int | None = None,
        read: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.device, self.every, self.warn_fraction = device, every, warn_fraction
        self.limit_what = f"the cap ({cap_fraction:g} of the device)" if cap_fraction > 0 else "the device's"
        if limit_bytes is None and warn_fraction > 0:
            total = device_total_bytes(device)
            limit_bytes = int(total * cap_fraction) if total and cap_fraction > 0 else total
        self.limit_bytes = limit_bytes
        self.read = read or (lambda: collect_cuda_memory(device))
        self.warned = False

    def due(self, step: int) -> bool:
        return self.every is not None and every(step, self.every)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def __call__(self, record: dict[str, Any] | None = None) -> dict[str, Any]:
        counters = self.read()
        out: dict[str, Any] = {}
        if self.every is None or self.due((record or {}).get("step", 0)):
            out.update(
                mem_allocated_gib=gib(counters["allocated"]),
                mem_reserved_gib=gib(counters["reserved"]),
                mem_peak_gib=gib(counters["peak"]),
            )
        warning = self.check(counters["peak_reserved"])
        return {**out, MEMORY_WARNING: warning} if warning else out

    def check(self, used_bytes: int) -> str | None:
        """The warning (also logged) the first time ``used_bytes`` reaches the limit's fraction."""
        limit = self.limit_bytes
        if self.warned or self.warn_fraction <= 0 or not limit or used_bytes < self.warn_fraction * limit:
            return None
        self.warned = True
        text = (
            f"GPU memory is high: peak reserved {gib(used_bytes):.2f} GiB is {used_bytes / limit:.0%} of {self.limit_what} "
            f"{gib(limit):.2f} GiB (monitor.memory_warn_fraction = {self.warn_fraction:g}); a longer batch or sequence "
            "may run out of memory: lower batch.micro or set memory.checkpointing"
        )
        log.warning(text)
        return text


class HostMemoryProbe:
    """This process's resident host memory (RSS) in GiB at each record (nothing where the OS does not say)."""

    def __init__(self, read: Callable[[], int | None] | None = None) -> None:
        self.read = read or process_rss_bytes

    def __call__(self, record: dict[str, Any] | None = None) -> dict[str, Any]:
        rss = self.read()
        return {} if rss is None else {"host_rss_gib": gib(rss)}
