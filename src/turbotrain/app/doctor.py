"""``turbotrain doctor``: an environment report to paste into a bug report, checks with fixes, and
short speed probes (matmul TFLOP/s, copy GB/s) beside the datasheet figures.

:func:`collect_env` is read-only and JSON-serialisable (benchmark result files embed it).
:func:`run_checks` turns it into findings, each with a level and the fix. :func:`run_probes`
measures; nothing else here runs device work.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..base.units import GIB
from ..base.version import __version__, collect_git
from ..parts.hardware import collect_nvml, lookup_peak, ram_bytes

LEVELS = ("ok", "info", "warn", "error", "skip")  # skip: could not be checked on this machine

# Packages whose versions matter when a user reports a speed or correctness problem.
PACKAGES = (
    "numpy",
    "rich",
    "matplotlib",
    "nvidia-ml-py",
    "safetensors",
    "triton",
    "tensorboard",
    "accelerate",
    "lightning",
    "optuna",
    "torchao",
)


# ----------------------------------------------------------------------------- environment


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or what platform knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> float | None:
    total, _ = ram_bytes()
    return None if total is None else round(total / GIB, 1)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _nvidia_hardware_present() -> bool:
    """An NVIDIA GPU or driver on this machine, whatever torch says (to catch a CPU-only wheel)."""
    return Path("/proc/driver/nvidia/gpus").is_dir() or Path("/dev/nvidia0").exists()


def _gpu(index: int) -> dict[str, Any]:
    p = torch.cuda.get_device_properties(index)
    cc = (p.major, p.minor)
    spec = lookup_peak(p.name)
    return {
        "index": index,
        "name": p.name,
        "compute_capability": f"{p.major}.{p.minor}",
        "memory_gib": round(p.total_memory / GIB, 2),
        "multiprocessors": p.multi_processor_count,
        "bf16": cc >= (8, 0) and torch.cuda.is_bf16_supported(),
        "tf32": cc >= (8, 0),
        "fp8": cc >= (8, 9),
        "flash_attention": cc >= (8, 0) and torch.backends.cuda.flash_sdp_enabled(),
        "datasheet": spec.to_dict() if spec else None,
    }


def collect_distributed(gpu_count: int) -> dict[str, Any]:
    """What multi-process training can use: the torch.distributed backends built in, GPU pairs
    with peer-to-peer access, and the interconnect matrix ``nvidia-smi topo -m`` prints (NVLink
    vs PCIe), which decides how fast DDP/FSDP's collectives are. Read-only, no device work."""
    out: dict[str, Any] = {
        "available": dist.is_available(),
        "backends": [
            b
            for b, ok in (
                ("nccl", dist.is_available() and dist.is_nccl_available()),
                ("gloo", dist.is_available() and dist.is_gloo_available()),
            )
            if ok
        ],
    }
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


def collect_env() -> dict[str, Any]:
    """The software and hardware this process sees (JSON-serialisable, read-only, no device work).

    Keys: turbotrain, git (the commit), python, platform, torch, cuda (torch's CUDA build), cudnn, nccl, driver,
    cuda_available, gpus (name, compute capability, memory in GiB, bf16/TF32/fp8/flash support,
    datasheet peaks), cpu (model, cores), ram_gib, torch_threads, nvml (status, live GPU state),
    backends (TF32 and cuDNN switches as set now), packages, env (relevant variables).
    """
    cuda_ok = torch.cuda.is_available()
    nccl = None
    if cuda_ok:
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:
            nccl = None
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
        "nccl": nccl,
        "driver": nvml.get("driver"),
        "cuda_available": cuda_ok,
        "gpus": [_gpu(i) for i in range(torch.cuda.device_count())] if cuda_ok else [],
        "nvidia_hardware": _nvidia_hardware_present(),
        "cpu": {
            "model": cpu_model(),
            "logical_cores": os.cpu_count(),
            "usable_cores": _usable_cores(),
            "capability": torch.backends.cpu.get_cpu_capability(),
        },
        "ram_gib": _ram_gib(),
        "torch_threads": torch.get_num_threads(),
        "nvml": nvml,
        "distributed": collect_distributed(torch.cuda.device_count() if cuda_ok else 0),
        "backends": {
            "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_tf32": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
        },
        "packages": _package_versions(),
        "env": {
            k: os.environ[k]
            for k in (
                "CUDA_VISIBLE_DEVICES",
                "OMP_NUM_THREADS",
                "PYTORCH_CUDA_ALLOC_CONF",
                "TORCH_COMPILE_DISABLE",
                "NCCL_DEBUG",
            )
            if k in os.environ
        },
    }


