"""The Llama-style family: the model (:mod:`.model`), its ``[llama]`` settings (:mod:`.settings`)
and its spec (:mod:`.spec`); one line of :mod:`turbotrain.parts.models.registry` makes it
``model.arch = 'llama'``."""

from .model import Llama, LlamaConfig, apply_rotary, rotary_angles
from .settings import LlamaSettings
