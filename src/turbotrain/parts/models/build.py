"""Reference models by name (the bench's workloads): the one place that maps a name to a class. A run's
config is mapped to its family by :mod:`.registry`."""

from __future__ import annotations

from typing import Any

from torch import nn

from ...base.errors import ConfigError
from .classifier import CifarResNet, ResNet
from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig
from .mlp import TinyMLP
from .moe import MoEConfig, MoEGPT

KINDS = ("gpt", "moe", "llama", "mlp", "resnet", "cifar")


def build_named(kind: str, kwargs: dict[str, Any]) -> nn.Module:
    """The reference model ``kind`` with ``kwargs`` (in the caller's current RNG state)."""
    if kind == "gpt":
        return GPT(GPTConfig(**kwargs))
    if kind == "moe":
        return MoEGPT(MoEConfig(**kwargs))
    if kind == "llama":
        return Llama(LlamaConfig(**kwargs))
    if kind == "mlp":
        return TinyMLP(**kwargs)
    if kind == "resnet":
        return ResNet(**{**kwargs, "layers": tuple(kwargs.get("layers", (2, 2, 2, 2)))})
    if kind == "cifar":
        return CifarResNet(**kwargs)
    raise ConfigError(f"unknown model kind {kind!r}; choose one of: {', '.join(KINDS)}")