def collect_hardware(device: torch.device | str) -> dict[str, Any]:
    """A compact description of the device a run used, for summaries and result files: its name,
    datasheet peaks (None for a CPU or an unknown GPU), the CPU, and torch/CUDA/driver versions."""
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
        out.update(
            name=gpu["name"],
            compute_capability=gpu["compute_capability"],
            memory_gib=gpu["memory_gib"],
            datasheet=gpu["datasheet"],
            driver=collect_nvml().get("driver"),
        )
    else:
        out.update(name=out["cpu"], datasheet=None)
    return out


# ----------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class Check:
    """One finding: ``level`` in LEVELS, a one-line ``finding`` and the ``fix`` (empty when ok)."""

    name: str
    level: str
    finding: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


GPU_ONLY = "needs a CUDA GPU"


def fp8_check(gpus: list[dict[str, Any]], torchao: str | None) -> Check:
    """FP8 training (precision.mode = fp8): float8 tensor cores (compute capability >= 8.9) and torchao."""
    emulate = "--precision.fp8_emulate=true runs it emulated, for correctness tests only"
    if not gpus:
        return Check(
            "FP8",
            "skip",
            f"{GPU_ONLY}; "
            + (
                f"torchao {torchao} is installed: {emulate}" if torchao else "torchao is not installed either"
            ),
            "" if torchao else "pip install 'turbotrain[fp8]'",
        )
    old = [g for g in gpus if not g["fp8"]]
    if old:
        return Check(
            "FP8",
            "info",
            f"{old[0]['name']} (compute capability {old[0]['compute_capability']}) has no float8 tensor "
            f"cores (>= 8.9): precision.mode = fp8 is refused; {emulate}",
        )
    if torchao is None:
        return Check(
            "FP8",
            "warn",
            "float8 tensor cores present, but torchao is not installed: precision.mode = fp8 is refused",
            "pip install 'turbotrain[fp8]' (torchao 0.17 or later for torch 2.11+)",
        )
    return Check(
        "FP8",
        "ok",
        f"float8 tensor cores and torchao {torchao}: --precision.mode=fp8 runs (with torch.compile for "
        "the speed; auto never picks it)",
    )


