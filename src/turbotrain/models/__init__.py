"""Reference models: GPT language model (more to come: classifier, mixture-of-experts)."""

from .gpt import GPT, GPTConfig, clear_mask_cache
from .mlp import TinyMLP

__all__ = ["GPT", "GPTConfig", "TinyMLP", "clear_mask_cache"]
