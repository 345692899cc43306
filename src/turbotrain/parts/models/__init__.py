"""Reference models: GPT language model, classifiers, mixture-of-experts GPT."""

from .classifier import CifarResNet, ResNet
from .gpt import GPT, GPTConfig, clear_mask_cache
from .mlp import TinyMLP
from .moe import MoEConfig, MoEGPT

__all__ = ["CifarResNet", "GPT", "GPTConfig", "MoEConfig", "MoEGPT", "ResNet", "TinyMLP", "clear_mask_cache"]
