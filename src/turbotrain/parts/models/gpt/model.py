"""Reference GPT: a pre-LayerNorm decoder with tied embeddings and SDPA attention. ``sdpa``
(``is_causal``: flash kernels, no T x T mask) and ``masked`` (an explicit additive mask, what
padded or custom masks need, cached per (length, device, dtype)) compute the same thing."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ....base.errors import ConfigError
from ..loss import FUSED_AVAILABLE, FUSED_MISSING, lm_loss

PRESETS: dict[str, dict[str, int]] = {
    "gpt-tiny": dict(n_layer=4, n_head=4, d_model=128, block_size=128),
    "gpt2-small": dict(n_layer=12, n_head=12, d_model=768, block_size=1024),
    "gpt2-medium": dict(n_layer=24, n_head=16, d_model=1024, block_size=1024),
}


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    block_size: int = 128
    dropout: float = 0.0
    attention: str = "sdpa"  # "sdpa" | "masked"
    loss: str = "full"  # "full" | "chunked" | "fused" (models/loss.py)
    sdpa_backend: str = "auto"  # "auto" (PyTorch's choice) or the SDPA kernel to prefer, with fallback


_MASKS: dict[tuple[int, torch.device, torch.dtype], torch.Tensor] = {}


def causal_mask(length: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Additive (length, length) mask in ``dtype``: 0 where attention is allowed, -inf above the
    diagonal. Cached per (length, device, dtype): SDPA adds it in the query's dtype."""
    key = (length, torch.device(device), dtype)
    mask = _MASKS.get(key)
    if mask is None:
        mask = torch.full((length, length), float("-inf"), dtype=dtype, device=device).triu_(1)
        _MASKS[key] = mask
    return mask


def clear_mask_cache() -> None:
    """Drop every cached mask (for example before measuring memory)."""
    _MASKS.clear()


def mask_cache_size() -> int:
    return len(_MASKS)


_BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def sdpa_preference(backend: str) -> Callable[[], ContextManager[Any]]:
    """A context factory that makes SDPA try ``backend`` first, then the others in PyTorch's order
    (so shapes or devices it does not support still run); 'auto' leaves PyTorch's choice alone.
    On an H100 cuDNN attention can beat FlashAttention-2: benchmarks/sdpa_probe.py measures it."""
    if backend == "auto":
        return contextlib.nullcontext
    order = [_BACKENDS[backend], *(b for name, b in _BACKENDS.items() if name != backend)]
    return functools.partial(sdpa_kernel, order, set_priority=True)


class SDPAttention(nn.Module):
    """The causal SDPA call both decoders' attentions share: ``is_causal`` (flash kernels), or the
    cached additive mask with ``attention = 'masked'`` or a mask given."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.dropout = cfg.dropout
        self.masked = cfg.attention == "masked"
        self.sdpa_context = sdpa_preference(cfg.sdpa_backend)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        gqa: bool = False,
    ) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if attn_mask is None and self.masked:
            attn_mask = causal_mask(q.shape[2], q.device, q.dtype)
        with self.sdpa_context():
            if attn_mask is None:
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=gqa)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p, enable_gqa=gqa)


class CausalSelfAttention(SDPAttention):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        return self.proj(self.attend(q, k, v, attn_mask).transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), attn_mask))
        return x + self.drop(self.mlp(self.ln2(x)))


class DecoderLM(nn.Module):
    """What the GPT, the MoE GPT and the Llama share: the sequence-length check, ``lm_head`` and
    its loss (``cfg.loss``), FLOPs per token and sampling. A subclass builds ``wte`` and
    ``lm_head`` and gives :meth:`hidden` and :meth:`num_params`.
    ``model(idx)`` -> logits (B, T, vocab); ``model(idx, targets)`` -> mean cross-entropy loss."""

    cfg: Any
    wte: nn.Embedding  # built by the subclass
    lm_head: nn.Linear

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        if cfg.loss == "fused" and not FUSED_AVAILABLE:
            raise ConfigError(FUSED_MISSING)
        self.cfg = cfg

    def hidden(self, idx: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        """The final (normalised) hidden states (B, T, d_model) of tokens ``idx`` (B, T)."""
        raise NotImplementedError

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; ``non_embedding``: only those that take part in matmuls."""
        raise NotImplementedError

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds model.block_size = {self.cfg.block_size}")
        x = self.hidden(idx, attn_mask)
        if targets is None:
            return self.lm_head(x)
        return lm_loss(x, self.lm_head, targets, self.cfg.loss)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), PaLM convention: 6N + 12 L H Q T (the
        attention's score and value matmuls run over all query heads)."""
        cfg = self.cfg
        T = seq_len or cfg.block_size
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_head * (cfg.d_model // cfg.n_head) * T

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8, top_k: int | None = 40
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` continuations of ``idx`` (B, T)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.block_size :])[:, -1, :].float() / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


class GPT(DecoderLM):
    """A pre-LayerNorm GPT-2 decoder with learned positions and tied embeddings."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def hidden(self, idx: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x, attn_mask)
        return self.ln_f(x)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; without position embeddings by default (they cost no matmul FLOPs)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n
