"""A Llama-style decoder: RMSNorm, a SwiGLU MLP, rotary positions, grouped-query attention through
SDPA (``n_kv_head`` key/value heads), no biases, the output layer tied or not (``tie_embeddings``).
The rotary angles are computed per forward in fp32: nothing position-dependent is checkpointed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..gpt.model import DecoderLM, SDPAttention


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2  # key/value heads; n_head must be a multiple
    d_model: int = 128
    ffn_hidden: int = 384  # SwiGLU hidden width
    block_size: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dropout: float = 0.0
    attention: str = "sdpa"  # "sdpa" (is_causal) | "masked" (the GPT's cached additive mask)
    loss: str = "full"  # as the GPT's: "full" | "chunked" | "fused"
    sdpa_backend: str = "auto"


def rotary_angles(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of shape (seq_len, head_dim / 2), fp32: position t turns channel pair i by
    t x theta^(-2i / head_dim)."""
    inv = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, heads, T, head_dim) pairwise by its positions' angles, in fp32."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(SDPAttention):
    """Grouped-query causal self-attention with rotary positions."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(cfg)
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.q = nn.Linear(cfg.d_model, cfg.n_head * self.head_dim, bias=False)
        self.kv = nn.Linear(cfg.d_model, 2 * cfg.n_kv_head * self.head_dim, bias=False)
        self.proj = nn.Linear(cfg.n_head * self.head_dim, cfg.d_model, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(B, T, 2, self.n_kv_head, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # SDPA shares each key/value head among its query heads
        y = self.attend(q, k, v, attn_mask, gqa=self.n_kv_head != self.n_head)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, gate and up in one matmul."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin, attn_mask))
        return x + self.drop(self.mlp(self.mlp_norm(x)))


class Llama(DecoderLM):
    """``model(idx)`` -> logits (B, T, vocab); ``model(idx, targets)`` -> mean cross-entropy loss."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(cfg)
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():  # N(0, 0.02), residual projections scaled by depth
            if p.dim() == 2:
                deep = name.endswith(("proj.weight", "down.weight"))
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer) if deep else 0.02)

    def hidden(self, idx: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        cfg = self.cfg
        cos, sin = rotary_angles(idx.shape[1], cfg.d_model // cfg.n_head, cfg.rope_theta, idx.device)
        x = self.drop(self.wte(idx))
        for block in self.blocks:
            x = block(x, cos, sin, attn_mask)
        return self.norm(x)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; ``non_embedding``: without the input embedding unless it is the output
        layer too (a lookup costs no matmul FLOPs)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() if non_embedding and not self.cfg.tie_embeddings else n
