"""Short speed probes of ``turbotrain doctor --probe``: matmul TFLOP/s and copy GB/s."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ...core.meter.clock import time_call
from ...parts.hardware import cpu_model, lookup_peak


@dataclass(frozen=True)
class ProbeResult:
    """One measurement: ``value`` in ``unit`` (median over repeats) beside the datasheet figure."""

    name: str
    device: str
    value: float
    unit: str
    datasheet: float | None = None  # same unit; None for a CPU or an unknown GPU
    detail: str = ""

    @property
    def fraction_of_datasheet(self) -> float | None:
        return self.value / self.datasheet if self.datasheet else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"fraction_of_datasheet": self.fraction_of_datasheet}


def _median_s(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    return time_call(fn, device, repeats).median / 1000  # the measuring kit's clock, in seconds


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 10) -> float:
    """Achieved TFLOP/s of a ``size`` x ``size`` matrix product (2·size³ FLOPs), median of ``repeats``."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    seconds = _median_s(lambda: torch.matmul(a, b, out=out), device, repeats)
    return 2 * size**3 / seconds / 1e12


def measure_copy_gbs(device: torch.device, mib: int, repeats: int = 10) -> float:
    """Achieved GB/s of a same-device copy of ``mib`` MiB, counting the bytes read and written."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _median_s(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() / seconds / 1e9


def measure_h2d_gbs(device: torch.device, mib: int, repeats: int = 10) -> float:
    """Achieved GB/s of a pinned host-to-device copy of ``mib`` MiB (the PCIe/NVLink-C2C link)."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(src.numel(), dtype=torch.uint8, device=device)
    seconds = _median_s(lambda: dst.copy_(src, non_blocking=True), device, repeats)
    return src.numel() / seconds / 1e9


def run_probes(device: torch.device | str | None = None, *, quick: bool = False) -> list[ProbeResult]:
    """Short speed measurements on ``device`` (default: cuda:0 if present, else cpu); ``quick``
    shrinks sizes for tests. On a CPU no bf16: CPUs without bf16 units run it many times slower."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return _gpu_probes(device, quick) if device.type == "cuda" else _cpu_probes(device, quick)


MATMULS = (("bf16", torch.bfloat16), ("fp32", torch.float32), ("tf32", torch.float32))  # on a GPU


def _gpu_probes(device: torch.device, quick: bool) -> list[ProbeResult]:
    name = torch.cuda.get_device_name(device)
    spec = lookup_peak(name)
    size, mib = (1024, 64) if quick else (8192, 1024)
    results: list[ProbeResult] = []
    for key, dtype in MATMULS:
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            continue
        previous = torch.backends.cuda.matmul.allow_tf32  # TF32 set for this measurement only
        torch.backends.cuda.matmul.allow_tf32 = key == "tf32"
        try:
            value = measure_matmul_tflops(device, dtype, size)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
        sheet = spec.peak_tflops(key) if spec else None
        results.append(
            ProbeResult(f"matmul {key}", name, value, "TFLOP/s", sheet, f"{size}x{size}, median of 10")
        )
    sheet_gbs = spec.mem_bandwidth_gbs if spec else None
    copied = f"{mib} MiB, read + write bytes"
    results.append(ProbeResult("device copy", name, measure_copy_gbs(device, mib), "GB/s", sheet_gbs, copied))
    h2d_mib = min(mib, 256)
    h2d, pinned = measure_h2d_gbs(device, h2d_mib), f"{h2d_mib} MiB pinned, non_blocking"
    results.append(ProbeResult("host-to-device copy", name, h2d, "GB/s", None, pinned))
    torch.cuda.empty_cache()
    return results


def _cpu_probes(device: torch.device, quick: bool) -> list[ProbeResult]:
    name = cpu_model()
    size, mib = (256, 16) if quick else (2048, 256)
    threads = torch.get_num_threads()
    tflops = measure_matmul_tflops(device, torch.float32, size, repeats=5)
    gbs = measure_copy_gbs(device, mib, repeats=5)
    detail = f"{size}x{size}, {threads} thread(s), median of 5"
    copied = f"{mib} MiB, read + write bytes, median of 5"
    return [
        ProbeResult("matmul fp32", name, tflops, "TFLOP/s", None, detail),
        ProbeResult("memory copy", name, gbs, "GB/s", None, copied),
    ]
