"""The report of ``turbotrain doctor``: one JSON object, and text to paste into a bug report."""

from __future__ import annotations

from typing import Any

from ..environment import collect_env
from .checks import run_checks
from .probes import run_probes


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
    lines = ["## turbotrain doctor", "", "### Environment", *_env_lines(report["env"])]
    lines += ["", "### Checks", *_check_lines(report["checks"])]
    if "probes" in report:
        lines += ["", "### Probes (median)", *_probe_lines(report["probes"])]
    return "\n".join(lines)


def _env_lines(env: dict[str, Any]) -> list[str]:
    cpu = env["cpu"]
    lines = [
        f"- turbotrain: {env['turbotrain']}",
        f"- Python: {env['python']} ({env['platform']})",
        f"- torch: {env['torch']} (CUDA build: {env['cuda'] or 'none'}, cuDNN: {env['cudnn'] or 'n/a'}, NCCL: {env['nccl'] or 'n/a'})",
        f"- NVIDIA driver: {env['driver'] or 'n/a'}",
        f"- CPU: {cpu['model']}, {cpu['usable_cores']} usable of {cpu['logical_cores']} logical cores "
        f"({cpu['capability']}), torch threads {env['torch_threads']}",
        f"- RAM: {env['ram_gib']} GiB",
        f"- NVML: {'ok' if env['nvml']['available'] else env['nvml']['detail']}",
        *(_gpu_lines(env["gpus"]) if env["gpus"] else ["- GPUs: none visible to torch"]),
    ]
    d = env["distributed"]
    p2p = f"; P2P {', '.join(k for k, ok in d['p2p'].items() if ok) or 'none'}" if d.get("p2p") else ""
    lines.append(f"- torch.distributed: {', '.join(d['backends']) or 'unavailable'}{p2p}")
    if d.get("topology"):
        lines += [
            "- GPU interconnect (nvidia-smi topo -m):",
            *(f"    {r}" for r in d["topology"].splitlines()),
        ]
    lines.append(f"- packages: {', '.join(f'{k} {v}' for k, v in env['packages'].items() if v)}")
    if env["env"]:
        lines.append("- env: " + ", ".join(f"{k}={v}" for k, v in env["env"].items()))
    return lines


def _gpu_lines(gpus: list[dict[str, Any]]) -> list[str]:
    lines = []
    for g in gpus:
        feats = ", ".join(
            f"{k} {'yes' if g[k] else 'no'}" for k in ("bf16", "tf32", "fp8", "flash_attention")
        )
        lines.append(
            f"- GPU {g['index']}: {g['name']}, compute capability {g['compute_capability']}, "
            f"{g['memory_gib']} GiB; {feats}"
        )
        spec = g["datasheet"]
        sheet = (
            f"{spec['bf16_tflops']} TFLOP/s bf16 dense, {spec['mem_bandwidth_gbs']:.0f} GB/s" if spec else ""
        )
        lines.append(f"    datasheet: {sheet or 'unknown device (MFU will be left out)'}")
    return lines


def _check_lines(checks: list[dict[str, str]]) -> list[str]:
    """One line per check with its level mark and fix, then the names that could not be checked."""
    marks = {"ok": "OK  ", "info": "INFO", "warn": "WARN", "error": "FAIL", "skip": "SKIP"}
    lines = []
    for c in checks:
        lines.append(f"- [{marks[c['level']]}] {c['name']}: {c['finding']}")
        if c["fix"]:
            lines.append(f"    fix: {c['fix']}")
    skipped = [c["name"] for c in checks if c["level"] == "skip"]
    if skipped:
        lines.append(f"Not checked on this machine (no GPU/NVML): {', '.join(skipped)}.")
    return lines


def _probe_lines(probes: list[dict[str, Any]]) -> list[str]:
    lines = []
    for p in probes:
        sheet = p["datasheet"]
        beside = (
            f" vs datasheet {_num(sheet)} {p['unit']} ({100 * p['fraction_of_datasheet']:.0f}%)"
            if sheet
            else " (no datasheet figure)"
        )
        lines.append(f"- {p['name']}: {_num(p['value'])} {p['unit']}{beside} [{p['detail']}]")
    return lines
