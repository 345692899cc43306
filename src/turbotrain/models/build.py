"""Model construction from a name or a run's config: the one place that maps either to a class."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config import ModelConfig
from ..errors import ConfigError
from .classifier import CifarResNet, ResNet
from .gpt import GPT, GPTConfig
from .mlp import TinyMLP
from .moe import MoEConfig, MoEGPT

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


def gpt_config(m: ModelConfig, vocab_size: int) -> GPTConfig:
    """The GPT a run's ``model`` section describes; ``vocab_size`` when the section leaves it 0."""
    return GPTConfig(
        vocab_size=m.vocab_size or vocab_size, n_layer=m.n_layer, n_head=m.n_head, d_model=m.d_model,
        block_size=m.block_size, dropout=m.dropout, attention=m.attention, loss=m.loss, sdpa_backend=m.sdpa_backend,
    )


def moe_config(m: ModelConfig, vocab_size: int) -> MoEConfig:
    """The mixture-of-experts GPT a run's ``model`` section describes (``arch = 'moe'``)."""
    return MoEConfig(
        **vars(gpt_config(m, vocab_size)), n_experts=m.n_experts, top_k=m.top_k, moe_every=m.moe_every,
        expert_hidden=m.expert_hidden, aux_loss_coef=m.aux_loss_coef, capacity_factor=m.capacity_factor,
        router_bias_update=m.router_bias_update, moe_impl=m.moe_impl,
    )


def build_model(m: ModelConfig, vocab_size: int) -> GPT:
    """The run's model from its ``model`` section (``config.model``): a GPT, or for ``arch = 'moe'``
    a :class:`MoEGPT` (a GPT subclass)."""
    if m.arch == "moe":
        return MoEGPT(moe_config(m, vocab_size))
    return GPT(gpt_config(m, vocab_size))
