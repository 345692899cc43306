"""Reference models: GPT language model, classifiers, mixture-of-experts GPT; the model families a
run's ``model.arch`` names are registered on import (:mod:`.registry`)."""

from .classifier import CifarResNet, ResNet
from .gpt import GPT, GPTConfig, clear_mask_cache
from .mlp import TinyMLP
from .moe import MoEConfig, MoEGPT
from .registry import FAMILIES, register_family, spec_for
