"""What every contender process shares, so all figures mean the same thing: the measuring kit's
StepClock, :func:`init_digest` (the same start), the recipe in plain PyTorch and :class:`Job`."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ...base.batch import move_to
from ...core.engine import as_loss, default_loss
from ...core.meter.clock import StepClock
from ...parts.hardware import precision_key, tf32_enabled
from ...parts.models.moe import MoE, moe_layers


def init_digest(model: nn.Module) -> str:
    """SHA-256 over the state dict's names and raw bytes (first 16 hex digits)."""
    h = hashlib.sha256()
    for name, value in model.state_dict().items():
        h.update(name.encode())
        h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def recipe_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups of the recipe: weight decay on matrices and convolution kernels, none on
    biases, norms and embeddings (tied heads included) - the same split as turbotrain's."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay: list[nn.Parameter] = []
    rest: list[nn.Parameter] = []
    for p in model.parameters():
        (decay if p.ndim >= 2 and id(p) not in embeddings else rest).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def warmup_factor(warmup_steps: int) -> Callable[[int], float]:
    """LR multiplier at step ``s``: linear warmup over ``warmup_steps``, then constant."""
    return lambda s: min(1.0, (s + 1) / max(1, warmup_steps))


class BatchList(Dataset):
    """Item ``i`` is the whole batch ``i mod pool`` (any structure: a tuple of inputs and targets
    for the built-in workloads, whatever your loader yields for ``--model``): a DataLoader with
    ``batch_size=None`` yields the same batches in the same order to every contender."""

    def __init__(self, batches: list[Any], length: int) -> None:
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        return self.batches[i % len(self.batches)]


def load_batches(spec: dict[str, Any], device: torch.device) -> BatchList:
    """The spec's batches; moved to ``device`` first when the workload keeps its data resident."""
    data = torch.load(spec["data_file"], weights_only=True)
    batches = data["batches"] if "batches" in data else [(x, y) for x, y in zip(data["x"], data["y"])]
    if spec.get("resident") and device.type == "cuda":
        batches = move_to(batches, device)
    return BatchList(batches, spec["warmup_steps"] + spec["timed_steps"] + int(spec.get("profile_steps", 0)))


def make_loader(batches: BatchList, pin_memory: bool = False) -> DataLoader:
    """A DataLoader over whole batches (no collation, no workers: the batches are in memory)."""
    return DataLoader(batches, batch_size=None, shuffle=False, num_workers=0, pin_memory=pin_memory)


def math_precision(
    device: torch.device, autocast_dtype: torch.dtype | None, param_dtype: torch.dtype, has_conv: bool
) -> str:
    """The datasheet peak (for MFU) the step's matmuls run at; fp32 on CUDA counts as TF32 where routed there."""
    return precision_key(
        autocast_dtype or param_dtype, tf32=device.type == "cuda" and tf32_enabled(conv=has_conv)
    )


@dataclass
class Job:
    """What a contender process trains: the same for every contender (model from the seed, batches, recipe)."""

    spec: dict[str, Any]
    device: torch.device
    model: nn.Module  # built from the seed on the host, not yet moved
    batches: BatchList
    clock: StepClock
    # (model, batch) -> loss; a --model workload's own
    loss_fn: Callable[[nn.Module, Any], Any] = default_loss
    moe: list[MoE] = field(init=False)  # the model's MoE layers, found once

    def __post_init__(self) -> None:
        self.moe = [layer for _, layer in moe_layers(self.model)]

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The scalar loss of ``batch`` (already on the device) under ``model``, plus the
        load-balancing losses of its MoE layers (``turbotrain.MoE``), as a plain loop adds them by
        hand; the turbotrain row's engine adds them itself, so every row trains the same objective."""
        loss = as_loss(self.loss_fn(model, batch))
        for layer in self.moe:
            aux = layer.take_aux_loss()
            loss = loss if aux is None else loss + aux
        return loss

    @property
    def optim(self) -> dict[str, Any]:
        return self.spec["optim"]

    @property
    def total_steps(self) -> int:
        return self.spec["warmup_steps"] + self.spec["timed_steps"]

    @property
    def has_conv(self) -> bool:
        return any(isinstance(m, nn.Conv2d) for m in self.model.modules())

    def plain_optimizer(
        self, model: nn.Module, **impl: bool
    ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
        """The recipe's AdamW (``impl``: fused=True, foreach=...) and its warmup schedule."""
        o = self.optim
        groups = recipe_param_groups(model, o["weight_decay"])
        opt = torch.optim.AdamW(groups, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], **impl)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_factor(o["lr_warmup_steps"]))

    def plain_result(self, autocast_dtype: torch.dtype | None, **extra: Any) -> dict[str, Any]:
        """What a plain-PyTorch contender (fp32 weights, optional autocast) reports of its arithmetic."""
        return {
            "precision": "bf16-mixed" if autocast_dtype == torch.bfloat16 else "fp32",
            "compiled": False,
            "math_precision": math_precision(self.device, autocast_dtype, torch.float32, self.has_conv),
            **extra,
        }
