"""The environment a run or a report records (read-only, JSON-serialisable): ``turbotrain doctor``
prints :func:`collect_env`, benchmark result files embed it, a run's summary records
:func:`collect_hardware`."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..base.units import GIB
from ..base.version import __version__, collect_git, package_version
from ..core.precision import DeviceCaps
from ..core.precision.fp8 import float8_capable
from ..parts.hardware import collect_nvml, cpu_model, lookup_peak, ram_bytes

# Packages whose versions matter when a user reports a speed or correctness problem.
PACKAGES = tuple(
    "numpy rich matplotlib nvidia-ml-py safetensors triton tensorboard accelerate lightning optuna torchao".split()
)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _gpu(index: int) -> dict[str, Any]:
    p = torch.cuda.get_device_properties(index)
    cc = (p.major, p.minor)
    caps = DeviceCaps.of(torch.device("cuda", index))  # what the precision plugins ask of the device
    spec = lookup_peak(p.name)
    return {
        "index": index,
        "name": p.name,
        "compute_capability": f"{p.major}.{p.minor}",
        "memory_gib": round(p.total_memory / GIB, 2),
        "multiprocessors": p.multi_processor_count,
        "bf16": caps.bf16,
        "tf32": cc >= (8, 0),
        "fp8": float8_capable(caps),  # the fp8 plugin's rule
        "flash_attention": cc >= (8, 0) and torch.backends.cuda.flash_sdp_enabled(),
        "datasheet": spec.to_dict() if spec else None,
    }


def collect_distributed(gpu_count: int) -> dict[str, Any]:
    """What multi-process training can use: backends built in, GPU peer access, ``nvidia-smi topo -m``."""
    ok = dist.is_available()
    backends = [
        b
        for b, built in (("nccl", ok and dist.is_nccl_available()), ("gloo", ok and dist.is_gloo_available()))
        if built
    ]
    out: dict[str, Any] = {"available": ok, "backends": backends}
    if gpu_count > 1:
        out["p2p"] = {
            f"{a}->{b}": torch.cuda.can_device_access_peer(a, b)
            for a in range(gpu_count)
            for b in range(gpu_count)
            if a != b
        }
    if shutil.which("nvidia-smi"):
        try:
            proc = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=10)
            out["topology"] = proc.stdout.strip() if proc.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            out["topology"] = None
    return out


# the environment variables a bug report shows (those set)
ENV_VARS = tuple(
    "CUDA_VISIBLE_DEVICES OMP_NUM_THREADS PYTORCH_CUDA_ALLOC_CONF TORCH_COMPILE_DISABLE NCCL_DEBUG".split()
)


def collect_env() -> dict[str, Any]:
    """The software and hardware this process sees (JSON-serialisable, read-only, no device work)."""
    cuda_ok = torch.cuda.is_available()
    nvml = collect_nvml()
    return {
        "turbotrain": __version__,
        "git": collect_git(),  # the commit (TT_COMMIT where the tree came without .git)
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": _nccl_version() if cuda_ok else None,
        "driver": nvml.get("driver"),
        "cuda_available": cuda_ok,
        "gpus": [_gpu(i) for i in range(torch.cuda.device_count())] if cuda_ok else [],
        # an NVIDIA GPU or driver, whatever torch says (to catch a CPU-only wheel)
        "nvidia_hardware": Path("/proc/driver/nvidia/gpus").is_dir() or Path("/dev/nvidia0").exists(),
        "cpu": {
            "model": cpu_model(),
            "logical_cores": os.cpu_count(),
            "usable_cores": _usable_cores(),
            "capability": torch.backends.cpu.get_cpu_capability(),
        },
        "ram_gib": None if (ram := ram_bytes()[0]) is None else round(ram / GIB, 1),
        "torch_threads": torch.get_num_threads(),
        "nvml": nvml,
        "distributed": collect_distributed(torch.cuda.device_count() if cuda_ok else 0),
        "backends": {
            "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
        },
        "packages": {name: package_version(name) for name in PACKAGES},
        "env": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
    }


def _nccl_version() -> str | None:
    """The NCCL torch was built with ("2.21.5"), or None where it cannot say."""
    try:
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:
        return None


def collect_hardware(device: torch.device | str) -> dict[str, Any]:
    """The device a run used (summaries, result files): name, datasheet peaks or None, CPU, versions."""
    device = torch.device(device)
    out: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu": cpu_model(),
        "cpu_cores": _usable_cores(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        gpu = _gpu(device.index if device.index is not None else torch.cuda.current_device())
        out.update({k: gpu[k] for k in ("name", "compute_capability", "memory_gib", "datasheet")})
        out["driver"] = collect_nvml().get("driver")
    else:
        out.update(name=out["cpu"], datasheet=None)
    return out
