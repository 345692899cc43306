"""Datasheet peaks of common accelerators, looked up from the device name, and MFU (model FLOPs
utilisation, PaLM convention: model FLOPs per second over the dense peak of the precision in use).
The peaks are the vendors' figures WITHOUT structured sparsity (NVIDIA often quotes the 2x sparse
one first) and, for GeForce/RTX cards, with fp32 accumulation, which PyTorch uses. An unknown
device is not an error: :func:`lookup_peak` returns ``None`` and callers leave MFU out.

Also the NVML access of ``turbotrain doctor`` and the monitor's sampler (nvidia-ml-py, imported
lazily: without it, or without a driver, NVML reports "unavailable").
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import asdict, dataclass
from typing import Any


def ram_bytes() -> tuple[int | None, int | None]:
    """This machine's (total, available) RAM in bytes; None where the OS does not say."""
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return int(os.sysconf("SC_PHYS_PAGES") * page), int(os.sysconf("SC_AVPHYS_PAGES") * page)
    except (ValueError, OSError, AttributeError):
        return None, None


def device_total_bytes(device: Any) -> int | None:
    """A ``torch.device``'s memory in bytes: CUDA total, CPU physical RAM; None for meta."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return ram_bytes()[0] if device.type == "cpu" else None


def process_rss_bytes() -> int | None:
    """This process's resident memory now (RSS, bytes): one read of ``/proc/self/statm`` (~10 us,
    no sync); None where the OS has no such file (the peak is ``resource.getrusage``'s)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def device_line(device: Any, precision: str, compile_scope: str) -> str:
    """The one line a run prints when it starts: the device, the precision and what is compiled."""
    import torch

    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        what = f"{p.name} ({device}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB)"
    else:
        total = device_total_bytes(device)
        memory = f", {total / 2**30:.1f} GiB RAM" if total else ""
        what = f"{device} ({cpu_model()}, {os.cpu_count()} cores{memory})"
    return f"device {what}; precision {precision}; compile {compile_scope}"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or what platform knows)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def device_name(device: Any) -> str:
    """The GPU's name as CUDA reports it, or the CPU's model name (what a measurement ran on)."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


@dataclass(frozen=True)
class DeviceSpec:
    """Datasheet figures for one device: dense TFLOP/s, ``None`` = unsupported or not published."""

    name: str
    bf16_tflops: float | None
    fp16_tflops: float | None
    tf32_tflops: float | None
    fp32_tflops: float | None
    fp8_tflops: float | None
    mem_bandwidth_gbs: float  # GB/s (10^9 bytes per second), HBM/GDDR datasheet figure
    memory_gib: float | None = None

    def peak_tflops(self, precision: str = "bf16") -> float | None:
        """Dense peak TFLOP/s for ``precision`` (a peak key or a precision name); ``None``: lacking."""
        return getattr(self, f"{precision_key(precision)}_tflops")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PEAK_KEYS: dict[str, str] = {}
"""Registered precision name -> peak key ("bf16", "fp16", "fp8", "tf32", "fp32"): each precision
plugin says which datasheet peak its MFU is measured against (:func:`register_peak`)."""

PEAK_NAMES = ("bf16", "fp16", "fp8", "tf32", "fp32")


def register_peak(name: str, key: str) -> None:
    """Precision ``name`` is measured against the ``key`` peak (a plugin's ``peak`` attribute)."""
    if key not in PEAK_NAMES:
        raise ValueError(f"peak {key!r} for precision {name!r}: expected one of {', '.join(PEAK_NAMES)}")
    PEAK_KEYS[name] = key


_PEAK_PREFIXES = (
    (("bf16", "bfloat16"), "bf16"),
    (("fp16", "float16", "half", "16-mixed"), "fp16"),
    (("fp8", "float8"), "fp8"),
    (("tf32",), "tf32"),
    (("fp32", "float32", "32"), "fp32"),
)


def precision_key(precision: Any, *, tf32: bool = False) -> str:
    """The one precision-to-peak map: a precision name or a dtype to a key of :class:`DeviceSpec`'s
    ``*_tflops`` fields; fp32 work counts at the TF32 peak when ``tf32`` (:func:`tf32_enabled`)."""
    p = str(precision).lower().removeprefix("torch.")
    key = PEAK_KEYS.get(str(precision)) or next((k for pre, k in _PEAK_PREFIXES if p.startswith(pre)), None)
    if key is None:
        raise ValueError(f"unknown precision {precision!r}; expected one of bf16, fp16, fp8, tf32, fp32")
    return "tf32" if key == "fp32" and tf32 else key


def tf32_enabled(conv: bool = False) -> bool:
    """Whether float32 matmuls (with ``conv``, also cuDNN convolutions) run on TF32 tensor cores now."""
    import torch

    return (
        torch.backends.cuda.matmul.allow_tf32
        or torch.get_float32_matmul_precision() != "highest"
        or (conv and torch.backends.cudnn.allow_tf32)
    )


# (pattern matched case-insensitively against torch.cuda.get_device_name(), spec); the first match
# wins, so specific variants ("NVIDIA H100 PCIe", "NVIDIA A100-PCIE-40GB") come before the generic.
DEVICE_SPECS: list[tuple[str, DeviceSpec]] = [
    # Blackwell
    (r"\bB200\b", DeviceSpec("NVIDIA B200", 2250, 2250, 1100, 80, 4500, 8000, 180)),
    # Hopper
    (r"\bH200 NVL\b", DeviceSpec("NVIDIA H200 NVL", 835, 835, 418, 60, 1671, 4800, 141)),
    (r"\bH200\b", DeviceSpec("NVIDIA H200 SXM", 989, 989, 495, 67, 1979, 4800, 141)),
    (r"\bH100 NVL\b", DeviceSpec("NVIDIA H100 NVL", 835, 835, 418, 60, 1671, 3900, 94)),
    (r"\bH100\b.*PCIe", DeviceSpec("NVIDIA H100 PCIe", 756, 756, 378, 51, 1513, 2000, 80)),
    (r"\bH100\b", DeviceSpec("NVIDIA H100 SXM", 989, 989, 495, 67, 1979, 3350, 80)),
    # Ada
    (r"\bL40S\b", DeviceSpec("NVIDIA L40S", 362, 362, 183, 91.6, 733, 864, 48)),
    (r"\bL40\b", DeviceSpec("NVIDIA L40", 181, 181, 90.5, 90.5, 362, 864, 48)),
    (r"\bL4\b", DeviceSpec("NVIDIA L4", 121, 121, 60, 30.3, 242, 300, 24)),
    (r"RTX 4090", DeviceSpec("NVIDIA GeForce RTX 4090", 165.2, 165.2, 82.6, 82.6, 330.3, 1008, 24)),
    # Ampere
    (
        r"\bA100\b.*80GB PCIe|\bA100\b.*PCIE.*80",
        DeviceSpec("NVIDIA A100 80GB PCIe", 312, 312, 156, 19.5, None, 1935, 80),
    ),
    (r"\bA100\b.*PCIE", DeviceSpec("NVIDIA A100 40GB PCIe", 312, 312, 156, 19.5, None, 1555, 40)),
    (r"\bA100\b.*80", DeviceSpec("NVIDIA A100 80GB SXM", 312, 312, 156, 19.5, None, 2039, 80)),
    (r"\bA100\b", DeviceSpec("NVIDIA A100 40GB SXM", 312, 312, 156, 19.5, None, 1555, 40)),
    (r"\bA10\b", DeviceSpec("NVIDIA A10", 125, 125, 62.5, 31.2, None, 600, 24)),
    (r"RTX A6000", DeviceSpec("NVIDIA RTX A6000", 154.8, 154.8, 77.4, 38.7, None, 768, 48)),
    (r"RTX 3090", DeviceSpec("NVIDIA GeForce RTX 3090", 71, 71, 35.6, 35.6, None, 936, 24)),
    # Volta / Turing: no bf16 or tf32 tensor cores (auto precision uses fp16 + GradScaler there)
    (r"\bV100S\b", DeviceSpec("NVIDIA V100S PCIe", None, 130, None, 16.4, None, 1134, 32)),
    (r"\bV100\b.*PCIE", DeviceSpec("NVIDIA V100 PCIe", None, 112, None, 14, None, 900, 32)),
    (r"\bV100\b", DeviceSpec("NVIDIA V100 SXM2", None, 125, None, 15.7, None, 900, 32)),
    (r"\bT4\b", DeviceSpec("NVIDIA T4", None, 65, None, 8.1, None, 320, 16)),
]


def lookup_peak(device_name: str | None) -> DeviceSpec | None:
    """The datasheet spec for a ``torch.cuda.get_device_name()``, or ``None`` (unknown, a CPU)."""
    if not device_name:
        return None
    for pattern, spec in DEVICE_SPECS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return spec
    return None


def estimate_mfu(flops_per_s: float, peak: DeviceSpec | float, precision: str = "bf16") -> float:
    """Model FLOPs utilisation as a fraction (0.45 = 45 %) of model FLOPs per second against
    ``peak`` (a :class:`DeviceSpec`'s dense peak for ``precision``, or TFLOP/s); ``ValueError``
    when the peak is unknown or not positive."""
    peak_tflops = peak.peak_tflops(precision) if isinstance(peak, DeviceSpec) else peak
    if peak_tflops is None or not peak_tflops > 0:
        raise ValueError(f"no usable peak for precision {precision!r}: {peak!r}")
    return float(flops_per_s) / (float(peak_tflops) * 1e12)


_NVML: dict[str, Any] = {}  # {"module": pynvml or None, "detail": why not}


def nvml() -> tuple[Any, str]:
    """The initialised ``pynvml`` module (nvidia-ml-py) and "ok", or ``(None, reason)`` when the
    package or the driver's NVML library is missing. Initialised once per process."""
    if not _NVML:
        try:
            import pynvml

            pynvml.nvmlInit()
            _NVML.update(module=pynvml, detail="ok")
        except ImportError:
            _NVML.update(module=None, detail="nvidia-ml-py is not installed (pip install nvidia-ml-py)")
        except Exception as exc:  # pynvml.NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            _NVML.update(module=None, detail=f"NVML unavailable: {exc} (no NVIDIA driver on this machine?)")
    return _NVML["module"], _NVML["detail"]


def nvml_handle(cuda_index: int = 0) -> Any:
    """NVML handle of CUDA device ``cuda_index`` (by PCI bus id: right under CUDA_VISIBLE_DEVICES), or None."""
    pynvml, _ = nvml()
    if pynvml is None:
        return None
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(cuda_index)
            # torch's stub of _CudaDeviceProperties lacks the pci_* fields the CUDA build has (2.5+)
            bus = f"{p.pci_domain_id:08x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"  # type: ignore[attr-defined]
            return pynvml.nvmlDeviceGetHandleByPciBusId(bus)
    except Exception:
        pass
    try:
        return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)
    except Exception:
        return None


