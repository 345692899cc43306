"""The GPU scripts, dry-run on CPU with a stand-in interpreter: their control flow (budget, phases
skipped and said so, results packed after every phase into at most 8 files, every step under
`timeout -k`) is checked here, so a lent GPU's minutes are not spent finding script bugs."""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
STAND_IN = """#!/usr/bin/env bash
# A stand-in for python on a GPU machine: names a GPU, pretends every other command worked.
for a in "$@"; do case "$a" in *get_device_name*) echo "NVIDIA H100 80GB HBM3"; exit 0;; esac; done
echo "stand-in ran: $*"
"""


def _dry_run(tmp_path: Path, script: str, *args: str, budget: int = 530) -> tuple[subprocess.CompletedProcess, Path]:
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(python), "OUT": str(out), "BUDGET_S": str(budget),
           "RESULTS": str(tmp_path / "results"), "WORK": str(tmp_path / "work")}
    proc = subprocess.run(["bash", str(BENCH / script), *args], env=env, capture_output=True, text=True, timeout=120)
    return proc, out


@pytest.mark.parametrize("script,args,name,phases", [
    ("gpu_proof.sh", (), "proof", ["env", "w1-core", "w1-frameworks", "gpu-tests"]),
    ("gpu_rest.sh", ("bench",), "rest-bench", ["w1-precision", "w2-cnn-224", "w2-cnn-cifar"]),
    ("gpu_rest.sh", ("ablation",), "rest-ablation", ["w1-ablation"]),
    ("gpu_rest.sh", ("train",), "rest-train", ["train-w1", "finder", "checkpointing", "memory-report"]),
])
def test_dry_run_runs_every_phase_and_packs_two_files(tmp_path, script, args, name, phases):
    proc, out = _dry_run(tmp_path, script, *args)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [f"{name}.log", f"{name}.tgz"]  # the device returns at most 8
    log = (out / f"{name}.log").read_text()
    assert [m for m in re.findall(r"== (\S+): start", log)] == phases
    assert "skipped nothing" in log and "TIMED OUT" not in log
    with tarfile.open(out / f"{name}.tgz") as tar:
        names = tar.getnames()
    assert any(n.endswith(f"{name}/COMMAND.txt") for n in names) and any(n.endswith(f"{name}.log") for n in names)
    command = next((tmp_path / "results").glob(f"*/{name}/COMMAND.txt")).read_text()
    assert "gpu: NVIDIA H100 80GB HBM3" in command and "commit: " in command and "finished:" in command


def test_a_short_budget_skips_phases_and_says_which(tmp_path):
    proc, out = _dry_run(tmp_path, "gpu_proof.sh", budget=60)
    assert proc.returncode == 0, proc.stderr
    log = (out / "proof.log").read_text()
    assert "env: start" in log and "w1-core: skipped" in log and "gpu-tests: skipped" in log
    assert "skipped w1-core w1-frameworks gpu-tests" in log


def test_every_python_step_runs_under_timeout_kill():
    for script in ("gpu_proof.sh", "gpu_rest.sh", "gpu_common.sh"):
        lines = (BENCH / script).read_text().splitlines()
        for i, line in enumerate(lines):
            if '"$PY"' not in line or line.lstrip().startswith("#"):
                continue
            head = line.strip()
            assert head.startswith(("step ", "step_to ")) or "timeout -k" in head, f"{script}:{i + 1}: {head}"


def test_no_gpu_is_one_line_and_exit_1(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/usr/bin/env bash\nexit 1\n")
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "OUT": str(tmp_path / "out"), "RESULTS": str(tmp_path / "r")}
    proc = subprocess.run(["bash", str(BENCH / "gpu_proof.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "no CUDA GPU visible to torch" in proc.stderr
    bad = subprocess.run(["bash", str(BENCH / "gpu_rest.sh"), "nope"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "give a group: bench, ablation or train" in bad.stderr
