"""What the Engine needs from a RunConfig, resolved once as plain values: its hot path reads no config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..base.config import PrecisionConfig, RunConfig, load_config
from ..base.errors import ConfigError
from ..base.launch import Topology
from ..parts.data.loader import LoaderSettings, resolve_loader_settings
from .device import apply_memory_cap, local_device, resolve_device
from .plan import ParallelPlan
from .precision.core import apply_backend_switches  # the function's own module: one import level less
from .transforms import resolve_scope

SCHEDULER_INTERVALS = ("step", "epoch", "manual")

# EngineOptions' fields read from the config as they are: field -> (section, key)
READ_AS_IS = {
    "precision": ("precision", "mode"),
    "tf32": ("precision", "tf32"),
    "cudnn_benchmark": ("precision", "cudnn_benchmark"),
    "flush_denormal": ("precision", "flush_denormal"),
    "deterministic": ("run", "deterministic"),
    "memory_max_fraction": ("memory", "max_fraction"),
    "compile_mode": ("compile", "mode"),
    "cuda_graphs": ("compile", "cuda_graphs"),
    "max_recompiles": ("compile", "max_recompiles"),
    "accumulation": ("batch", "accumulation"),
    "grad_clip": ("optim", "grad_clip"),
    "nonfinite": ("precision", "nonfinite"),
    "max_nonfinite_steps": ("precision", "max_nonfinite_steps"),
    "sync_every": ("monitor", "log_every"),
    "track_grad_norm": ("monitor", "grad_norm"),
    "device_prefetch": ("data", "device_prefetch"),
    "checkpointing": ("memory", "checkpointing"),
    "on_oom": ("memory", "on_oom"),
    "tune_user_optimizer": ("optim", "tune_user_optimizer"),
}


def scheduler_interval_of(scheduler: Any, interval: str | None) -> str:
    """How ``engine.setup``'s ``scheduler`` steps (``"manual"`` without one), or the mistake in one line."""
    if scheduler is None:
        return "manual"
    if interval is None or interval not in SCHEDULER_INTERVALS:
        raise ConfigError(
            f"scheduler_interval = {interval!r}: say how the scheduler steps, "
            "engine.setup(..., scheduler=s, scheduler_interval='step' | 'epoch' | 'manual')"
        )
    return interval


@dataclass
class EngineOptions:
    """What the engine needs from a RunConfig, resolved once."""

    device: torch.device
    precision: str
    # the [precision] section, for the plugins' own fields
    precision_settings: PrecisionConfig = PrecisionConfig()
    tf32: bool = True
    cudnn_benchmark: bool = True
    flush_denormal: bool = True
    deterministic: bool = False
    memory_max_fraction: float = 0.0  # CUDA: the caching allocator's cap, a fraction of the device (0 = none)
    compile_scope: str = "off"
    compile_mode: str = "default"
    cuda_graphs: bool = False  # whole-step CUDA graphs (core/graphs.py)
    max_recompiles: int = 2  # after the first sync_every steps, before the compile guard warns
    accumulation: int = 1
    grad_clip: float = 0.0
    nonfinite: str = "fallback"
    max_nonfinite_steps: int = 3
    # optimizer steps between guard reads: the monitor's logging cadence, so both share one sync
    sync_every: int = 10
    track_grad_norm: bool = False
    device_prefetch: bool = True
    checkpointing: str = "off"
    on_oom: str = "halve"
    tune_user_optimizer: bool = False  # engine.setup switches an Adam/AdamW to the fused kernel in place
    tune_user_loader: LoaderSettings | None = None  # engine.setup rebuilds a DataLoader with these settings

    plan: ParallelPlan = ParallelPlan(Topology())  # how the run spreads over processes (one process: this)

    def apply_switches(self) -> dict[str, bool]:
        """The process-wide switches and the CUDA allocator's cap, set once; returns them as applied."""
        switches = apply_backend_switches(
            self.device,
            tf32=self.tf32,
            cudnn_benchmark=self.cudnn_benchmark,
            flush_denormal=self.flush_denormal,
            deterministic=self.deterministic,
        )
        apply_memory_cap(self.device, self.memory_max_fraction)
        return switches

    def window_args(self) -> dict[str, Any]:
        """The window's own settings: clipping, whether it computes the norm, accumulation."""
        norm_needed = self.grad_clip > 0 or self.track_grad_norm
        return {"grad_clip": self.grad_clip, "norm_needed": norm_needed, "accumulation": self.accumulation}

    @classmethod
    def from_config(
        cls, config: RunConfig | Mapping[str, Mapping[str, Any]] | None, plan: ParallelPlan | None = None
    ) -> EngineOptions:
        """The engine's options from ``config`` (a RunConfig, overrides, or None); ``plan`` if resolved."""
        if config is None or isinstance(config, Mapping):
            config = load_config(overrides=config or {})
        plan = plan or ParallelPlan.resolve(config.distributed)
        device = local_device(resolve_device(config.run.device), plan.topology)
        loader = config.data
        return cls(
            device=device,
            precision_settings=config.precision,
            compile_scope=resolve_scope(config.compile.scope, device),
            tune_user_loader=resolve_loader_settings(
                device, loader.num_workers, loader.pin_memory, loader.prefetch_factor
            )
            if loader.tune_user_loader
            else None,
            plan=plan,
            **{name: getattr(getattr(config, section), key) for name, (section, key) in READ_AS_IS.items()},
        )
