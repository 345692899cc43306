"""Reference models by name (the bench's workloads): the one place that maps a name to a class. A run's
config is mapped to its family by :mod:`.registry`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ...base.errors import ConfigError
from .classifier import CifarResNet, ResNet
from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig
from .mlp import TinyMLP
from .moe import MoEConfig, MoEGPT

_BUILDERS: dict[str, Callable[[dict[str, Any]], nn.Module]] = {
    "gpt": lambda kw: GPT(GPTConfig(**kw)),
    "moe": lambda kw: MoEGPT(MoEConfig(**kw)),
    "llama": lambda kw: Llama(LlamaConfig(**kw)),
    "mlp": lambda kw: TinyMLP(**kw),
    "resnet": lambda kw: ResNet(**{**kw, "layers": tuple(kw.get("layers", (2, 2, 2, 2)))}),
    "cifar": lambda kw: CifarResNet(**kw),
}
KINDS = tuple(_BUILDERS)


def build_named(kind: str, kwargs: dict[str, Any]) -> nn.Module:
    """The reference model ``kind`` with ``kwargs`` (in the caller's current RNG state)."""
    if kind not in _BUILDERS:
        raise ConfigError(f"unknown model kind {kind!r}; choose one of: {', '.join(KINDS)}")
    return _BUILDERS[kind](kwargs)
