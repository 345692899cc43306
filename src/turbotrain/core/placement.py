"""Placement checks, run once (never per step): a tensor left on the host names itself and the fix
instead of failing deep inside a kernel.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..base.batch import misplaced
from ..base.errors import PlacementError


def check_models_placed(models: Iterable[nn.Module], device: torch.device) -> None:
    """Every parameter and buffer of ``models`` on ``device``'s type, else one PlacementError."""
    wrong = [
        f"{name} ({t.device})"
        for model in models
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if t.device.type != device.type
    ]
    if wrong:
        raise PlacementError(
            f"{len(wrong)} tensor(s) not on {device}: {', '.join(wrong[:5])}; "
            "create every submodule before engine.setup(model, ...) so it is moved"
        )


def check_batch_placed(batch: Any, device: torch.device) -> None:
    """Every tensor of ``batch`` on ``device``, else one PlacementError."""
    wrong = misplaced(batch, device)
    if wrong:
        raise PlacementError(
            f"{', '.join(wrong[:5])} not on {device}; pass the loader to engine.setup(...) so batches are moved"
        )
