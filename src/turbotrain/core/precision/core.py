"""Numeric precision as an open set of plugins (after Lightning Fabric's): autocast, loss scaling,
model transforms, and the non-finite guard. Each precision is one :class:`Precision` subclass
(defining it registers its ``name``); the base class is full fp32, each other mode overrides only
what differs, so the engine calls the same methods whatever the mode, with no ``if`` per step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar, ContextManager

import torch
from torch import Tensor
from torch.optim import Optimizer

from ...base.batch import map_tensors
from ...base.config import AUTO, PRECISION_MODES, PrecisionConfig, choice_error, register_settings, setting
from ...base.errors import ConfigError, TurbotrainWarning
from ...parts.hardware import register_peak

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceCaps:
    """What the device can do, read once (mockable in tests)."""

    type: str  # "cuda" or "cpu"
    capability: tuple[int, int] | None = None  # CUDA compute capability
    bf16: bool = False  # native bf16 support

    @classmethod
    def of(cls, device: torch.device) -> DeviceCaps:
        if device.type == "cuda":
            cap = torch.cuda.get_device_capability(device)
            return cls("cuda", cap, bool(torch.cuda.is_bf16_supported()) and cap >= (8, 0))
        return cls(device.type, None, False)


PRECISIONS: dict[str, type[Precision]] = {}
"""Every precision by name, in the order the classes were defined (``precision.mode``'s valid values)."""


def register_precision(cls: type[Precision]) -> type[Precision]:
    """Make ``cls`` selectable by its ``name`` (config, ``--help-config``, fallbacks, MFU's peak)."""
    if not cls.name or cls.name == AUTO:
        raise ValueError(f"{cls.__name__}.name = {cls.name!r}: a precision needs a name other than 'auto'")
    PRECISIONS[cls.name] = cls
    PRECISION_MODES.add(cls.name)
    register_peak(cls.name, cls.peak)
    if cls.__dict__.get("settings") is not None:
        register_settings(
            "precision",
            cls.settings,  # type: ignore[arg-type]
            when=f"precision.mode={cls.name}",
            check=lambda config: cls.check_settings(config.precision),
        )
    return cls


def precision_class(mode: str) -> type[Precision]:
    try:
        return PRECISIONS[mode]
    except KeyError:
        raise choice_error("precision.mode", mode, (AUTO, *PRECISIONS)) from None


def resolve_precision(mode: str, caps: DeviceCaps, settings: PrecisionConfig | None = None) -> str:
    """Turn ``auto`` into a concrete mode for ``caps`` and refuse modes the device cannot run. auto:
    bf16-mixed on CUDA cc >= 8.0, fp16-mixed below, fp32 elsewhere; never a mode changing the math more."""
    if mode == AUTO:
        if caps.type != "cuda":
            return "fp32"
        return "bf16-mixed" if caps.capability is not None and caps.capability >= (8, 0) else "fp16-mixed"
    precision_class(mode).check(caps, settings or PrecisionConfig())
    return mode


def fallback_mode(mode: str, caps: DeviceCaps) -> str | None:
    """The next safer precision after non-finite steps: fp8 -> bf16 -> fp32, fp16 -> bf16 (if supported) -> fp32."""
    return precision_class(mode).fallback_for(caps)


class Precision:
    """Full fp32: no autocast, no loss scaling; a subclass with a ``name`` registers itself."""

    name: ClassVar[str] = "fp32"
    fallback: ClassVar[str | None] = None  # the next safer precision after non-finite steps (None: stop)
    peak: ClassVar[str] = "fp32"  # the datasheet peak MFU is measured against (hardware.py)
    # asked of the strategy: parameters (and optimizer state) in this dtype
    param_dtype: torch.dtype = torch.float32
    # what matmuls run in, when it is not the parameters' dtype (FSDP2's param_dtype)
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32  # gradient reductions across ranks
    scaler: torch.amp.GradScaler | None = None
    # its own settings: a PrecisionConfig subclass adding knob(...) fields ([precision] is read into
    # it when precision.mode names this class; from_settings reads them)
    settings: ClassVar[type[PrecisionConfig] | None] = None

    def __init_subclass__(cls, register: bool = True, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if register and "name" in cls.__dict__:
            register_precision(cls)

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None else torch.device("cpu")

    def mfu_peak(self) -> str:
        """The datasheet peak MFU is measured against now (fp8 with no float8 layer: bf16's)."""
        return self.peak

    @classmethod
    def from_settings(cls, device: torch.device, settings: PrecisionConfig) -> Precision:
        """The precision for ``device`` from the ``[precision]`` section."""
        return cls(device)

    def own_settings(self, settings: PrecisionConfig) -> PrecisionConfig:
        """``settings`` with this object's own fields: a plugin object is checked by what it is."""
        return settings

    def place(self, device: torch.device) -> None:
        """Put a plugin object built without a device on the engine's, with its device-bound state."""
        self.device = device

    @classmethod
    def check(cls, caps: DeviceCaps, settings: PrecisionConfig) -> None:
        """Raise a one-line :class:`ConfigError` (the fix included) when ``caps`` cannot run this precision."""

    @classmethod
    def check_settings(cls, settings: PrecisionConfig) -> None:
        """Raise a one-line :class:`ConfigError` for a rule that spans this precision's own settings."""

    @classmethod
    def unavailable(cls, caps: DeviceCaps, settings: PrecisionConfig | None = None) -> str:
        """Why this precision cannot run on ``caps`` ("" when it can): :meth:`check`'s line, quietly."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cls.check(caps, settings or PrecisionConfig())
        except ConfigError as exc:
            return str(exc)
        return ""

    @classmethod
    def slow_on(cls, caps: DeviceCaps) -> str:
        """Why this precision runs on ``caps`` but slower than fp32 ("" when it does not)."""
        return ""

    @classmethod
    def fallback_for(cls, caps: DeviceCaps) -> str | None:
        """The precision to switch to after non-finite steps on ``caps`` (None: nothing safer)."""
        return cls.fallback

    def autocast(self) -> ContextManager[Any]:
        """Context for forward passes, in training and evaluation alike."""
        return contextlib.nullcontext()

    def convert_module(self, module: torch.nn.Module, *, sharded: bool = False) -> torch.nn.Module:
        """Cast parameters ('true' precisions) or swap layers (fp8) before compile; identities kept."""
        return module

    def revert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Undo :meth:`convert_module`'s layer swaps when falling back (parameter casts are the engine's)."""
        return module

    def summary(self) -> dict[str, Any]:
        """What the run's summary records about this precision beyond its name."""
        return {}

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer: Optimizer) -> None:
        """Bring gradients back to their true magnitude before clipping."""

    def optimizer_step(
        self, optimizer: Optimizer, finite: Tensor | bool, grad_scale: Tensor | None = None
    ) -> None:
        """Step unless ``finite`` (a host bool or a 0-d device tensor) is False. Fused optimizers
        take ``found_inf`` and ``grad_scale`` (clipping folded in) inside the kernel: no sync."""
        if finite is False:  # already known on the host (CPU guard)
            return
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            if not isinstance(finite, bool):
                optimizer.found_inf = (~finite).to(torch.float32)  # type: ignore[attr-defined]
            if grad_scale is not None:
                optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
            try:
                optimizer.step()
            finally:
                optimizer.__dict__.pop("found_inf", None)
                optimizer.__dict__.pop("grad_scale", None)
        elif finite is True:
            optimizer.step()
        else:
            self.warn_host_skip(optimizer)
            if bool(finite):  # host-device sync point, every step: this optimizer cannot skip on the device
                optimizer.step()

    def warn_host_skip(self, optimizer: Optimizer) -> None:
        """Say once that ``optimizer`` makes every step wait for the device."""
        if getattr(self, "_warned_host_skip", False):
            return
        self._warned_host_skip = True
        log.warning(
            "%s cannot skip a non-finite step on the device, so every optimizer step reads the finite flag on "
            "the host (one host-device sync per step); use a fused optimizer (torch.optim.AdamW(..., fused=True), "
            f"or {setting('optim.implementation', 'fused')}) to keep the GPU queue full",
            type(optimizer).__name__,
        )

    def update(self) -> None:
        """After each optimizer step (loss-scale update for fp16)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


register_precision(Precision)


class MixedPrecision(Precision):
    """fp32 weights, forward under ``torch.autocast`` in a 16-bit dtype (``dtype``)."""

    dtype: ClassVar[torch.dtype] = torch.bfloat16

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__(device)
        self.compute_dtype = self.dtype

    def autocast(self) -> ContextManager[Any]:
        return torch.autocast(self.device.type, dtype=self.dtype)


class _BF16:
    """What the bf16 precisions share: fp32 after non-finite steps, the bf16 peak, bf16 checked."""

    name: ClassVar[str]
    fallback: ClassVar[str | None] = "fp32"
    peak: ClassVar[str] = "bf16"

    @classmethod
    def check(cls, caps: DeviceCaps, settings: PrecisionConfig) -> None:
        if caps.type == "cuda" and not caps.bf16:
            raise ConfigError(
                f"precision.mode = {cls.name!r}: this GPU (compute capability {caps.capability}) "
                f"has no bf16; use {setting('precision.mode', 'fp16-mixed')} or auto"
            )
        reason = precision_class(cls.name).slow_on(caps)
        if reason:
            warnings.warn(f"precision.mode = {cls.name!r} {reason}", TurbotrainWarning, stacklevel=2)

    @classmethod
    def slow_on(cls, caps: DeviceCaps) -> str:
        """A CPU without bf16 units ran bf16 autocast 14x slower than fp32."""
        return (
            "on CPU: without bf16 units this is often many times slower than fp32"
            if caps.type == "cpu"
            else ""
        )


class BF16Mixed(_BF16, MixedPrecision):
    name = "bf16-mixed"


class FP16Mixed(MixedPrecision):
    """fp16 autocast with a GradScaler: the only mode that scales losses."""

    name = "fp16-mixed"
    peak = "fp16"
    dtype = torch.float16
    scaler: torch.amp.GradScaler  # always one (built in __init__)

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__(device)
        self.scaler = torch.amp.GradScaler(self.device.type)
        self._unscaled: set[int] = set()

    @classmethod
    def check(cls, caps: DeviceCaps, settings: PrecisionConfig) -> None:
        if caps.type != "cuda":
            raise ConfigError(
                "precision.mode = 'fp16-mixed' needs a CUDA GPU (GradScaler loss scaling); "
                f"on CPU use {setting('precision.mode', 'fp32')} (or bf16-mixed)"
            )

    @classmethod
    def fallback_for(cls, caps: DeviceCaps) -> str | None:
        return "bf16-mixed" if caps.bf16 else "fp32"

    def place(self, device: torch.device) -> None:
        super().place(device)
        # built without a device: a CPU GradScaler would assert on CUDA scales
        if self.scaler._device != device.type:
            self.scaler = torch.amp.GradScaler(device.type)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def optimizer_step(
        self, optimizer: Optimizer, finite: Tensor | bool, grad_scale: Tensor | None = None
    ) -> None:
        # No clipping folded here (GradScaler owns grad_scale); its skip on inf/nan gradients covers
        # the guard's (a non-finite loss always yields them).
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            self.warn_host_skip(optimizer)
        self.scaler.step(optimizer)  # host-device sync point unless the optimizer is fused

    def update(self) -> None:
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


# modules whose float inputs follow their weights
_INPUT_CASTS: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _cast_float_inputs(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, Any]:
    """Forward pre-hook: float inputs to the weights' dtype (read at each call), integers left."""
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
    if dtype is None:
        return args, kwargs

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return map_tensors(args, cast), map_tensors(kwargs, cast)


class BF16True(_BF16, Precision):
    """Parameters, gradients and optimizer state in bf16; float inputs cast to bf16 on the way in
    (else "mat1 and mat2 must have the same dtype"), as Fabric's true-half precision does."""

    name = "bf16-true"
    param_dtype = torch.bfloat16

    def convert_module(self, module: torch.nn.Module, *, sharded: bool = False) -> torch.nn.Module:
        module.to(torch.bfloat16)
        if module not in _INPUT_CASTS:  # once per module, whatever the number of conversions
            module.register_forward_pre_hook(_cast_float_inputs, with_kwargs=True)
            _INPUT_CASTS.add(module)
        return module


def build_precision(
    mode: str | Precision,
    device: torch.device,
    caps: DeviceCaps | None = None,
    settings: PrecisionConfig | None = None,
) -> Precision:
    """Config string (``auto`` resolved here, once) or a plugin object -> Precision for ``device``."""
    caps = caps or DeviceCaps.of(device)
    settings = settings or PrecisionConfig()
    if isinstance(mode, Precision):  # Engine(precision=MyPrecision()): checked and placed like a named one
        type(mode).check(caps, mode.own_settings(settings))
        mode.place(device)
        return mode
    return precision_class(resolve_precision(mode, caps, settings)).from_settings(device, settings)


def apply_backend_switches(
    device: torch.device,
    *,
    tf32: bool,
    cudnn_benchmark: bool,
    flush_denormal: bool = True,
    deterministic: bool = False,
) -> dict[str, bool]:
    """Process-wide switches, set once: TF32, cuDNN autotuning (CUDA), denormal flushing (CPU: ~268 vs
    ~197 ms for the first gpt-tiny steps on the 2-core EPYC); returns them as they stand on ``device``."""
    if deterministic:
        apply_deterministic()
        cudnn_benchmark = False
    cuda = device.type == "cuda"
    if device.type == "cpu":
        torch.set_flush_denormal(flush_denormal)
    elif cuda:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        torch.backends.cudnn.benchmark = cudnn_benchmark
    return {
        "tf32": tf32 and cuda,
        "cudnn_benchmark": cudnn_benchmark and cuda,
        "deterministic": deterministic,
    }


CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")  # the CUBLAS_WORKSPACE_CONFIG values that are deterministic


def apply_deterministic() -> None:
    """``run.deterministic`` for the rest of the process. CUBLAS_WORKSPACE_CONFIG is read at cuBLAS's
    first handle, so it must be set before CUDA work starts: the log line says whether it was."""
    early = not torch.cuda.is_initialized()
    given = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if given not in CUBLAS_DETERMINISTIC:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_DETERMINISTIC[0]
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    value = os.environ["CUBLAS_WORKSPACE_CONFIG"]
    where = (
        "given in the environment"
        if given == value
        else "set before CUDA initialised"
        if early
        else "set after CUDA initialised: it holds only if no cuBLAS call ran yet; export it before starting Python to be sure"
    )
    log.info(
        "run.deterministic: torch.use_deterministic_algorithms(True), cuDNN deterministic, CUBLAS_WORKSPACE_CONFIG=%s (%s); "
        "it costs speed: no cuDNN autotuning (precision.cudnn_benchmark is ignored), some kernels are slower, "
        "and an op without a deterministic kernel raises an error naming it",
        value,
        where,
    )


class NonFiniteGuard:
    """Counts non-finite optimizer steps on the device: ``check`` adds in place (no sync); ``poll``
    reads the count (a sync), every few steps, so the policy may act a few steps late."""

    def __init__(self, device: torch.device) -> None:
        self.finite_steps = torch.zeros((), dtype=torch.int64, device=device)
        self.checked = 0  # steps checked since construction or load (host counter)
        self.base = 0  # non-finite steps before a resume
        self.seen = 0  # total as of the last poll

    def check(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor | None) -> torch.Tensor | bool:
        # loss + norm is non-finite exactly when either is (two finite fp32 values cannot overflow here)
        finite = torch.isfinite(loss_sum if grad_norm is None else loss_sum + grad_norm)
        self.finite_steps += finite
        self.checked += 1
        return finite

    def poll(self) -> int:
        """Total non-finite steps so far. Host-device sync point: call every N steps only."""
        self.seen = self.base + self.checked - int(self.finite_steps.item())
        return self.seen

    def state_dict(self) -> dict[str, Any]:
        return {"nonfinite_steps": self.poll()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.base = self.seen = int(state.get("nonfinite_steps", 0))
        self.finite_steps.zero_()
        self.checked = 0


class HostNonFiniteGuard(NonFiniteGuard):
    """The guard on CPU, where a read is no sync: host float checks, about 30 us less per step."""

    def check(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor | None) -> torch.Tensor | bool:
        ok = math.isfinite(loss_sum.item()) and (grad_norm is None or math.isfinite(grad_norm.item()))
        self.checked += 1
        self.base += not ok
        return ok

    def poll(self) -> int:
        self.seen = self.base
        return self.seen


def build_guard(device: torch.device) -> NonFiniteGuard:
    """On-device counting where a read would sync an accelerator; host checks on CPU."""
    return HostNonFiniteGuard(device) if device.type == "cpu" else NonFiniteGuard(device)