def _try(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:
        return None


def collect_nvml_device(handle: Any) -> dict[str, Any]:
    """One GPU's live state from NVML; fields NVML refuses are left out."""
    pynvml, _ = nvml()
    out: dict[str, Any] = {}
    util = _try(pynvml.nvmlDeviceGetUtilizationRates, handle)
    if util is not None:
        out["util_pct"], out["mem_util_pct"] = util.gpu, util.memory
    mem = _try(pynvml.nvmlDeviceGetMemoryInfo, handle)
    if mem is not None:
        out["mem_used_gib"], out["mem_total_gib"] = round(mem.used / 2**30, 3), round(mem.total / 2**30, 3)
    for key, fn, *args in (
        ("power_w", pynvml.nvmlDeviceGetPowerUsage),  # mW
        ("power_limit_w", pynvml.nvmlDeviceGetEnforcedPowerLimit),
        ("temp_c", pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU),
        ("sm_clock_mhz", pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_SM),
        ("mem_clock_mhz", pynvml.nvmlDeviceGetClockInfo, pynvml.NVML_CLOCK_MEM),
        ("max_sm_clock_mhz", pynvml.nvmlDeviceGetMaxClockInfo, pynvml.NVML_CLOCK_SM),
    ):
        value = _try(fn, handle, *args)
        if value is not None:
            out[key] = value / 1000 if key.startswith("power") else value
    procs = _try(pynvml.nvmlDeviceGetComputeRunningProcesses, handle)
    if procs is not None:
        out["processes"] = [
            {"pid": p.pid, "mem_gib": round((p.usedGpuMemory or 0) / 2**30, 3)} for p in procs
        ]
    return out


def collect_nvml() -> dict[str, Any]:
    """NVML status for ``turbotrain doctor``: driver version and every GPU NVML sees."""
    pynvml, detail = nvml()
    if pynvml is None:
        return {"available": False, "detail": detail}
    out: dict[str, Any] = {"available": True, "detail": detail}
    driver = _try(pynvml.nvmlSystemGetDriverVersion)
    out["driver"] = driver.decode() if isinstance(driver, bytes) else driver
    cuda = _try(pynvml.nvmlSystemGetCudaDriverVersion)
    if cuda:
        out["driver_cuda"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
    gpus = []
    for i in range(_try(pynvml.nvmlDeviceGetCount) or 0):
        handle = _try(pynvml.nvmlDeviceGetHandleByIndex, i)
        if handle is None:
            continue
        name = _try(pynvml.nvmlDeviceGetName, handle)
        name = name.decode() if isinstance(name, bytes) else name
        gpus.append({"nvml_index": i, "name": name, **collect_nvml_device(handle)})
    out["gpus"] = gpus
    return out
