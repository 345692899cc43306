"""Numeric precision: autocast, loss scaling and the non-finite guard.

The base class :class:`Precision` is full fp32 and does nothing; each other mode overrides only
what differs (after Lightning Fabric's precision plugins). ``build_precision`` resolves the
config once; the engine then calls the same methods whatever the mode, with no ``if`` per step.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

from .errors import ConfigError

log = logging.getLogger(__name__)

MODES = ("bf16-mixed", "fp16-mixed", "bf16-true", "fp32")


@dataclass(frozen=True)
class DeviceCaps:
    """What the device can do, read once (mockable in tests)."""

    type: str  # "cuda" or "cpu"
    capability: tuple[int, int] | None = None  # CUDA compute capability
    bf16: bool = False  # native bf16 support

    @classmethod
    def of(cls, device: torch.device) -> "DeviceCaps":
        if device.type == "cuda":
            cap = torch.cuda.get_device_capability(device)
            return cls("cuda", cap, bool(torch.cuda.is_bf16_supported()) and cap >= (8, 0))
        return cls(device.type, None, False)


def resolve_precision(mode: str, caps: DeviceCaps) -> str:
    """Turn ``auto`` into a concrete mode for ``caps`` and refuse modes the device cannot run.

    auto: bf16-mixed on CUDA with compute capability >= 8.0, fp16-mixed below, fp32 elsewhere
    (a CPU without bf16 units runs bf16 autocast about 14x slower than fp32).
    """
    if mode == "auto":
        if caps.type != "cuda":
            return "fp32"
        return "bf16-mixed" if caps.capability is not None and caps.capability >= (8, 0) else "fp16-mixed"
    if mode not in MODES:
        raise ConfigError(f"precision.mode = {mode!r} is not valid; choose one of: auto, {', '.join(MODES)}")
    if mode == "fp16-mixed" and caps.type != "cuda":
        raise ConfigError(
            "precision.mode = 'fp16-mixed' needs a CUDA GPU (GradScaler loss scaling); "
            "on CPU use --precision.mode=fp32 (or bf16-mixed)"
        )
    if mode.startswith("bf16") and caps.type == "cuda" and not caps.bf16:
        raise ConfigError(
            f"precision.mode = {mode!r}: this GPU (compute capability {caps.capability}) has no bf16; "
            "use --precision.mode=fp16-mixed or auto"
        )
    if mode.startswith("bf16") and caps.type == "cpu":
        warnings.warn(
            f"precision.mode = {mode!r} on CPU: without bf16 units this is often many times slower than fp32",
            stacklevel=2,
        )
    return mode


def fallback_mode(mode: str, caps: DeviceCaps) -> str | None:
    """The next safer precision after non-finite steps: fp16 -> bf16 (if supported) -> fp32."""
    if mode == "fp16-mixed":
        return "bf16-mixed" if caps.bf16 else "fp32"
    if mode in ("bf16-mixed", "bf16-true"):
        return "fp32"
    return None


class Precision:
    """Full fp32: no autocast, no loss scaling, parameters stay float32."""

    name = "fp32"
    param_dtype = torch.float32
    scaler: torch.amp.GradScaler | None = None

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def autocast(self) -> ContextManager[Any]:
        """Context for forward passes, in training and evaluation alike."""
        return contextlib.nullcontext()

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Cast parameters for 'true' (not mixed) precisions; fp32 and mixed keep float32 weights."""
        return module

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true magnitude before clipping."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer, finite: torch.Tensor) -> None:
        """Step unless ``finite`` (a 0-d bool tensor on the device) is False.

        Optimizers that accept an on-device ``found_inf`` (fused AdamW/Adam/SGD) skip inside the
        kernel: no host-device sync. Others need the flag on the host.
        """
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.found_inf = (~finite).to(torch.float32)  # type: ignore[attr-defined]
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf  # type: ignore[attr-defined]
        elif bool(finite):  # host-device sync point on CUDA (free on CPU): non-fused optimizer
            optimizer.step()

    def update(self) -> None:
        """After each optimizer step (loss-scale update for fp16)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class MixedPrecision(Precision):
    """fp32 weights, forward under ``torch.autocast`` in a 16-bit dtype."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(device)
        self.dtype = dtype
        self.name = "bf16-mixed" if dtype == torch.bfloat16 else "fp16-mixed"

    def autocast(self) -> ContextManager[Any]:
        return torch.autocast(self.device.type, dtype=self.dtype)


class BF16Mixed(MixedPrecision):
    def __init__(self, device: torch.device) -> None:
        super().__init__(device, torch.bfloat16)


class FP16Mixed(MixedPrecision):
    """fp16 autocast with a GradScaler: the only mode that scales losses."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, torch.float16)
        self.scaler = torch.amp.GradScaler(device.type)
        self._unscaled: set[int] = set()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, finite: torch.Tensor) -> None:
        # GradScaler skips the step when it found inf/nan in the unscaled gradients; a non-finite
        # loss always yields non-finite gradients, so its skip covers the guard's.
        self.scaler.step(optimizer)

    def update(self) -> None:
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


class BF16True(Precision):
    """Parameters, gradients and optimizer state in bf16: half the memory, less accuracy."""

    name = "bf16-true"
    param_dtype = torch.bfloat16

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(torch.bfloat16)


def build_precision(mode: str, device: torch.device, caps: DeviceCaps | None = None) -> Precision:
    """Config string -> Precision object for ``device`` (``auto`` resolved here, once)."""
    caps = caps or DeviceCaps.of(device)
    resolved = resolve_precision(mode, caps)
    kinds = {"fp32": Precision, "bf16-mixed": BF16Mixed, "fp16-mixed": FP16Mixed, "bf16-true": BF16True}
    return kinds[resolved](device)


def apply_backend_switches(device: torch.device, *, tf32: bool, cudnn_benchmark: bool) -> None:
    """TF32 matmuls/convolutions and cuDNN autotuning: process-wide switches, set once."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    torch.backends.cudnn.benchmark = cudnn_benchmark


class NonFiniteGuard:
    """Counts steps whose loss or gradient norm was not finite, on the device.

    ``observe`` adds to an on-device counter (no sync). ``poll`` reads it (a sync on CUDA) and is
    called by the engine only every few steps, so a step may be skipped a few steps before the
    policy acts: the skip itself never waits for the host.
    """

    def __init__(self, device: torch.device) -> None:
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.seen = 0  # host copy as of the last poll

    def observe(self, finite: torch.Tensor) -> None:
        self.count += (~finite).to(torch.int64)

    def poll(self) -> int:
        """Total non-finite steps so far. Host-device sync point: call every N steps only."""
        self.seen = int(self.count.item())
        return self.seen

    def state_dict(self) -> dict[str, Any]:
        return {"nonfinite_steps": self.count.detach().cpu()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "nonfinite_steps" in state:
            self.count.copy_(state["nonfinite_steps"])

