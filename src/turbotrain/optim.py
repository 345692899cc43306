"""AdamW with the right implementation for the device, and warmup + decay schedules."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from .config import OPTIM_IMPLEMENTATIONS, SCHEDULES, OptimConfig, choice_error


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices decay; norms, biases and embeddings (incl. tied heads) do not."""
    no_decay: set[int] = set()
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.RMSNorm)):
            no_decay.update(id(p) for p in module.parameters(recurse=False))
    decay, rest = [], []
    for p in model.parameters():  # parameters() deduplicates tied weights
        if not p.requires_grad:
            continue
        (rest if p.ndim < 2 or id(p) in no_decay else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def resolve_implementation(implementation: str, device: torch.device) -> str:
    """'auto' -> 'fused' on CUDA (one kernel for all parameters, skips on-device on non-finite
    gradients), 'foreach' elsewhere (batched multi-tensor ops)."""
    if implementation == "auto":
        return "fused" if device.type == "cuda" else "foreach"
    if implementation not in OPTIM_IMPLEMENTATIONS:
        raise choice_error("optim.implementation", implementation, ("auto", *OPTIM_IMPLEMENTATIONS))
    return implementation


def build_optimizer(
    model: nn.Module,
    device: torch.device,
    *,
    lr: float,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    implementation: str = "auto",
) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters with decay groups and the device's fastest kernel."""
    impl = resolve_implementation(implementation, device)
    flags = {"fused": impl == "fused", "foreach": impl == "foreach"}
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, **flags)


def optimizer_from_config(model: nn.Module, device: torch.device, c: OptimConfig) -> torch.optim.AdamW:
    """:func:`build_optimizer` with the run's ``optim`` section (lr, decay, betas, eps, kernel)."""
    return build_optimizer(model, device, lr=c.lr, weight_decay=c.weight_decay, betas=(c.beta1, c.beta2), eps=c.eps,
                           implementation=c.implementation)


def lr_lambda(schedule: str, warmup_steps: int, max_steps: int, min_ratio: float) -> Callable[[int], float]:
    """Multiplier of the peak LR at optimizer step ``s``: linear warmup, then the decay to
    ``min_ratio`` x peak at ``max_steps`` (cosine or linear), or flat (constant)."""
    if schedule not in SCHEDULES:
        raise choice_error("optim.schedule", schedule, SCHEDULES)

    def factor(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (s - warmup_steps) / max(1, max_steps - warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
        return min_ratio + (1.0 - min_ratio) * shape

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, *, schedule: str, warmup_steps: int, max_steps: int, lr: float, min_lr: float
) -> torch.optim.lr_scheduler.LambdaLR:
    ratio = min_lr / lr if lr > 0 else 0.0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(schedule, warmup_steps, max_steps, ratio))
