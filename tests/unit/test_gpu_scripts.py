"""The GPU scripts, dry-run on CPU with a stand-in interpreter: their control flow (budget, phases
skipped and said so, results packed after every phase into two files, every step under
`timeout -k`, provenance) and the plan itself (three device commands, each within 540 s of step
limits) are checked here, so a lent GPU's minutes are not spent finding script bugs."""

from __future__ import annotations

import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
PLAN = ("gpu_proof.sh", "gpu_ablation.sh", "gpu_rest.sh")  # the three device commands, in order
SCRIPTS = (*PLAN, "gpu_extra.sh")
COMMAND_LIMIT_S = 540  # of the device's 600 s per command: the rest is the GPU probe, packing, kill grace
STAND_IN = """#!/usr/bin/env bash
# A stand-in for python on a GPU machine: names a GPU, pretends every other command worked, and
# leaves a bench row (log.txt, result.json) in any --work-dir it is given.
for a in "$@"; do case "$a" in *get_device_name*) echo "NVIDIA H100 80GB HBM3"; exit 0;; esac; done
prev=
for a in "$@"; do
  if [ "$prev" = --work-dir ]; then mkdir -p "$a/fake-row" && echo "row log" > "$a/fake-row/log.txt" && echo '{"status": "ok"}' > "$a/fake-row/result.json"; fi
  prev=$a
done
echo "stand-in ran (TT_COMMIT=${TT_COMMIT:-}): $*"
"""


