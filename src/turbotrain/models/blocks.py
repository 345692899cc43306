"""Finding a model's stack of repeated blocks, the unit that per-block transforms act on
(``compile.scope = 'blocks'``, activation checkpointing)."""

from __future__ import annotations

from torch import nn


def repeated_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The model's ``blocks`` ModuleList, or else its longest ModuleList; None when it has none."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len) if lists else None
