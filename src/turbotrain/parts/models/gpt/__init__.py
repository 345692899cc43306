"""The GPT family: the decoder-only transformer (:mod:`.model`), its settings (:mod:`.settings`)
and its spec (:mod:`.spec`)."""

from .model import GPT, Block, CausalSelfAttention, GPTConfig, causal_mask, clear_mask_cache, mask_cache_size
from .settings import GPTSettings
