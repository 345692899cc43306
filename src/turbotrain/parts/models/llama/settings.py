"""The Llama family's own ``[llama]`` settings (grouped-query heads, the SwiGLU width, the rotary
base, RMSNorm's epsilon, tied embeddings); depth, width, heads, sequence length, vocabulary,
attention and loss are ``[model]``'s, as for the GPT. Read when ``model.arch = 'llama'``."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ....base.config import RunConfig, knob, register_settings, setting
from ....base.errors import ConfigError
from ..gpt.settings import GPTSettings, check_gpt, gpt_settings, unused_family


@dataclass(frozen=True)
class LlamaSettings:
    """``model.arch = 'llama'``'s own settings."""

    n_kv_head: int = knob(
        0,
        "key/value heads (grouped-query attention; must divide model.n_head); 0 = model.n_head",
        min=0,
        max=1024,
    )
    ffn_hidden: int = knob(
        0, "SwiGLU hidden width; 0 = 8/3 x model.d_model rounded up to a multiple of 64", min=0, max=2**20
    )
    rope_theta: float = knob(10000.0, "rotary positions' base", min=1.0, max=1e12)
    norm_eps: float = knob(1e-5, "RMSNorm epsilon", min=0.0, below=1.0)
    tie_embeddings: bool = knob(True, "the output layer shares the token embedding's weights")


def kv_heads(config: RunConfig) -> int:
    """The key/value heads of the run's Llama."""
    return config.table(LlamaSettings).n_kv_head or gpt_settings(config).n_head


def ffn_width(config: RunConfig) -> int:
    """The SwiGLU hidden width of the run's Llama."""
    return config.table(LlamaSettings).ffn_hidden or -(-8 * gpt_settings(config).d_model // 3 // 64) * 64


def check_llama(config: RunConfig) -> None:
    """The rules that span ``[llama]`` and ``[model]`` (for the family that uses them)."""
    m = gpt_settings(config)
    if m.workload:
        return
    kv = kv_heads(config)
    if m.n_head % kv:
        raise ConfigError(
            f"llama.n_kv_head = {kv} must divide model.n_head = {m.n_head} (each key/value head serves "
            f"n_head / n_kv_head query heads), e.g. {setting('llama.n_kv_head', 1)}"
        )
    if m.d_model % m.n_head == 0 and (m.d_model // m.n_head) % 2:
        raise ConfigError(
            f"model.d_model / model.n_head = {m.d_model // m.n_head} must be even: rotary positions turn "
            f"channel pairs, e.g. {setting('model.n_head', m.n_head * 2 if m.d_model % (m.n_head * 2) == 0 else 1)}"
        )


register_settings("model", GPTSettings, when="model.arch=llama", check=check_gpt)  # the GPT's [model]
register_settings(
    "llama",
    LlamaSettings,
    when="model.arch=llama",
    after="moe",
    check=check_llama,
    unused=functools.partial(unused_family, arch="llama"),
    model_shape=True,
)
