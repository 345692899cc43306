"""The checks of ``turbotrain doctor``: findings from the environment, each with a level and the fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from ...core.precision.fp8 import MIN_CAPABILITY
from ...parts.data.loader import default_num_workers

LEVELS = ("ok", "info", "warn", "error", "skip")  # skip: could not be checked on this machine


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
    """FP8 training (precision.mode = fp8): float8 tensor cores and torchao."""
    emulate = "--precision.fp8_emulate=true runs it emulated, for correctness tests only"
    install = "pip install 'turbotrain[fp8]'"
    if not gpus:
        found = f"torchao {torchao} is installed: {emulate}" if torchao else "torchao is not installed either"
        return Check("FP8", "skip", f"{GPU_ONLY}; {found}", "" if torchao else install)
    old = [g for g in gpus if not g["fp8"]]
    if old:
        needed = ".".join(map(str, MIN_CAPABILITY))
        no = f"{_gpu(old[0])} has no float8 tensor cores (>= {needed}): precision.mode = fp8 is refused; "
        return Check("FP8", "info", no + emulate)
    if torchao is None:
        missing = "float8 tensor cores present, but torchao is not installed: precision.mode = fp8 is refused"
        return Check("FP8", "warn", missing, f"{install} (torchao 0.17 or later for torch 2.11+)")
    runs = f"float8 tensor cores and torchao {torchao}: --precision.mode=fp8 runs (with torch.compile for "
    return Check("FP8", "ok", runs + "the speed; auto never picks it)")


def _gpu(g: dict[str, Any]) -> str:
    return f"{g['name']} (compute capability {g['compute_capability']})"


def run_checks(env: dict[str, Any]) -> list[Check]:
    """Findings for ``env``, most important first within each topic; without a GPU the GPU checks
    are "skip", saying what could not be checked."""
    return [
        _device_check(env),
        *(_gpu_precision_checks(env) if env["gpus"] else _cpu_precision_checks(env)),
        *_nvml_checks(env),
        _workers_check(env),
        _threads_check(env),
    ]


def _device_check(env: dict[str, Any]) -> Check:
    """The torch build against the hardware: a CUDA build that sees the GPU(s)."""
    if env["cuda_available"]:
        names = ", ".join(sorted({g["name"] for g in env["gpus"]}))
        seen = f"{len(env['gpus'])} GPU(s): {names}; CUDA {env['cuda']}, cuDNN {env['cudnn']}, "
        return Check("CUDA device", "ok", seen + f"driver {env['driver']}")
    if env["nvidia_hardware"] and not env["cuda"]:
        cpu_build = f"this machine has an NVIDIA GPU but torch {env['torch']} is a CPU-only build"
        fix = "pip install torch --index-url https://download.pytorch.org/whl/cu126 (pick your CUDA at pytorch.org)"
        return Check("torch CUDA build", "error", cpu_build, fix)
    if env["cuda"]:
        visible = env["env"].get("CUDA_VISIBLE_DEVICES")
        unseen = f"torch is built for CUDA {env['cuda']} but sees no GPU"
        unseen += f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        fix = "check the driver with nvidia-smi and CUDA_VISIBLE_DEVICES; the driver must be new enough for this CUDA"
        return Check("CUDA device", "warn", unseen, fix)
    cpu = f"no CUDA GPU; torch {env['torch']} is a CPU build: training runs on CPU in fp32"
    return Check("CUDA device", "info", cpu, "on a GPU machine install a CUDA build of torch")


def _gpu_precision_checks(env: dict[str, Any]) -> list[Check]:
    """bf16, FP8, TF32, flash attention and triton on the GPU(s)."""
    gpus = env["gpus"]
    checks = [_bf16_check(gpus), fp8_check(gpus, env["packages"].get("torchao")), _tf32_check(env)]
    if all(g["flash_attention"] for g in gpus):
        flash = "SDPA flash attention kernels available (model.attention = 'sdpa')"
        checks.append(Check("flash attention", "ok", flash))
    else:
        no_flash = (
            "no flash attention kernel here (needs compute capability >= 8.0 and the "
            "flash SDPA backend enabled); SDPA falls back to memory-efficient or math kernels"
        )
        checks.append(Check("flash attention", "info", no_flash))
    if env["packages"].get("triton") is None:
        no_triton = "triton is not installed: torch.compile cannot generate GPU kernels"
        fix = "pip install triton, or run with --compile.scope=off"
        checks.append(Check("torch.compile", "warn", no_triton, fix))
    return checks


def _bf16_check(gpus: list[dict[str, Any]]) -> Check:
    """bf16 on every GPU, else fp16 with a GradScaler."""
    old = [g for g in gpus if not g["bf16"]]
    if not old:
        return Check("bf16", "ok", "bf16 supported: precision auto uses bf16-mixed")
    no_bf16 = f"{_gpu(old[0])} has no bf16: precision auto will use fp16-mixed with a GradScaler"
    fix = (
        "nothing to do; fp16 + loss scaling is handled, or use a GPU with compute capability >= 8.0 for bf16"
    )
    return Check("bf16", "warn", no_bf16, fix)


def _tf32_check(env: dict[str, Any]) -> Check:
    """TF32 tensor cores, and whether this process has TF32 matmuls on."""
    if not all(g["tf32"] for g in env["gpus"]):
        return Check("TF32", "info", "this GPU has no TF32 tensor cores (compute capability < 8.0)")
    if env["backends"]["matmul_tf32"] or env["backends"]["float32_matmul_precision"] != "highest":
        return Check("TF32", "ok", "TF32 matmuls are on for fp32 work")
    off = "TF32 is off in this process for fp32 matmuls (torch's default); turbotrain runs turn it on "
    off += "(precision.tf32 = true)"
    return Check("TF32", "info", off, "in your own loop: torch.set_float32_matmul_precision('high')")


def _cpu_precision_checks(env: dict[str, Any]) -> list[Check]:
    """Without a GPU the precision checks are skipped, saying what CPU runs do instead."""
    cpu_bf16 = f"{GPU_ONLY}; on CPU precision auto uses fp32 (bf16 autocast is often many times slower there)"
    return [
        Check("bf16", "skip", cpu_bf16),
        Check("TF32", "skip", f"{GPU_ONLY} (TF32 is a tensor-core format)"),
        fp8_check([], env["packages"].get("torchao")),
        Check("flash attention", "skip", f"{GPU_ONLY}; on CPU SDPA uses its CPU kernels"),
    ]


def _nvml_checks(env: dict[str, Any]) -> list[Check]:
    """NVML sampling, and whether another process already uses a GPU."""
    nvml, gpus = env["nvml"], env["gpus"]
    if not nvml["available"] and gpus:
        return [Check("NVML", "warn", nvml["detail"], "install nvidia-ml-py and an NVIDIA driver")]
    if not nvml["available"]:
        unsampled = nvml["detail"] + "; GPU utilisation, power and temperature are not sampled"
        return [Check("NVML", "skip", unsampled), Check("GPU busy", "skip", f"{GPU_ONLY} and NVML")]
    works = f"NVML works (driver {nvml.get('driver')}): utilisation, power and temperature are sampled"
    nvml_ok = Check("NVML", "ok", works)
    busy = [g for g in nvml.get("gpus", []) if (g.get("util_pct") or 0) > 10 or g.get("processes")]
    if not busy:
        return [nvml_ok, Check("GPU busy", "ok", "no other process is using the GPU(s)")]
    g = busy[0]
    in_use = (
        f"{g['name']} (NVML index {g['nvml_index']}) is already in use: {g.get('util_pct')}% "
        f"utilisation, {len(g.get('processes', []))} process(es), {g.get('mem_used_gib')} GiB used"
    )
    fix = "stop the other jobs or pick a free GPU with CUDA_VISIBLE_DEVICES; shared GPUs give slower, noisy runs"
    return [nvml_ok, Check("GPU busy", "warn", in_use, fix)]


def _workers_check(env: dict[str, Any]) -> Check:
    """Enough CPU cores per GPU for the DataLoader workers to keep up (the loader's own rule, not a copy)."""
    gpus, cores, name = env["gpus"], env["cpu"]["usable_cores"], "DataLoader workers"
    if not gpus:
        on_cpu = (
            f"{cores} usable CPU core(s): data.num_workers auto will use "
            f"{default_num_workers(torch.device('cpu'), cores)} (on CPU batches load in the training process "
            "when there are 4 cores or fewer: workers would compete with the compute threads)"
        )
        return Check(name, "info", on_cpu)
    per_gpu = cores // max(1, len(gpus))
    if per_gpu < 4:
        few = f"only {cores} usable CPU core(s) for {len(gpus)} GPU(s): about {per_gpu} per GPU, too few for "
        fix = "use a pre-tokenized .bin dataset (memory-mapped, cheap to load) or a machine with more cores"
        return Check(name, "warn", few + "DataLoader workers to keep up with a fast GPU", fix)
    workers = default_num_workers(torch.device("cuda"), cores)
    return Check(name, "ok", f"{cores} usable cores: data.num_workers auto will use {workers} per process")


def _threads_check(env: dict[str, Any]) -> Check:
    """torch's intra-op threads against the usable cores."""
    threads, cores = env["torch_threads"], env["cpu"]["usable_cores"]
    if threads > cores:
        over = f"torch uses {threads} threads but only {cores} cores are usable: oversubscribed"
        fix = f"export OMP_NUM_THREADS={cores} or call torch.set_num_threads({cores})"
        return Check("torch threads", "warn", over, fix)
    return Check("torch threads", "ok", f"torch uses {threads} of {cores} usable core(s) for CPU ops")
