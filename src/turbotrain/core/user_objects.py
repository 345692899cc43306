"""What ``engine.setup`` changes in a user's own objects when asked (``optim.tune_user_optimizer``,
``data.tune_user_loader``; off by default: an own loop's objects are its own), each in one log line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..parts.data.loader import LoaderSettings, tune_loader
from ..parts.data.prefetch import DevicePrefetcher
from .optim import apply_fast_adam_kernel

log = logging.getLogger(__name__)


def tune_user_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """``optim.tune_user_optimizer``: the fast Adam kernel for ``device``, in place; one log line."""
    _log_tuning("optim.tune_user_optimizer", apply_fast_adam_kernel(optimizer, device))


def tune_user_loader(loader: Iterable[Any], settings: LoaderSettings | None) -> Iterable[Any]:
    """``data.tune_user_loader``: a torch DataLoader rebuilt with ``settings`` (None: off); else as it is."""
    if settings is None or isinstance(loader, DevicePrefetcher):
        return loader
    if not isinstance(loader, DataLoader):
        log.warning(
            "data.tune_user_loader: the loader is a %s, not a torch DataLoader; it is used as it is",
            type(loader).__name__,
        )
        return loader
    tuned = tune_loader(loader, settings)
    _log_tuning(
        "data.tune_user_loader",
        f"DataLoader: num_workers {loader.num_workers} -> {tuned.num_workers}, "
        f"pin_memory {loader.pin_memory} -> {tuned.pin_memory}, persistent_workers "
        f"{loader.persistent_workers} -> {tuned.persistent_workers}",
    )
    return tuned


def _log_tuning(switch: str, change: str | None) -> None:
    log.info(
        "%s: %s",
        switch,
        change or "left as it is (not a plain torch.optim.Adam/AdamW, or already that kernel)",
    )
