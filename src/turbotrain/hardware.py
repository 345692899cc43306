"""Datasheet peaks of common accelerators, looked up from the device name, and MFU.

MFU (model FLOPs utilisation, PaLM convention) = model FLOPs actually computed per second divided
by the device's dense peak for the precision in use. The peaks below are the vendors' datasheet
figures WITHOUT structured sparsity (NVIDIA often quotes the 2x sparse figure first) and, for
GeForce/RTX cards, with fp32 accumulation, which is what PyTorch uses.

An unknown device is not an error: :func:`lookup_peak` returns ``None`` and callers leave MFU out.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["DeviceSpec", "DEVICE_SPECS", "lookup_peak", "estimate_mfu", "precision_key"]


@dataclass(frozen=True)
class DeviceSpec:
    """Datasheet figures for one device. TFLOP/s are dense (no sparsity); ``None`` = unsupported
    in hardware (e.g. bf16 on V100) or not published."""

    name: str
    bf16_tflops: float | None
    fp16_tflops: float | None
    tf32_tflops: float | None
    fp32_tflops: float | None
    fp8_tflops: float | None
    mem_bandwidth_gbs: float  # GB/s (10^9 bytes per second), HBM/GDDR datasheet figure
    memory_gib: float | None = None

    def peak_tflops(self, precision: str = "bf16") -> float | None:
        """Dense peak TFLOP/s for ``precision`` ("bf16", "fp16", "tf32", "fp32", "fp8", or a
        turbotrain precision name like "bf16-mixed"); ``None`` when the device lacks it."""
        return getattr(self, f"{precision_key(precision)}_tflops")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def precision_key(precision: str) -> str:
    """Map a precision name ("bf16-mixed", "fp16", "torch.bfloat16", "tf32", "fp32") to a key of
    :class:`DeviceSpec`'s ``*_tflops`` fields."""
    p = str(precision).lower().removeprefix("torch.")
    if p.startswith(("bf16", "bfloat16")):
        return "bf16"
    if p.startswith(("fp16", "float16", "half", "16-mixed")):
        return "fp16"
    if p.startswith(("fp8", "float8")):
        return "fp8"
    if p.startswith("tf32"):
        return "tf32"
    if p.startswith(("fp32", "float32", "32")):
        return "fp32"
    raise ValueError(f"unknown precision {precision!r}; expected one of bf16, fp16, fp8, tf32, fp32")


def _spec(name: str, bf16, fp16, tf32, fp32, fp8, bw, mem=None) -> DeviceSpec:
    return DeviceSpec(name, bf16, fp16, tf32, fp32, fp8, bw, mem)


# (pattern matched case-insensitively against torch.cuda.get_device_name(), spec); first match wins,
# so the more specific variants come before the generic name. Names seen in the wild:
# "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200",
# "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA A100-PCIE-40GB", "Tesla V100-SXM2-16GB".
DEVICE_SPECS: list[tuple[str, DeviceSpec]] = [
    # Blackwell
    (r"\bB200\b", _spec("NVIDIA B200", 2250, 2250, 1100, 80, 4500, 8000, 180)),
    # Hopper
    (r"\bH200 NVL\b", _spec("NVIDIA H200 NVL", 835, 835, 418, 60, 1671, 4800, 141)),
    (r"\bH200\b", _spec("NVIDIA H200 SXM", 989, 989, 495, 67, 1979, 4800, 141)),
    (r"\bH100 NVL\b", _spec("NVIDIA H100 NVL", 835, 835, 418, 60, 1671, 3900, 94)),
    (r"\bH100\b.*PCIe", _spec("NVIDIA H100 PCIe", 756, 756, 378, 51, 1513, 2000, 80)),
    (r"\bH100\b", _spec("NVIDIA H100 SXM", 989, 989, 495, 67, 1979, 3350, 80)),
    # Ada
    (r"\bL40S\b", _spec("NVIDIA L40S", 362, 362, 183, 91.6, 733, 864, 48)),
    (r"\bL40\b", _spec("NVIDIA L40", 181, 181, 90.5, 90.5, 362, 864, 48)),
    (r"\bL4\b", _spec("NVIDIA L4", 121, 121, 60, 30.3, 242, 300, 24)),
    (r"RTX 4090", _spec("NVIDIA GeForce RTX 4090", 165.2, 165.2, 82.6, 82.6, 330.3, 1008, 24)),
    # Ampere
    (r"\bA100\b.*80GB PCIe|\bA100\b.*PCIE.*80", _spec("NVIDIA A100 80GB PCIe", 312, 312, 156, 19.5, None, 1935, 80)),
    (r"\bA100\b.*PCIE", _spec("NVIDIA A100 40GB PCIe", 312, 312, 156, 19.5, None, 1555, 40)),
    (r"\bA100\b.*80", _spec("NVIDIA A100 80GB SXM", 312, 312, 156, 19.5, None, 2039, 80)),
    (r"\bA100\b", _spec("NVIDIA A100 40GB SXM", 312, 312, 156, 19.5, None, 1555, 40)),
    (r"\bA10\b", _spec("NVIDIA A10", 125, 125, 62.5, 31.2, None, 600, 24)),
    (r"RTX A6000", _spec("NVIDIA RTX A6000", 154.8, 154.8, 77.4, 38.7, None, 768, 48)),
    (r"RTX 3090", _spec("NVIDIA GeForce RTX 3090", 71, 71, 35.6, 35.6, None, 936, 24)),
    # Volta / Turing: no bf16 or tf32 tensor cores (auto precision uses fp16 + GradScaler there)
    (r"\bV100S\b", _spec("NVIDIA V100S PCIe", None, 130, None, 16.4, None, 1134, 32)),
    (r"\bV100\b.*PCIE", _spec("NVIDIA V100 PCIe", None, 112, None, 14, None, 900, 32)),
    (r"\bV100\b", _spec("NVIDIA V100 SXM2", None, 125, None, 15.7, None, 900, 32)),
    (r"\bT4\b", _spec("NVIDIA T4", None, 65, None, 8.1, None, 320, 16)),
]


def lookup_peak(device_name: str | None) -> DeviceSpec | None:
    """The datasheet spec for a device name as ``torch.cuda.get_device_name()`` reports it, or
    ``None`` for an unknown device or a CPU (never an error: callers then omit MFU)."""
    if not device_name:
        return None
    for pattern, spec in DEVICE_SPECS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return spec
    return None


def estimate_mfu(flops_per_s: float, peak: DeviceSpec | float, precision: str = "bf16") -> float:
    """Model FLOPs utilisation as a fraction (0.45 = 45 %).

    ``flops_per_s``: model FLOPs computed per second (e.g. FLOPs per step / step seconds).
    ``peak``: a :class:`DeviceSpec` (its dense peak for ``precision`` is used) or a peak in TFLOP/s.
    Raises ``ValueError`` when the peak is unknown or not positive; look the spec up with
    :func:`lookup_peak` first and skip MFU when it returns ``None``.
    """
    peak_tflops = peak.peak_tflops(precision) if isinstance(peak, DeviceSpec) else peak
    if peak_tflops is None or not peak_tflops > 0:
        raise ValueError(f"no usable peak for precision {precision!r}: {peak!r}")
    return float(flops_per_s) / (float(peak_tflops) * 1e12)
