"""Reference models: GPT language model (more to come: classifier, mixture-of-experts)."""

from .classifier import CifarResNet, ResNet
from .gpt import GPT, GPTConfig, clear_mask_cache
from .mlp import TinyMLP

__all__ = ["CifarResNet", "GPT", "GPTConfig", "ResNet", "TinyMLP", "clear_mask_cache"]
