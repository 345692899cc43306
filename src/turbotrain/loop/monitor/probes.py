"""The standard probes of a run: memory and NVML on CUDA, MFU when a model and a batch are given."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...base.failure import workload_failed
from ...parts.hardware import nvml
from .flops import build_mfu_probe
from .hook import Probe
from .memory import HostMemoryProbe, MemoryProbe
from .nvml import NvmlSampler, UtilisationWatch

log = logging.getLogger(__name__)


def build_probes(
    device: torch.device,
    *,
    model: nn.Module | None = None,
    example_batch: Any = None,
    precision: str = "fp32",
    nvml_enabled: bool = True,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    devices: int = 1,
    memory_every: int = -1,
    memory_warn_fraction: float = 0.9,
    memory_cap_fraction: float = 0.0,
    util_warn_pct: float = 80.0,
    util_warn_s: float = 120.0,
) -> list[Probe]:
    """The standard probes for ``device``: host memory; GPU memory, NVML and the utilisation watch on
    CUDA; MFU with a model and an example batch. The other arguments: the ``monitor.*`` settings of
    their names and ``memory.max_fraction`` (``memory_cap_fraction``)."""
    probes: list[Probe] = [HostMemoryProbe()]
    if device.type == "cuda":
        every = None if memory_every < 0 else memory_every
        probes.append(
            MemoryProbe(
                device, every=every, warn_fraction=memory_warn_fraction, cap_fraction=memory_cap_fraction
            )
        )
        if nvml_enabled:
            sampler = NvmlSampler(device.index if device.index is not None else torch.cuda.current_device())
            if sampler.available:
                probes.append(sampler)
                if util_warn_pct > 0:  # after the sampler: it reads the window's gpu_util_pct
                    probes.append(UtilisationWatch(util_warn_pct, util_warn_s))
            else:
                log.info("GPU utilisation not sampled: %s", nvml()[1])
    if model is not None and example_batch is not None:
        probes += _mfu_probe(model, example_batch, device, precision, loss_fn, autocast, devices)
    return probes


def _mfu_probe(model: nn.Module, batch: Any, device: torch.device, *args: Any) -> list[Probe]:
    """The MFU probe, or none (logged) when the FLOPs cannot be counted."""
    try:
        return [build_mfu_probe(model, batch, device, *args)]
    except Exception as exc:  # training goes on without FLOPs ...
        # ... unless the user's own forward or loss failed on the example batch: one line, now
        failed = workload_failed("the model's forward or loss on the example batch", exc)
        if failed is not None:
            raise failed from None
        log.warning(
            "FLOPs not counted, so no TFLOP/s or MFU (%s: %s); pass a loss_fn(model, batch) "
            "that returns the loss for the example batch",
            type(exc).__name__,
            exc,
        )
        return []
