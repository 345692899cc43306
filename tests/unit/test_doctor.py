"""turbotrain doctor: environment report, checks with fixes, probes; as a user runs it."""

import copy
import json
import os

import pytest

from turbotrain.app.doctor import (
    build_report,
    collect_distributed,
    collect_env,
    format_report,
    run_checks,
    run_probes,
)
from turbotrain.cli import main


@pytest.fixture(scope="module")
def env():
    return collect_env()


def _checks(env):
    return {c.name: c for c in run_checks(env)}


def test_collect_env_is_json_with_versions_devices_and_nvml(env):
    data = json.loads(json.dumps(env, allow_nan=False))
    for key in (
        "python",
        "torch",
        "cuda",
        "cudnn",
        "nccl",
        "driver",
        "gpus",
        "cpu",
        "ram_gib",
        "nvml",
        "turbotrain",
    ):
        assert key in data
    assert data["cpu"]["usable_cores"] >= 1 and data["ram_gib"] > 0
    assert isinstance(data["nvml"]["available"], bool) and data["nvml"]["detail"]


def test_every_check_has_a_level_a_finding_and_a_fix_when_not_ok(env):
    for c in run_checks(env):
        assert c.level in ("ok", "info", "warn", "error", "skip") and c.finding
        if c.level in ("warn", "error"):
            assert c.fix


def _fake_gpu(env, **gpu):
    env = copy.deepcopy(env)
    g = {
        "index": 0,
        "name": "NVIDIA H100 80GB HBM3",
        "compute_capability": "9.0",
        "memory_gib": 79.1,
        "multiprocessors": 132,
        "bf16": True,
        "tf32": True,
        "fp8": True,
        "flash_attention": True,
        "datasheet": None,
    }
    g.update(gpu)
    env.update(cuda_available=True, cuda="12.6", gpus=[g], nvidia_hardware=True)
    env["cpu"]["usable_cores"] = 32
    env["torch_threads"] = 8
    env["packages"]["triton"] = "3.2.0"
    return env


def test_cpu_only_torch_on_an_nvidia_machine_is_an_error_with_the_install_command(env):
    broken = copy.deepcopy(env)
    broken.update(cuda_available=False, cuda=None, gpus=[], nvidia_hardware=True)
    check = _checks(broken)["torch CUDA build"]
    assert check.level == "error" and "pip install torch --index-url" in check.fix


def test_old_gpu_warns_that_auto_uses_fp16(env):
    checks = _checks(
        _fake_gpu(env, name="Tesla V100-SXM2-16GB", compute_capability="7.0", bf16=False, tf32=False)
    )
    assert checks["bf16"].level == "warn" and "fp16-mixed" in checks["bf16"].finding
    assert _checks(_fake_gpu(env))["bf16"].level == "ok"


def test_busy_gpu_and_few_cores_and_oversubscribed_threads_warn(env):
    busy = _fake_gpu(env)
    busy["nvml"] = {
        "available": True,
        "detail": "ok",
        "driver": "550.54",
        "gpus": [
            {
                "nvml_index": 0,
                "name": "NVIDIA H100",
                "util_pct": 97,
                "mem_used_gib": 40.0,
                "processes": [{"pid": 1, "mem_gib": 40.0}],
            }
        ],
    }
    busy["cpu"]["usable_cores"] = 2
    busy["torch_threads"] = 16
    checks = _checks(busy)
    assert checks["GPU busy"].level == "warn" and "97%" in checks["GPU busy"].finding
    assert checks["DataLoader workers"].level == "warn"
    assert checks["torch threads"].level == "warn" and "OMP_NUM_THREADS=2" in checks["torch threads"].fix


def test_without_a_gpu_the_gpu_checks_say_they_were_skipped(env):
    cpu = copy.deepcopy(env)
    cpu.update(cuda_available=False, gpus=[], nvidia_hardware=False)
    cpu["nvml"] = {"available": False, "detail": "NVML unavailable: NVML Shared Library Not Found"}
    checks = _checks(cpu)
    for name in ("bf16", "TF32", "flash attention", "NVML", "GPU busy"):
        assert checks[name].level == "skip", name


def test_cli_text_and_json(capsys, env):
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert f"torch: {env['torch']}" in text and "### Checks" in text
    if not env["gpus"]:
        assert "Not checked on this machine (no GPU/NVML)" in text
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["env"]["torch"] == env["torch"] and {c["name"] for c in data["checks"]} >= {
        "CUDA device",
        "NVML",
    }


def test_cpu_probes_measure_matmul_and_copy_without_a_datasheet():
    results = {r.name: r for r in run_probes("cpu", quick=True)}
    assert results["matmul fp32"].unit == "TFLOP/s" and results["matmul fp32"].value > 0
    assert results["memory copy"].unit == "GB/s" and results["memory copy"].value > 0
    assert all(r.datasheet is None and r.fraction_of_datasheet is None for r in results.values())


def test_report_says_what_multi_process_training_can_use(monkeypatch, tmp_path):
    assert "gloo" in collect_distributed(0)["backends"]
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '        GPU0    GPU1'\necho 'GPU0     X      NV18'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    topo = collect_distributed(0)["topology"]
    assert "NV18" in topo
    text = format_report(build_report())
    assert (
        "torch.distributed: " in text and "GPU interconnect (nvidia-smi topo -m):" in text and "NV18" in text
    )
