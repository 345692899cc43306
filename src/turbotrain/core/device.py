"""Which device this process trains on, and how much of its memory it may hold."""

from __future__ import annotations

import logging

import torch

from ..base.config import setting
from ..base.errors import ConfigError
from ..base.launch import Topology

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; an explicit CUDA device must exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"run.device = {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"run.device = {name!r} but no CUDA GPU is visible to torch; use {setting('run.device', 'cpu')} or auto"
        )
    return device


def local_device(device: torch.device, topology: Topology) -> torch.device:
    """A bare ``cuda`` as this process's own GPU (``cuda:LOCAL_RANK`` under a launcher), made current."""
    if device.type == "cuda" and device.index is None:
        device = torch.device(
            "cuda", topology.local_rank if topology.launched else torch.cuda.current_device()
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def apply_memory_cap(device: torch.device, fraction: float) -> None:
    """``memory.max_fraction``: cap this process's CUDA caching allocator (0 = no cap)."""
    if fraction <= 0:
        return
    if device.type != "cuda":
        log.info(
            "memory.max_fraction = %g does not apply on %s (it caps the CUDA caching allocator); training runs uncapped",
            fraction,
            device.type,
        )
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(float(fraction), index)
    log.info(
        "memory.max_fraction: this process may hold at most %g of cuda:%d's memory; past it allocations fail "
        "as out-of-memory (memory.on_oom applies)",
        fraction,
        index,
    )