def run_checks(env: dict[str, Any]) -> list[Check]:
    """Findings for ``env`` (from :func:`collect_env`), most important first within each topic.

    Without a GPU, the GPU checks come back with level "skip" saying what could not be checked.
    """
    checks: list[Check] = []
    add = checks.append
    gpus = env["gpus"]
    cores = env["cpu"]["usable_cores"]

    # torch build vs hardware
    if not env["cuda_available"]:
        if env["nvidia_hardware"] and not env["cuda"]:
            add(
                Check(
                    "torch CUDA build",
                    "error",
                    f"this machine has an NVIDIA GPU but torch {env['torch']} is a CPU-only build",
                    "pip install torch --index-url https://download.pytorch.org/whl/cu126 (pick your CUDA at pytorch.org)",
                )
            )
        elif env["cuda"]:
            visible = env["env"].get("CUDA_VISIBLE_DEVICES")
            add(
                Check(
                    "CUDA device",
                    "warn",
                    f"torch is built for CUDA {env['cuda']} but sees no GPU"
                    + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""),
                    "check the driver with nvidia-smi and CUDA_VISIBLE_DEVICES; the driver must be new enough for this CUDA",
                )
            )
        else:
            add(
                Check(
                    "CUDA device",
                    "info",
                    f"no CUDA GPU; torch {env['torch']} is a CPU build: training runs on CPU in fp32",
                    "on a GPU machine install a CUDA build of torch",
                )
            )
    else:
        names = ", ".join(sorted({g["name"] for g in gpus}))
        add(
            Check(
                "CUDA device",
                "ok",
                f"{len(gpus)} GPU(s): {names}; CUDA {env['cuda']}, cuDNN {env['cudnn']}, driver {env['driver']}",
            )
        )

    # precision support
    if gpus:
        old = [g for g in gpus if not g["bf16"]]
        if old:
            add(
                Check(
                    "bf16",
                    "warn",
                    f"{old[0]['name']} (compute capability {old[0]['compute_capability']}) has no bf16: "
                    "precision auto will use fp16-mixed with a GradScaler",
                    "nothing to do; fp16 + loss scaling is handled, or use a GPU with compute capability >= 8.0 for bf16",
                )
            )
        else:
            add(Check("bf16", "ok", "bf16 supported: precision auto uses bf16-mixed"))
        add(fp8_check(gpus, env["packages"].get("torchao")))
        if all(g["tf32"] for g in gpus):
            if env["backends"]["matmul_tf32"] or env["backends"]["float32_matmul_precision"] != "highest":
                add(Check("TF32", "ok", "TF32 matmuls are on for fp32 work"))
            else:
                add(
                    Check(
                        "TF32",
                        "info",
                        "TF32 is off in this process for fp32 matmuls (torch's default); turbotrain runs turn it on "
                        "(precision.tf32 = true)",
                        "in your own loop: torch.set_float32_matmul_precision('high')",
                    )
                )
        else:
            add(Check("TF32", "info", "this GPU has no TF32 tensor cores (compute capability < 8.0)"))
        if all(g["flash_attention"] for g in gpus):
            add(
                Check(
                    "flash attention",
                    "ok",
                    "SDPA flash attention kernels available (model.attention = 'sdpa')",
                )
            )
        else:
            add(
                Check(
                    "flash attention",
                    "info",
                    "no flash attention kernel here (needs compute capability >= 8.0 and the "
                    "flash SDPA backend enabled); SDPA falls back to memory-efficient or math kernels",
                )
            )
        if env["packages"].get("triton") is None:
            add(
                Check(
                    "torch.compile",
                    "warn",
                    "triton is not installed: torch.compile cannot generate GPU kernels",
                    "pip install triton, or run with --compile.scope=off",
                )
            )
    else:
        add(
            Check(
                "bf16",
                "skip",
                f"{GPU_ONLY}; on CPU precision auto uses fp32 (bf16 autocast is often many times slower there)",
            )
        )
        add(Check("TF32", "skip", f"{GPU_ONLY} (TF32 is a tensor-core format)"))
        add(fp8_check([], env["packages"].get("torchao")))
        add(Check("flash attention", "skip", f"{GPU_ONLY}; on CPU SDPA uses its CPU kernels"))

    # NVML and a busy GPU
    nvml = env["nvml"]
    if not nvml["available"]:
        level = "warn" if gpus else "skip"
        add(
            Check(
                "NVML",
                level,
                nvml["detail"] + ("" if gpus else "; GPU utilisation, power and temperature are not sampled"),
                "install nvidia-ml-py and an NVIDIA driver" if gpus else "",
            )
        )
        if not gpus:
            add(Check("GPU busy", "skip", f"{GPU_ONLY} and NVML"))
    else:
        add(
            Check(
                "NVML",
                "ok",
                f"NVML works (driver {nvml.get('driver')}): utilisation, power and temperature are sampled",
            )
        )
        busy = [
            g
            for g in nvml.get("gpus", [])
            if (g.get("util_pct") or 0) > 10 or len(g.get("processes", [])) > 0
        ]
        if busy:
            g = busy[0]
            add(
                Check(
                    "GPU busy",
                    "warn",
                    f"{g['name']} (NVML index {g['nvml_index']}) is already in use: {g.get('util_pct')}% "
                    f"utilisation, {len(g.get('processes', []))} process(es), {g.get('mem_used_gib')} GiB used",
                    "stop the other jobs or pick a free GPU with CUDA_VISIBLE_DEVICES; shared GPUs give slower, noisy runs",
                )
            )
        else:
            add(Check("GPU busy", "ok", "no other process is using the GPU(s)"))

    # CPU side: data loading and threads
    if gpus:
        per_gpu = cores // max(1, len(gpus))
        workers = max(1, min(8, cores // 2))
        if per_gpu < 4:
            add(
                Check(
                    "DataLoader workers",
                    "warn",
                    f"only {cores} usable CPU core(s) for {len(gpus)} GPU(s): "
                    f"about {per_gpu} per GPU, too few for DataLoader workers to keep up with a fast GPU",
                    "use a pre-tokenized .bin dataset (memory-mapped, cheap to load) or a machine with more cores",
                )
            )
        else:
            add(
                Check(
                    "DataLoader workers",
                    "ok",
                    f"{cores} usable cores: data.num_workers auto will use {workers} per process",
                )
            )
    else:
        add(
            Check(
                "DataLoader workers",
                "info",
                f"{cores} usable CPU core(s); on CPU batches load in the training process "
                "when there are 4 cores or fewer (workers would compete with the compute threads)",
            )
        )
    threads = env["torch_threads"]
    if threads > cores:
        add(
            Check(
                "torch threads",
                "warn",
                f"torch uses {threads} threads but only {cores} cores are usable: oversubscribed",
                f"export OMP_NUM_THREADS={cores} or call torch.set_num_threads({cores})",
            )
        )
    else:
        add(Check("torch threads", "ok", f"torch uses {threads} of {cores} usable core(s) for CPU ops"))
    return checks


# ----------------------------------------------------------------------------- probes


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
        d = asdict(self)
        d["fraction_of_datasheet"] = self.fraction_of_datasheet
        return d


def _time_median_s(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in seconds, synchronizing the device around each call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    for _ in range(warmup):
        fn()
    sync()  # host-device sync point (probe timing only)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()  # host-device sync point (probe timing only)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 10) -> float:
    """Achieved TFLOP/s of a ``size`` x ``size`` matrix product (2·size³ FLOPs), median of ``repeats``."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    seconds = _time_median_s(lambda: torch.matmul(a, b, out=out), device, repeats)
    return 2 * size**3 / seconds / 1e12


def measure_copy_gbs(device: torch.device, mib: int, repeats: int = 10) -> float:
    """Achieved GB/s of a same-device copy of ``mib`` MiB, counting the bytes read and written."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _time_median_s(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() / seconds / 1e9


def measure_h2d_gbs(device: torch.device, mib: int, repeats: int = 10) -> float:
    """Achieved GB/s of a pinned host-to-device copy of ``mib`` MiB (the PCIe/NVLink-C2C link)."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(src.numel(), dtype=torch.uint8, device=device)
    seconds = _time_median_s(lambda: dst.copy_(src, non_blocking=True), device, repeats)
    return src.numel() / seconds / 1e9


def run_probes(device: torch.device | str | None = None, *, quick: bool = False) -> list[ProbeResult]:
    """Short speed measurements on ``device`` (default: cuda:0 if present, else cpu).

    GPU: bf16 and fp32 (and TF32) 8192² matmuls, a 1 GiB device copy and a pinned host-to-device
    copy, each beside the datasheet figure. CPU: an fp32 matmul and a memory copy (no datasheet;
    bf16 is skipped because CPUs without bf16 units run it many times slower than fp32).
    ``quick`` shrinks sizes for tests. Takes a few seconds.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    results: list[ProbeResult] = []
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        spec = lookup_peak(name)
        size, mib = (1024, 64) if quick else (8192, 1024)
        for label, dtype, key, tf32 in (
            ("matmul bf16", torch.bfloat16, "bf16", False),
            ("matmul fp32", torch.float32, "fp32", False),
            ("matmul tf32", torch.float32, "tf32", True),
        ):
            if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
                continue
            previous = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = tf32
            try:
                value = measure_matmul_tflops(device, dtype, size)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = previous
            results.append(
                ProbeResult(
                    label,
                    name,
                    value,
                    "TFLOP/s",
                    spec.peak_tflops(key) if spec else None,
                    f"{size}x{size}, median of 10",
                )
            )
        results.append(
            ProbeResult(
                "device copy",
                name,
                measure_copy_gbs(device, mib),
                "GB/s",
                spec.mem_bandwidth_gbs if spec else None,
                f"{mib} MiB, read + write bytes",
            )
        )
        results.append(
            ProbeResult(
                "host-to-device copy",
                name,
                measure_h2d_gbs(device, min(mib, 256)),
                "GB/s",
                None,
                f"{min(mib, 256)} MiB pinned, non_blocking",
            )
        )
        torch.cuda.empty_cache()
    else:
        name = cpu_model()
        size, mib = (256, 16) if quick else (2048, 256)
        threads = torch.get_num_threads()
        results.append(
            ProbeResult(
                "matmul fp32",
                name,
                measure_matmul_tflops(device, torch.float32, size, repeats=5),
                "TFLOP/s",
                None,
                f"{size}x{size}, {threads} thread(s), median of 5",
            )
        )
        results.append(
            ProbeResult(
                "memory copy",
                name,
                measure_copy_gbs(device, mib, repeats=5),
                "GB/s",
                None,
                f"{mib} MiB, read + write bytes, median of 5",
            )
        )
    return results


# ----------------------------------------------------------------------------- report


def build_report(*, probe: bool = False) -> dict[str, Any]:
    """Everything ``turbotrain doctor`` prints: ``{"env": ..., "checks": [...], "probes": [...]}``."""
    env = collect_env()
    report: dict[str, Any] = {"env": env, "checks": [c.to_dict() for c in run_checks(env)]}
    if probe:
        report["probes"] = [p.to_dict() for p in run_probes()]
    return report


def _num(value: float) -> str:
    """798 or 0.0612: whole numbers from 100 up, three significant digits below."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def format_report(report: dict[str, Any]) -> str:
    """Plain text (Markdown-friendly) to paste into a bug report."""
    env = report["env"]
    cpu = env["cpu"]
    lines = [
        "## turbotrain doctor",
        "",
        "### Environment",
        f"- turbotrain: {env['turbotrain']}",
        f"- Python: {env['python']} ({env['platform']})",
        f"- torch: {env['torch']} (CUDA build: {env['cuda'] or 'none'}, cuDNN: {env['cudnn'] or 'n/a'}, NCCL: {env['nccl'] or 'n/a'})",
        f"- NVIDIA driver: {env['driver'] or 'n/a'}",
        f"- CPU: {cpu['model']}, {cpu['usable_cores']} usable of {cpu['logical_cores']} logical cores "
        f"({cpu['capability']}), torch threads {env['torch_threads']}",
        f"- RAM: {env['ram_gib']} GiB",
        f"- NVML: {'ok' if env['nvml']['available'] else env['nvml']['detail']}",
    ]
    if env["gpus"]:
        for g in env["gpus"]:
            feats = ", ".join(
                f"{k} {'yes' if g[k] else 'no'}" for k in ("bf16", "tf32", "fp8", "flash_attention")
            )
            lines.append(
                f"- GPU {g['index']}: {g['name']}, compute capability {g['compute_capability']}, "
                f"{g['memory_gib']} GiB; {feats}"
            )
            spec = g["datasheet"]
            lines.append(
                f"    datasheet: {spec['bf16_tflops']} TFLOP/s bf16 dense, {spec['mem_bandwidth_gbs']:.0f} GB/s"
                if spec
                else "    datasheet: unknown device (MFU will be left out)"
            )
    else:
        lines.append("- GPUs: none visible to torch")
    d = env["distributed"]
    lines.append(
        f"- torch.distributed: {', '.join(d['backends']) or 'unavailable'}"
        + (f"; P2P {', '.join(k for k, ok in d['p2p'].items() if ok) or 'none'}" if d.get("p2p") else "")
    )
    if d.get("topology"):
        lines += [
            "- GPU interconnect (nvidia-smi topo -m):",
            *(f"    {row}" for row in d["topology"].splitlines()),
        ]
    installed = ", ".join(f"{k} {v}" for k, v in env["packages"].items() if v)
    lines.append(f"- packages: {installed}")
    if env["env"]:
        lines.append("- env: " + ", ".join(f"{k}={v}" for k, v in env["env"].items()))
    lines += ["", "### Checks"]
    marks = {"ok": "OK  ", "info": "INFO", "warn": "WARN", "error": "FAIL", "skip": "SKIP"}
    for c in report["checks"]:
        lines.append(f"- [{marks[c['level']]}] {c['name']}: {c['finding']}")
        if c["fix"]:
            lines.append(f"    fix: {c['fix']}")
    skipped = [c["name"] for c in report["checks"] if c["level"] == "skip"]
    if skipped:
        lines.append(f"Not checked on this machine (no GPU/NVML): {', '.join(skipped)}.")
    if "probes" in report:
        lines += ["", "### Probes (median)"]
        for p in report["probes"]:
            sheet = p["datasheet"]
            beside = (
                f" vs datasheet {_num(sheet)} {p['unit']} ({100 * p['fraction_of_datasheet']:.0f}%)"
                if sheet
                else " (no datasheet figure)"
            )
            lines.append(f"- {p['name']}: {_num(p['value'])} {p['unit']}{beside} [{p['detail']}]")
    return "\n".join(lines)
