"""turbotrain's recipe for this machine, for trainers turbotrain does not drive (Hugging Face
``Trainer``, Lightning, Accelerate): :func:`build_recipe` resolves the speed settings once, through
the functions the engine uses; each integration maps the :class:`Recipe` to its own arguments."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..base.config import RunConfig
from ..core.optim import resolve_implementation
from ..core.precision import DeviceCaps, apply_backend_switches, resolve_precision
from ..core.transforms import resolve_scope
from ..parts.data.loader import resolve_loader_settings

log = logging.getLogger("turbotrain.integrations")

__all__ = ["Recipe", "build_recipe", "default_device", "merge_user", "recipe_kwargs"]


def default_device() -> torch.device:
    cuda = torch.cuda.is_available()
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


@dataclass(frozen=True)
class Recipe:
    """turbotrain's speed settings for one device, resolved (no ``auto`` left)."""

    device: str  # "cuda:0", "cpu"
    precision: str  # "bf16-mixed", "fp16-mixed" or "fp32" (turbotrain's names)
    tf32: bool  # TF32 tensor-core matmuls for fp32 work (CUDA compute capability >= 8.0 only)
    cudnn_benchmark: bool
    compile: bool  # torch.compile the model (CUDA: yes; CPU: ~40 s to compile for ~6 %, so no)
    compile_mode: str
    optimizer: str  # AdamW kernel: "fused" or "foreach"
    num_workers: int  # DataLoader worker processes
    pin_memory: bool
    prefetch_factor: int | None  # batches each worker keeps ready (None without workers)
    why: dict[str, str] = field(default_factory=dict)  # setting -> the reason, one line each

    @property
    def persistent_workers(self) -> bool:
        return self.num_workers > 0

    def loader_kwargs(self) -> dict[str, Any]:
        return {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.persistent_workers,
            **({"prefetch_factor": self.prefetch_factor} if self.num_workers > 0 else {}),
        }

    def optimizer_kwargs(self) -> dict[str, Any]:
        """``torch.optim.AdamW`` keyword arguments of the recipe (``fused`` or ``foreach``)."""
        return {self.optimizer: True}

    def apply_switches(self) -> dict[str, bool]:
        """Set the recipe's process-wide switches (TF32 and cuDNN autotuning on CUDA; denormal
        flushing on CPU) as ``Engine()`` does; returns them as they now stand."""
        return apply_backend_switches(
            torch.device(self.device), tf32=self.tf32, cudnn_benchmark=self.cudnn_benchmark
        )


def build_recipe(device: torch.device | str | None = None, config: RunConfig | None = None) -> Recipe:
    """The recipe ``Engine()`` would use on ``device`` with ``config``'s settings (default: a new one's)."""
    device = torch.device(device) if device is not None else default_device()
    config = config or RunConfig()
    caps = DeviceCaps.of(device)
    precision = resolve_precision(config.precision.mode, caps, config.precision)
    tf32 = config.precision.tf32 and caps.capability is not None and caps.capability >= (8, 0)
    cuda = device.type == "cuda"
    compile_scope = resolve_scope(config.compile.scope, device)
    optimizer = resolve_implementation(config.optim.implementation, device)
    optimizer = optimizer if optimizer in ("fused", "foreach") else "foreach"
    loader = resolve_loader_settings(
        device, config.data.num_workers, config.data.pin_memory, config.data.prefetch_factor
    )
    where = f"CUDA sm_{caps.capability[0]}{caps.capability[1]}" if caps.capability else device.type.upper()
    why = {
        "precision": {
            "bf16-mixed": f"{where}: bf16 autocast, no loss scaling",
            "fp16-mixed": f"{where}: no bf16 units, fp16 autocast with loss scaling",
            "fp32": f"{where}: fp32 (bf16 autocast on a CPU without bf16 units ran ~14x slower)",
        }.get(precision, f"{where}: {precision}"),
        "tf32": f"{where}: TF32 matmuls for fp32 work" if tf32 else f"{where}: no TF32 tensor cores",
        "compile": "torch.compile the model (CUDA)"
        if compile_scope != "off"
        else f"{where}: eager (compiling costs ~40 s on a small CPU model for ~6 %)",
        "optimizer": f"AdamW {optimizer}: one kernel for all parameters"
        if optimizer == "fused"
        else f"AdamW {optimizer}: no fused kernel for {device.type} in this torch",
        "loader": f"{loader.num_workers} DataLoader workers"
        + (" (persistent)" if loader.num_workers else " (training threads use every core)")
        + (", pinned host memory" if loader.pin_memory else ""),
    }
    return Recipe(
        device=str(device),
        precision=precision,
        tf32=tf32,
        cudnn_benchmark=config.precision.cudnn_benchmark and cuda,
        compile=compile_scope != "off",
        compile_mode=config.compile.mode,
        optimizer=optimizer,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
        why=why,
    )


def merge_user(
    recipe: Mapping[str, Any],
    user: Mapping[str, Any],
    groups: Iterable[tuple[str, ...]] = (),
    *,
    where: str = "",
) -> dict[str, Any]:
    """``recipe``'s settings with every one in ``user`` winning (``None``: not given). A ``group`` holds
    settings that only make sense together (``bf16``/``fp16``): once the user gives one, the recipe's
    others are dropped. One warning line per recipe setting overridden with another value or dropped."""
    user = {key: value for key, value in user.items() if value is not None}
    merged = dict(recipe)
    dropped: dict[str, str] = {}
    for group in groups:
        given = [k for k in group if k in user]
        if given:
            for key in group:
                if key not in user and key in merged:
                    dropped[key] = ", ".join(f"{k} = {user[k]!r}" for k in given)
                    del merged[key]
    said = f"turbotrain recipe{where}: %s = %r"
    for key, value in user.items():
        if key in recipe and recipe[key] != value:
            log.warning(f"{said}; you set %s = %r: yours is kept", key, recipe[key], key, value)
    for key, because in dropped.items():
        if recipe[key] is not None:
            log.warning(f"{said} left out because you set %s: yours is kept", key, recipe[key], because)
    merged.update(user)
    return merged


def recipe_kwargs(
    device: torch.device | str | None,
    convert: Callable[[Recipe], dict[str, Any]],
    yours: Mapping[str, Any],
    groups: Iterable[tuple[str, ...]] = (),
    where: str = "",
) -> dict[str, Any]:
    """A trainer's keyword arguments (``convert``) of the recipe, ``yours`` winning; reasons logged."""
    recipe = build_recipe(device)
    for key, why in recipe.why.items():
        log.info("turbotrain recipe: %s: %s", key, why)
    return merge_user(convert(recipe), yours, groups, where=where)