def _dry_run(tmp_path: Path, script: str, *args: str, budget: int = 570,
             env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    out = tmp_path / "out"
    full = {k: v for k, v in os.environ.items() if k != "TT_COMMIT"}
    full.update({"PYTHON": str(python), "OUT": str(out), "BUDGET_S": str(budget),
                 "RESULTS": str(tmp_path / "results"), "WORK": str(tmp_path / "work"), **(env or {})})
    proc = subprocess.run(["bash", str(BENCH / script), *args], env=full, capture_output=True, text=True, timeout=120)
    return proc, out


def _declared_limits(script: str) -> list[int]:
    """The script's step limits, read from its `step N ...` and `step_to FILE N ...` lines."""
    limits = []
    for line in (BENCH / script).read_text().splitlines():
        m = re.match(r"\s*(?:step|step_to\s+\S+)\s+(\d+)\s", line)
        if m:
            limits.append(int(m.group(1)))
    return limits


@pytest.mark.parametrize("script,name,phases", [
    ("gpu_proof.sh", "proof", ["env", "w1", "gpu-tests"]),
    ("gpu_ablation.sh", "ablation", ["w1-ablation"]),
    ("gpu_rest.sh", "rest", ["w1-precision", "nccl", "train-w1", "w2-cnn-224", "w2-cnn-cifar"]),
    ("gpu_extra.sh", "extra", ["finder", "checkpointing", "memory-report", "w1-fp8", "checkpoint-stall"]),
])
def test_dry_run_runs_every_phase_and_packs_two_files(tmp_path, script, name, phases):
    proc, out = _dry_run(tmp_path, script)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [f"{name}.log", f"{name}.tgz"]  # the device returns at most 8
    log = (out / f"{name}.log").read_text()
    assert [m for m in re.findall(r"== (\S+): start", log)] == phases
    assert "skipped nothing" in log and "TIMED OUT" not in log
    with tarfile.open(out / f"{name}.tgz") as tar:
        names = tar.getnames()
    assert any(n.endswith(f"{name}/COMMAND.txt") for n in names) and any(n.endswith(f"{name}.log") for n in names)
    assert all(re.match(rf"nvidia-h100-80gb-hbm3/\d{{4}}-\d\d-\d\d/{name}(/|$)", n) for n in names)  # <gpu>/<date>/<name>
    command = next((tmp_path / "results").glob(f"*/*/{name}/COMMAND.txt")).read_text()
    assert "gpu: NVIDIA H100 80GB HBM3" in command and "commit: " in command and "finished:" in command
    ran = re.search(r"^command: .* bash (\S+)$", command, re.M)
    assert ran and ran.group(1) == f"benchmarks/{script}" and (REPO / ran.group(1)).is_file()


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_command_fits_the_device_window(tmp_path, script):
    """The step limits, read from the script itself, sum to <= 540 s; a dry run with an unlimited
    budget logs exactly those limits (no step in a loop or a branch the reading would miss)."""
    declared = _declared_limits(script)
    assert declared and sum(declared) <= COMMAND_LIMIT_S, f"{script}: {declared} sum to {sum(declared)} s"
    proc, out = _dry_run(tmp_path, script, budget=100_000)
    assert proc.returncode == 0, proc.stderr
    logged = [int(s) for s in re.findall(r"\(limit (\d+)s\)", next(out.glob("*.log")).read_text())]
    assert logged == declared
    budget = int(re.search(r"BUDGET_S=\$\{BUDGET_S:-(\d+)\}", (BENCH / "gpu_common.sh").read_text()).group(1))
    assert sum(declared) < budget <= 580  # the budget never cuts a step that kept to its limit


def test_the_plan_is_three_commands_in_the_readme():
    readme = (BENCH / "README.md").read_text()
    lines = [line for line in readme.splitlines() if re.search(r"bash benchmarks/gpu_\w+\.sh", line)]
    plan = [re.search(r"benchmarks/(gpu_\w+\.sh)", line).group(1) for line in lines if "TT_COMMIT=" in line]
    assert plan[:3] == list(PLAN)
    assert "gpu_rest.sh bench" not in readme and "gpu_rest.sh train" not in readme


def test_a_short_budget_skips_phases_and_says_which(tmp_path):
    proc, out = _dry_run(tmp_path, "gpu_proof.sh", budget=35)
    assert proc.returncode == 0, proc.stderr
    log = (out / "proof.log").read_text()
    assert "env: start" in log and "w1: skipped" in log and "gpu-tests: skipped" in log
    assert "skipped w1 gpu-tests" in log


def test_every_python_step_runs_under_timeout_kill():
    for script in (*SCRIPTS, "gpu_common.sh"):
        lines = (BENCH / script).read_text().splitlines()
        for i, line in enumerate(lines):
            if '"$PY"' not in line or line.lstrip().startswith("#"):
                continue
            head = line.strip()
            assert head.startswith(("step ", "step_to ")) or "timeout -k" in head, f"{script}:{i + 1}: {head}"


def test_gpu_tests_run_to_the_end_within_a_limit():
    lines = [line for line in (BENCH / "gpu_proof.sh").read_text().splitlines()
             if "-m pytest" in line and "tests/gpu" in line and not line.startswith("#")]
    assert len(lines) == 1 and lines[0].startswith("step ")
    assert not re.search(r"\s-x\b|--exitfirst|--maxfail", lines[0])


def test_nccl_smoke_runs_ddp_and_fsdp_under_torchrun_with_one_process(tmp_path):
    proc, out = _dry_run(tmp_path, "gpu_rest.sh")
    assert proc.returncode == 0, proc.stderr
    ran = [line for line in (out / "rest.log").read_text().splitlines() if line.startswith("stand-in ran")]
    smoke = [line for line in ran if "-m torch.distributed.run" in line]
    assert len(smoke) == 2
    for line, strategy in zip(smoke, ("ddp", "fsdp")):
        assert "--standalone --nproc-per-node 1 -m turbotrain train" in line
        assert f"--distributed.strategy {strategy}" in line and f"--run.name nccl-{strategy}" in line


def test_row_logs_and_row_results_are_packed(tmp_path):
    proc, out = _dry_run(tmp_path, "gpu_proof.sh")
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(out / "proof.tgz") as tar:
        names = tar.getnames()
    assert any(n.endswith("proof/logs/w1--fake-row.txt") for n in names)
    assert any(n.endswith("proof/logs/w1--fake-row.result.json") for n in names)


def test_the_commit_comes_from_tt_commit_without_git(tmp_path):
    """On the device the working tree arrives without .git: TT_COMMIT (set in the device command
    from the host) is what COMMAND.txt records and what every Python step sees."""
    no_git = {"GIT_DIR": str(tmp_path / "no-git")}
    proc, out = _dry_run(tmp_path, "gpu_ablation.sh", env={**no_git, "TT_COMMIT": "0123abcd"})
    assert proc.returncode == 0, proc.stderr
    command = next((tmp_path / "results").glob("*/*/ablation/COMMAND.txt")).read_text()
    assert "commit: 0123abcd (from TT_COMMIT)" in command
    assert re.search(r"^command: TT_COMMIT=0123abcd OUT=\S+ BUDGET_S=\d+ bash benchmarks/gpu_ablation.sh$", command, re.M)
    assert "stand-in ran (TT_COMMIT=0123abcd): -m turbotrain bench" in (out / "ablation.log").read_text()

    proc, out = _dry_run(tmp_path, "gpu_ablation.sh", env=no_git)
    assert proc.returncode == 0, proc.stderr
    command = next((tmp_path / "results").glob("*/*/ablation/COMMAND.txt")).read_text()
    assert "commit: unknown" in command and "TT_COMMIT" not in command


def test_the_commit_comes_from_git_when_tt_commit_is_unset(tmp_path):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("not a git checkout")
    proc, _ = _dry_run(tmp_path, "gpu_ablation.sh")
    assert proc.returncode == 0, proc.stderr
    command = next((tmp_path / "results").glob("*/*/ablation/COMMAND.txt")).read_text()
    assert re.search(rf"^commit: {head.stdout.strip()}( \(with uncommitted changes\))?$", command, re.M)


def test_no_gpu_is_one_line_and_exit_1(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/usr/bin/env bash\nexit 1\n")
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "OUT": str(tmp_path / "out"), "RESULTS": str(tmp_path / "r")}
    for script in SCRIPTS:
        proc = subprocess.run(["bash", str(BENCH / script)], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and proc.stderr.strip() == f"{script}: no CUDA GPU visible to torch"
