"""FLOPs and MFU: training FLOPs per sample counted once before training, and :class:`MfuProbe`,
achieved TFLOP/s and MFU over each logging window against the datasheet peak (docs/mfu.md)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from ...base.batch import attention_mask, batch_size, move_to, token_count
from ...core.engine import as_loss, default_loss
from ...core.transforms import checkpointed_blocks, eager, recompute_context
from ...parts.hardware import DeviceSpec, estimate_mfu, lookup_peak, precision_key, tf32_enabled

log = logging.getLogger(__name__)


def _cpu_sdpa_flop(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flop(
    grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any
) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# torch's flop counter knows the CUDA attention kernels but not the CPU one SDPA dispatches to.
_EXTRA_FLOP_FORMULAS: dict[Any, Any] = {
    op: fn
    for name, fn in (
        ("_scaled_dot_product_flash_attention_for_cpu", _cpu_sdpa_flop),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_sdpa_backward_flop),
    )
    if (op := getattr(torch.ops.aten, name, None)) is not None
}


COUNTED = (
    "counted: torch.utils.flop_counter on one micro-batch (matrix products, convolutions, attention; "
    "element-wise operations not counted)"
)
FORMULA = "6N + attention: 6 x parameters + 12 x layers x heads x head size x sequence per token (PaLM)"


@dataclass(frozen=True)
class FlopCount:
    """Training FLOPs per sample (forward + backward): ``model``'s (what MFU counts) by
    ``convention``, and ``recompute``, what activation checkpointing runs again (HFU adds it)."""

    model: float
    recompute: float = 0.0
    source: str = ""  # the function or counter (summary.json's flops_source)
    convention: str = COUNTED


def count_flops(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    autocast: Callable[[], Any] = contextlib.nullcontext,
) -> FlopCount:
    """Training FLOPs per sample by ``torch.utils.flop_counter`` on one real micro-batch: the model's,
    and apart what activation checkpointing recomputes. One eager forward/backward, side-effect free
    (``torch.autograd.grad``; buffers and the RNG restored); attention counts the full T x T square."""
    loss_fn = loss_fn or default_loss
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    recomputes: list[FlopCounterMode] = []

    def recompute_counter() -> FlopCounterMode:  # one per checkpointed block's recomputation
        recomputes.append(FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS))
        return recomputes[-1]

    with torch.random.fork_rng(devices=devices), eager(), recompute_context(recompute_counter):
        with FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS) as counter:
            with autocast():
                loss = as_loss(loss_fn(model, batch))
            torch.autograd.grad(loss, params, allow_unused=True)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    n = batch_size(batch)
    recompute = sum(c.get_total_flops() for c in recomputes)  # the outer counter saw these too
    return FlopCount((counter.get_total_flops() - recompute) / n, recompute / n, "torch.utils.flop_counter")


def count_flops_per_sample(model: nn.Module, batch: Any, *args: Any, **kwargs: Any) -> float:
    """The model's training FLOPs per sample: :func:`count_flops`'s arguments."""
    return count_flops(model, batch, *args, **kwargs).model


def estimate_flops(model: nn.Module, batch: Any, *args: Any, **kwargs: Any) -> FlopCount:
    """Training FLOPs per sample: the model's own ``flops_per_token(seq_len)`` when it has one and the
    batch holds token ids (:data:`FORMULA`), else counted once (:func:`count_flops`'s arguments)."""
    tokens = token_count(batch) // batch_size(batch)  # per sample
    own = getattr(model, "flops_per_token", None)
    if callable(own) and tokens:
        recompute = (
            count_flops(model, batch, *args, **kwargs).recompute if checkpointed_blocks(model) else 0.0
        )
        return FlopCount(
            float(own(tokens)) * tokens, recompute, "model.flops_per_token (6N + 12·L·H·Q·T)", FORMULA
        )
    return count_flops(model, batch, *args, **kwargs)


def estimate_flops_per_sample(model: nn.Module, batch: Any, *args: Any, **kwargs: Any) -> tuple[float, str]:
    """The model's training FLOPs per sample and their source: :func:`estimate_flops`'s arguments."""
    found = estimate_flops(model, batch, *args, **kwargs)
    return found.model, found.source


class MfuProbe:
    """Achieved model TFLOP/s and MFU over each logging window: FLOPs per token x tokens/s (samples/s
    for data without tokens), so token-budget batches give a steady figure. The peak is ``spec``'s
    for the record's ``precision`` x ``devices``; without a spec only ``tflops``. With activation
    checkpointing, ``recompute_per_sample`` adds ``hw_tflops`` and ``hfu``."""

    def __init__(
        self,
        flops_per_sample: float,
        spec: DeviceSpec | None,
        precision: str = "fp32",
        source: str = "",
        devices: int = 1,
        tokens_per_sample: float = 0.0,
        recompute_per_sample: float = 0.0,
        convention: str = "",
    ) -> None:
        self.flops_per_sample, self.recompute_per_sample = flops_per_sample, recompute_per_sample
        self.spec, self.precision, self.source, self.convention = spec, precision, source, convention
        self.tokens_per_sample = tokens_per_sample  # of the example the FLOPs were counted on; 0: no tokens
        self.devices = devices  # data parallel: the record's samples/s are the world's, so is the peak

    def peak_tflops(self, precision: str | None = None) -> float | None:
        """Dense datasheet TFLOP/s for ``precision`` of all ``devices`` (fp32 at the TF32 peak while
        TF32 matmuls are on)."""
        if not self.spec:
            return None
        peak = self.spec.peak_tflops(precision_key(precision or self.precision, tf32=tf32_enabled()))
        return peak * self.devices if peak else peak

    def __call__(self, record: dict[str, Any]) -> dict[str, Any]:
        tokens = record.get("tokens_per_s")
        rate = (
            tokens / self.tokens_per_sample
            if tokens and self.tokens_per_sample
            else record.get("samples_per_s")
        )
        if not rate:
            return {}
        flops_per_s = rate * self.flops_per_sample  # with tokens: tokens/s x FLOPs per token
        hardware_per_s = rate * (self.flops_per_sample + self.recompute_per_sample)
        out: dict[str, Any] = {"tflops": flops_per_s / 1e12}
        if self.recompute_per_sample:
            out["hw_tflops"] = hardware_per_s / 1e12
        peak = self.peak_tflops(record.get("mfu_peak") or record.get("precision"))
        if peak:
            out["mfu"] = estimate_mfu(flops_per_s, peak)
            if self.recompute_per_sample:
                out["hfu"] = estimate_mfu(hardware_per_s, peak)
        return out


def flop_tokens_per_sample(batch: Any) -> float:
    """The tokens per sample an :class:`MfuProbe` scales its FLOPs by: the token positions counted
    (padding included); 0 with an attention mask (tokens/s counts real tokens only) or no tokens."""
    if attention_mask(batch) is not None:
        return 0.0
    return token_count(batch) / batch_size(batch)


def build_mfu_probe(
    model: nn.Module,
    example_batch: Any,
    device: torch.device,
    precision: str = "fp32",
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    devices: int = 1,
) -> MfuProbe:
    """An :class:`MfuProbe` for ``model``: FLOPs on ``example_batch``, the peak from the device's name."""
    flops = estimate_flops(model, move_to(example_batch, device), loss_fn, autocast)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec = lookup_peak(name) if device.type == "cuda" else None
    if spec is None:
        log.debug("MFU left out: no datasheet peak for %s (achieved TFLOP/s is still recorded)", name)
    args = (flops.source, devices, flop_tokens_per_sample(example_batch), flops.recompute, flops.convention)
    return MfuProbe(flops.model, spec, precision, *args)
