"""Model construction from a name or a run's config: the one place that maps either to a class."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError
from .classifier import CifarResNet, ResNet
from .gpt import GPT, GPTConfig
from .mlp import TinyMLP

KINDS = ("gpt", "mlp", "resnet", "cifar")


def build_named(kind: str, kwargs: dict[str, Any]) -> nn.Module:
    """The reference model ``kind`` with ``kwargs`` (in the caller's current RNG state)."""
    if kind == "gpt":
        return GPT(GPTConfig(**kwargs))
    if kind == "mlp":
        return TinyMLP(**kwargs)
    if kind == "resnet":
        return ResNet(**{**kwargs, "layers": tuple(kwargs.get("layers", (2, 2, 2, 2)))})
    if kind == "cifar":
        return CifarResNet(**kwargs)
    raise ConfigError(f"unknown model kind {kind!r}; choose one of: {', '.join(KINDS)}")


def gpt_config(m: ModelConfig, vocab_size: int) -> GPTConfig:
    """The GPT a run's ``model`` section describes; ``vocab_size`` when the section leaves it 0."""
    return GPTConfig(
        vocab_size=m.vocab_size or vocab_size, n_layer=m.n_layer, n_head=m.n_head, d_model=m.d_model,
        block_size=m.block_size, dropout=m.dropout, attention=m.attention, loss=m.loss, sdpa_backend=m.sdpa_backend,
    )


def build_model(m: ModelConfig, vocab_size: int) -> GPT:
    """The run's model from its ``model`` section (``config.model``)."""
    return GPT(gpt_config(m, vocab_size))
