"""The GPT family's settings: its fields of ``[model]`` (a ``GPTSettings``, which :func:`gpt_settings`
hands out typed), their valid values and the rules that span them; the mixture-of-experts and
Llama families use the same backbone. ``tune`` asks :func:`speed_choices` which it may search."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ....base.config import ModelConfig, RunConfig, knob, register_settings, setting
from ....base.errors import ConfigError

ATTENTIONS = ("sdpa", "masked")
LM_LOSSES = ("full", "chunked", "fused")
SDPA_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")


@dataclass(frozen=True)
class GPTSettings(ModelConfig):
    """``[model]`` of a GPT (``model.arch = 'gpt'``, and the mixture-of-experts GPT's backbone)."""

    n_layer: int = knob(4, "transformer blocks", min=1, max=1024)
    n_head: int = knob(4, "attention heads per block", min=1, max=1024)
    d_model: int = knob(128, "embedding width (must divide by n_head)", min=1, max=65536)
    block_size: int = knob(128, "sequence length T in tokens", min=2, max=2**20)
    vocab_size: int = knob(
        0,
        "vocabulary size; 0 = follow the data (256 for bytes, 50304 for bpe, a tokenizer.json's "
        "rounded up to a multiple of 64, the .bin's own or 50304)",
        min=0,
        max=2**24,
    )
    dropout: float = knob(0.0, "dropout probability", min=0.0, below=1.0)
    attention: str = knob(
        "sdpa", "'sdpa' (is_causal, flash kernels) or 'masked' (explicit cached mask)", choices=ATTENTIONS
    )
    loss: str = knob(
        "full",
        "'full' (logits, then cross-entropy), 'chunked' (fused linear + cross-entropy by chunks: "
        "no full logits in memory, same math) or 'fused' (torch's linear_cross_entropy, torch >= 2.13: the same)",
        choices=LM_LOSSES,
    )
    sdpa_backend: str = knob(
        "auto",
        "SDPA kernel to prefer (falling back to the others): 'auto' = PyTorch's choice, "
        "'cudnn', 'flash', 'efficient' or 'math'",
        choices=SDPA_BACKENDS,
    )


def gpt_settings(config: RunConfig) -> GPTSettings:
    """The run's GPT settings (``config.model`` of a run whose family has the GPT backbone), typed."""
    m = config.model
    if not isinstance(m, GPTSettings):
        raise ConfigError(f"model.arch = {m.arch!r} has no GPT settings (n_layer, block_size, ...)")
    return m


def check_gpt(config: RunConfig) -> None:
    """The rules that span the GPT's fields (and the token batching its data offers)."""
    m = gpt_settings(config)
    if m.d_model % m.n_head:
        raise ConfigError(f"model.d_model = {m.d_model} must be divisible by model.n_head = {m.n_head}")
    if config.data.batching != "tokens":
        return
    if m.loss == "chunked":
        raise ConfigError(
            "data.batching = 'tokens' pads targets with -100, which model.loss = 'chunked' does not skip; "
            f"use {setting('model.loss', 'full')}"
        )
    if 0 < config.batch.max_tokens < m.block_size:
        raise ConfigError(
            f"batch.max_tokens = {config.batch.max_tokens} must hold one row of model.block_size = "
            f"{m.block_size} tokens; e.g. {setting('batch.max_tokens', 32 * m.block_size)}"
        )


def speed_choices(cuda: bool) -> dict[str, tuple[str, ...]]:
    """The GPT settings that change speed and not the math, with the values ``tune`` may try: the
    attention and loss implementations, and on CUDA the SDPA kernel (the CPU has one; "math" is
    never the fastest on a GPU)."""
    choices = {"model.attention": ATTENTIONS, "model.loss": LM_LOSSES}
    if cuda:
        choices["model.sdpa_backend"] = tuple(b for b in SDPA_BACKENDS if b != "math")
    return choices


def unused_family(config: RunConfig, given: Sequence[str], arch: str, workload_fix: str = "") -> str:
    """A family's own settings given (``--<arch>.*`` flags, an override dict) for a run of another
    family would do nothing: one line (files are not held to this: there the section is unused)."""
    m = config.model
    if m.arch == arch and not m.workload:
        return ""
    fix = workload_fix if m.workload and workload_fix else f"use {setting('model.arch', arch)}"
    return (
        f"{', '.join(f'{arch}.{k}' for k in given)} configure model.arch = {arch!r} and this run is "
        f"{'your model (model.workload)' if m.workload else f'model.arch = {m.arch!r}'}: they would do "
        f"nothing; drop them, or {fix}"
    )


register_settings("model", GPTSettings, when="model.arch=gpt", check=check_gpt)
