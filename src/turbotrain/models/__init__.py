"""Reference models: GPT language model (more to come: classifier, mixture-of-experts)."""

from .gpt import GPT, GPTConfig, clear_mask_cache

__all__ = ["GPT", "GPTConfig", "clear_mask_cache"]
