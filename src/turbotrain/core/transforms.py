"""Build-time model transforms, applied once by ``Engine.setup`` (after torchtitan's ``apply_*``):
activation checkpointing per block (``full``: every repeated block, about one extra forward;
``selective``: every other one, half the savings for half the recompute), then ``torch.compile``.
A checkpointed block keeps its parameters, state_dict keys and hooks; under no_grad it runs plainly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ContextManager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..base.config import CHECKPOINTING_MODES, COMPILE_SCOPES, choice_error, setting
from ..base.errors import ConfigError
from ..parts.models.blocks import repeated_blocks

_RECOMPUTE: list[Callable[[], ContextManager[Any]]] = []  # see recompute_context


@contextlib.contextmanager
def recompute_context(factory: Callable[[], ContextManager[Any]]) -> Iterator[None]:
    """Run checkpointed blocks' recomputation inside ``factory()`` too (memory estimates' modes)."""
    _RECOMPUTE.append(factory)
    try:
        yield
    finally:
        _RECOMPUTE.pop()


def _context_fn() -> tuple[ContextManager[Any], ContextManager[Any]]:
    return contextlib.nullcontext(), _RECOMPUTE[-1]()


class CheckpointedBlock:
    """Mixin put in front of a block's own class: forward under non-reentrant checkpointing."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return super().forward(*args, **kwargs)  # type: ignore[misc]
        # the default context keeps torch.compile happy
        extra: dict[str, Any] = {"context_fn": _context_fn} if _RECOMPUTE else {}
        return checkpoint(super().forward, *args, use_reentrant=False, **extra, **kwargs)  # type: ignore[misc]


_CLASSES: dict[type, type] = {}


def block_list(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks (see :func:`repeated_blocks`), or a ConfigError saying how to fix it."""
    blocks = repeated_blocks(model)
    if blocks is None:
        raise ConfigError(
            f"memory.checkpointing needs a model with a ModuleList of repeated blocks; {type(model).__name__} has none "
            f"(use {setting('memory.checkpointing', 'off')}, or wrap your blocks in an nn.ModuleList named 'blocks')"
        )
    return blocks


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """Checkpoint ``model``'s blocks in place (before ``torch.compile``); returns ``model``."""
    if mode not in CHECKPOINTING_MODES:
        raise choice_error("memory.checkpointing", mode, CHECKPOINTING_MODES)
    if mode == "off":
        return model
    for i, block in enumerate(block_list(model)):
        if mode == "selective" and i % 2:
            continue
        if not isinstance(block, CheckpointedBlock):
            cls = type(block)
            if cls not in _CLASSES:
                _CLASSES[cls] = type(
                    f"Checkpointed{cls.__name__}", (CheckpointedBlock, cls), {"__doc__": cls.__doc__}
                )
            block.__class__ = _CLASSES[cls]
    return model


def checkpointed_blocks(model: nn.Module) -> list[int]:
    """Indices of the blocks that run under activation checkpointing (empty when off)."""
    try:
        blocks = block_list(model)
    except ConfigError:
        return []
    return [i for i, b in enumerate(blocks) if isinstance(b, CheckpointedBlock)]


def resolve_scope(scope: str, device: torch.device) -> str:
    """'auto' -> 'model' on CUDA; 'off' on CPU, where compiling a small GPT costs ~40 s for ~6%."""
    if scope == "auto":
        return "model" if device.type == "cuda" else "off"
    if scope not in COMPILE_SCOPES:
        raise choice_error("compile.scope", scope, ("auto", *COMPILE_SCOPES))
    return scope


def apply_compile(model: nn.Module, scope: str, mode: str = "default") -> nn.Module:
    """Compile ``model`` in place (state_dict keys unchanged), or each repeated block ('blocks')."""
    if scope == "off":
        return model
    options = {"mode": None if mode == "default" else mode}
    if scope == "model":
        model.compile(**options)
    else:
        blocks = repeated_blocks(model)
        if blocks is None:
            raise ConfigError(
                f"compile.scope = 'blocks' needs a model with a ModuleList of blocks; use {setting('compile.scope', 'model')}"
            )
        for block in blocks:
            block.compile(**options)
    return model


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Inside the block compiled modules run eagerly (graphs stay cached): for work whose shapes
    training never sees (evaluation, the batch search's trials)."""
    with torch.compiler.set_stance("force_eager"):  # torch >= 2.6
        yield
