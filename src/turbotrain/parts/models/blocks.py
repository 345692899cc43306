"""Finding a model's stack of repeated blocks, the unit that per-block transforms act on
(``compile.scope = 'blocks'``, activation checkpointing)."""

from __future__ import annotations

import weakref

from torch import nn

_DECLARED: weakref.WeakKeyDictionary[nn.Module, nn.ModuleList] = weakref.WeakKeyDictionary()


def declare_blocks(model: nn.Module, blocks: nn.ModuleList | None) -> None:
    """Say which ModuleList of ``model`` holds its repeated blocks (a model spec's answer, see
    :meth:`turbotrain.parts.models.spec.ModelSpec.blocks`): FSDP, activation checkpointing and
    ``compile.scope = 'blocks'`` then act on them instead of the ones found by size. None: find them."""
    if blocks is None:
        _DECLARED.pop(model, None)
    else:
        _DECLARED[model] = blocks


def repeated_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The blocks declared for ``model``, else its ``blocks`` ModuleList, else its longest; None: none."""
    if model in _DECLARED:
        return _DECLARED[model]
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len) if lists else None
