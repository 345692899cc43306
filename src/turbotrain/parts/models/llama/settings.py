"""The Llama family's own settings: its ``[llama]`` section (grouped-query heads, the SwiGLU width,
the rotary base, RMSNorm's epsilon, tied embeddings). Depth, width, heads, sequence length,
vocabulary, attention and loss are ``[model]``'s, as for the GPT
(:mod:`turbotrain.parts.models.gpt.settings`).

Registered on import (:func:`turbotrain.base.config.register_settings`): ``[llama]`` is read when
``model.arch = 'llama'`` (``config.table(LlamaSettings)``), and ``[model]`` as the GPT's settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ....base.config import RunConfig, knob, register_settings, setting
from ....base.errors import ConfigError
from ..gpt.settings import GPTSettings, check_gpt, gpt_settings


@dataclass(frozen=True)
class LlamaSettings:
    """``model.arch = 'llama'``'s own settings (a ``--llama.*`` flag given for another family is refused)."""

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


def unused_llama(config: RunConfig, given: Sequence[str]) -> str:
    """``--llama.*`` settings for a run of another family would do nothing: one line."""
    m = config.model
    if m.arch == "llama" and not m.workload:
        return ""
    return (
        f"{', '.join(f'llama.{k}' for k in given)} configure model.arch = 'llama' and this run is "
        f"{'your model (model.workload)' if m.workload else f'model.arch = {m.arch!r}'}: they would do "
        f"nothing; drop them, or use {setting('model.arch', 'llama')}"
    )


register_settings("model", GPTSettings, when="model.arch=llama", check=check_gpt)  # the GPT's [model]
register_settings(
    "llama",
    LlamaSettings,
    when="model.arch=llama",
    after="moe",
    check=check_llama,
    unused=unused_llama,
    model_shape=True,
)
