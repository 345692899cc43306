"""Mixture-of-experts GPT (workload W3): the reference GPT with the routed expert layer
(:class:`~turbotrain.parts.models.moe.layer.MoE`) in every ``moe_every``-th block.

The GPT keeps its MoE blocks' bookkeeping at the top of its own forward (:class:`MoEMLP` is
``managed``): the router-bias update before any block runs and the token counts after, so
activation checkpointing's recompute routes exactly as the forward did; it adds ``aux_loss_coef
x`` the *mean* load-balancing loss over its MoE blocks to the loss it returns while training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..gpt import GPT, GPTConfig
from .layer import MoE
from .settings import MOE_IMPLS


@dataclass(frozen=True)
class MoEConfig(GPTConfig):
    n_experts: int = 8
    top_k: int = 2
    moe_every: int = 1  # block i (0-based) is a MoE block when (i + 1) % moe_every == 0
    expert_hidden: int = 0  # hidden width of each expert's MLP; 0 = 4 x d_model (the dense GPT's)
    aux_loss_coef: float = 0.01
    capacity_factor: float = 0.0  # 0 = dropless
    router_bias_update: float = 0.0  # DeepSeek-V3 gamma; 0 = no bias
    moe_impl: str = "auto"  # see MOE_IMPLS

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k = {self.top_k} must be between 1 and n_experts = {self.n_experts}")
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(
                f"moe_impl = {self.moe_impl!r} is not valid; choose one of: {', '.join(MOE_IMPLS)}"
            )

    @property
    def hidden(self) -> int:
        return self.expert_hidden or 4 * self.d_model


class MoEMLP(MoE):
    """The GPT's MoE block MLP, ``managed`` by :class:`MoEGPT`, ``w2`` scaled as GPT-2's projections."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__(
            cfg.d_model,
            cfg.n_experts,
            cfg.top_k,
            cfg.hidden,
            capacity_factor=cfg.capacity_factor,
            aux_loss_coef=0.0,
            router_bias_update=cfg.router_bias_update,
            impl=cfg.moe_impl,
            out_std=0.02 / math.sqrt(2 * cfg.n_layer),
        )
        self.managed = True


class MoEGPT(GPT):
    """The reference GPT whose every ``moe_every``-th block has a :class:`MoEMLP`."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__(cfg)
        self.cfg: MoEConfig = cfg
        # the same objects for the model's life (wrappers wrap blocks, not these)
        self._moe: list[MoEMLP] = []
        for i, block in enumerate(self.blocks):
            if (i + 1) % cfg.moe_every == 0:
                block.mlp = MoEMLP(cfg)
                self._moe.append(block.mlp)

    def moe_layers(self) -> list[MoEMLP]:
        """The MoE layers, in block order (not walked per forward: read from a list kept at build)."""
        return list(self._moe)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        layers = self.moe_layers()
        rate = self.cfg.router_bias_update
        if self.training and rate > 0:
            for layer in layers:  # the previous step's (or forward's) loads, applied before any block runs
                layer.update_bias(rate)
        out = super().forward(idx, targets, attn_mask)
        if self.training:
            for layer in layers:
                layer.record(rate)
            if targets is not None and self.cfg.aux_loss_coef > 0 and layers:
                aux = torch.stack([layer.last_aux for layer in layers if layer.last_aux is not None]).mean()
                out = out + self.cfg.aux_loss_coef * aux
        return out

    def _with_experts(self, experts: int, non_embedding: bool) -> int:
        """The parameter count with ``experts`` experts per MoE block in place of this rank's."""
        layers = self.moe_layers()
        local = sum(layer.w1.numel() + layer.w2.numel() for layer in layers)  # this rank's experts
        per_expert = sum(layer.w1[0].numel() + layer.w2[0].numel() for layer in layers)
        return self.num_params(non_embedding) - local + experts * per_expert

    def num_active_params(self, non_embedding: bool = True) -> int:
        """Parameters one token meets: all but the experts it is not routed to."""
        return self._with_experts(self.cfg.top_k, non_embedding)

    def num_total_params(self, non_embedding: bool = True) -> int:
        """Every expert counted, also those other ranks hold under expert parallelism."""
        return self._with_experts(self.cfg.n_experts, non_embedding)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token on *active* parameters: 6 N_active + 12 L H Q T."""
        return super().flops_per_token(seq_len) - 6 * (self.num_params() - self.num_active_params())
