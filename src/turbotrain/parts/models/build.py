"""Model construction from a name or a run's config: the one place that maps either to a class."""

from __future__ import annotations

from typing import Any

from torch import nn

from ...base.config import ModelConfig
from ...base.errors import ConfigError
from .classifier import CifarResNet, ResNet
from .gpt import GPT, GPTConfig
from .gpt.spec import GPTSpec
from .mlp import TinyMLP
from .moe import MoEConfig, MoEGPT
from .moe.spec import MoESpec

KINDS = ("gpt", "moe", "mlp", "resnet", "cifar")


def build_named(kind: str, kwargs: dict[str, Any]) -> nn.Module:
    """The reference model ``kind`` with ``kwargs`` (in the caller's current RNG state)."""
    if kind == "gpt":
        return GPT(GPTConfig(**kwargs))
    if kind == "moe":
        return MoEGPT(MoEConfig(**kwargs))
    if kind == "mlp":
        return TinyMLP(**kwargs)
    if kind == "resnet":
        return ResNet(**{**kwargs, "layers": tuple(kwargs.get("layers", (2, 2, 2, 2)))})
    if kind == "cifar":
        return CifarResNet(**kwargs)
    raise ConfigError(f"unknown model kind {kind!r}; choose one of: {', '.join(KINDS)}")


def build_model(m: ModelConfig, vocab_size: int) -> GPT:
    """The run's language model from its ``model`` section alone (``sample`` and ``memory`` build it
    without data): its family's spec builds it (a GPT, or for ``arch = 'moe'`` a :class:`MoEGPT`)."""
    return (MoESpec() if m.arch == "moe" else GPTSpec()).build_model(m, vocab_size)
