"""The Llama family's spec: the GPT's token data, sequence length, vocabulary, sampling and speed
choices (:class:`~turbotrain.parts.models.gpt.spec.GPTSpec`), a :class:`Llama` from ``[model]`` and
``[llama]``."""

from __future__ import annotations

from typing import Any

from torch import nn

from ....base.config import RunConfig
from ..gpt.settings import gpt_settings
from ..gpt.spec import GPTSpec, gpt_config
from .model import Llama, LlamaConfig
from .settings import LlamaSettings, ffn_width, kv_heads


def llama_config(c: RunConfig, vocab_size: int) -> LlamaConfig:
    """The Llama of a run's ``[model]`` and ``[llama]`` sections; ``vocab_size`` when ``[model]`` leaves it 0."""
    own = c.table(LlamaSettings)
    return LlamaConfig(
        **vars(gpt_config(gpt_settings(c), vocab_size)),  # the backbone's fields, as the GPT reads them
        n_kv_head=kv_heads(c),
        ffn_hidden=ffn_width(c),
        rope_theta=own.rope_theta,
        norm_eps=own.norm_eps,
        tie_embeddings=own.tie_embeddings,
    )


class LlamaSpec(GPTSpec):
    """A Llama-style decoder on the GPT's token data."""

    name = "llama"

    def build_model(self, c: RunConfig, vocab_size: int) -> Llama:  # type: ignore[override]
        return Llama(llama_config(c, vocab_size))

    def facts(self, c: RunConfig, model: nn.Module) -> dict[str, Any]:
        assert isinstance(model, Llama)
        cfg = model.cfg
        return {
            "attention": f"sdpa {'is_causal' if cfg.attention == 'sdpa' else '+ cached mask'}, "
            f"{cfg.n_head} query / {cfg.n_kv_head} key-value heads, rotary",
            "vocab_size": cfg.vocab_size,
            "tied_embeddings": cfg.tie_embeddings,
            "params": model.num_params(non_embedding=False),
        }

    def weight_count(self, c: RunConfig) -> int:
        """Embeddings of at least 256 tokens (twice untied), attention and SwiGLU MLPs."""
        m = gpt_settings(c)
        d, vocab, head = m.d_model, max(m.vocab_size, 256), m.d_model // m.n_head
        embeddings = vocab * d * (1 if c.table(LlamaSettings).tie_embeddings else 2)
        attention = 2 * d * d + 2 * d * kv_heads(c) * head
        return embeddings + m.n_layer * (attention + 3 * d * ffn_width(c))
