"""The GPU scripts, dry-run on CPU with a stand-in interpreter: the plan for a 15-minute lease
(gpu_plan.sh: step limits <= 480 s, phases most valuable first, every phase packed as it ends)
and the optional second command (gpu_extra.sh: any selection of its phases <= 180 s), their control
flow (budget, phases skipped and said so, two files back, every step under `timeout -k`,
provenance), and every command line they run, parsed by turbotrain's own parsers and config, so a
lent GPU's minutes are not spent finding a misspelt flag."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import HANG_S

from turbotrain.app.bench.contenders import CONTENDERS
from turbotrain.app.bench.suite import ablation_variants, precision_variants
from turbotrain.app.bench.workloads import resolve_workload, workload_names
from turbotrain.base.config import load_config, parse_overrides
from turbotrain.cli import build_parser
from turbotrain.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
PLAN, EXTRA = "gpu_plan.sh", "gpu_extra.sh"
PLAN_LIMIT_S, EXTRA_LIMIT_S = 480, 180  # 15 min = one cold start (1-2 min) + both commands + margins
# The plan's phases in the order of their value (issue 30): 1 the W1 bf16 + compile ladder, 2 the
# CIFAR CNN, 3 the GPU tests and the NCCL smoke, 4 precision rows and `train --model`, 5 W1 side by side.
PLAN_PHASES = ["w1-ladder", "cnn-cifar", "gpu-tests", "nccl", "w1-precision", "train-model", "w1-compare"]
SEP = "\x1f"
STAND_IN = r"""#!/usr/bin/env bash
# A stand-in for python on a GPU machine: names a GPU; records every other call's argv (one line)
# and, beside it, the log inside the archive packed so far; leaves what the real command would:
# a bench row (log.txt, result.json) in --work-dir, a file in --out, a run in --run.out_dir.
for a in "$@"; do case "$a" in *get_device_name*) echo "NVIDIA H100 80GB HBM3"; exit 0;; esac; done
n=$(wc -l < "$CALLS" 2>/dev/null || echo 0)
{ printf '%s\x1f' "$@"; printf '\n'; } >> "$CALLS"
for t in "$OUT"/*.tgz; do [ -f "$t" ] && tar xzOf "$t" --wildcards '*.log' > "$CALLS.packed.$n" 2>/dev/null; done
prev= name=
for a in "$@"; do [ "$prev" = --run.name ] && name=$a; prev=$a; done
prev=
for a in "$@"; do
  case "$prev" in
    --work-dir) mkdir -p "$a/fake-row-$n" && echo "row log" > "$a/fake-row-$n/log.txt" && echo '{"status": "ok"}' > "$a/fake-row-$n/result.json";;
    --out) case "$a" in *.json) echo '{}' > "$a";; *) mkdir -p "$a" && echo '{}' > "$a/call-$n.json";; esac;;
    --run.out_dir) mkdir -p "$a/$name" && echo '{}' > "$a/$name/summary.json";;
  esac
  prev=$a
done
echo "stand-in ran (TT_COMMIT=${TT_COMMIT:-}): $*"
"""


def _dry_run(
    tmp_path: Path, script: str, *args: str, budget: int | None = None, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess, Path]:
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    out = tmp_path / "out"
    full = {k: v for k, v in os.environ.items() if k not in ("TT_COMMIT", "BUDGET_S")}
    full.update(
        {
            "PYTHON": str(python),
            "OUT": str(out),
            "CALLS": str(tmp_path / "calls"),
            "RESULTS": str(tmp_path / "results"),
            "WORK": str(tmp_path / "work"),
            **(env or {}),
        }
    )
    if budget is not None:
        full["BUDGET_S"] = str(budget)
    proc = subprocess.run(
        ["bash", str(BENCH / script), *args], env=full, capture_output=True, text=True, timeout=HANG_S
    )
    return proc, out


def _calls(tmp_path: Path) -> list[list[str]]:
    path = tmp_path / "calls"
    return [line.split(SEP)[:-1] for line in path.read_text().splitlines()] if path.exists() else []


def _declared_limits(script: str) -> list[int]:
    """The script's step limits, read from its `step N ...` and `step_to FILE N ...` lines."""
    limits = []
    for line in (BENCH / script).read_text().splitlines():
        m = re.match(r"\s*(?:step|step_to\s+\S+)\s+(\d+)\s", line)
        if m:
            limits.append(int(m.group(1)))
    return limits


def _logged_limits(log: str) -> dict[str, int]:
    """Each phase's step limits as the dry run logged them, summed."""
    sums: dict[str, int] = {}
    for phase, limit in re.findall(r"^== (\S+): .* \(limit (\d+)s\)", log, re.M):
        sums[phase] = sums.get(phase, 0) + int(limit)
    return sums


def _extra_menu() -> dict[str, int]:
    text = (BENCH / EXTRA).read_text()
    table = re.search(r"declare -A LIMIT=\((.*?)\n\)", text, re.S).group(1)
    order = re.search(r"^ORDER=\((.*?)\)", text, re.S | re.M).group(1).split()
    limits = {k: int(v) for k, v in re.findall(r"\[([\w-]+)\]=(\d+)", table)}
    assert list(limits) == order, "LIMIT and ORDER name the same phases in the same order"
    return limits


def _check_call(argv: list[str]) -> None:
    """One command a script runs, checked as the device would take it: turbotrain's subcommands
    through its own parser and config (every flag, every --section.key and its value), bench's
    workloads, contenders and --rows by name, other scripts' flags in their sources."""
    if argv[:2] == ["-m", "torch.distributed.run"]:
        assert argv[2:6] == ["--standalone", "--nproc-per-node", "1", "-m"], argv
        argv = argv[5:]
    if argv[0] == "-c":  # a one-line probe: it must at least compile
        compile(argv[1], "<python -c>", "exec")
        return
    if argv[:2] == ["-m", "pytest"]:
        assert (REPO / next(a for a in argv[2:] if a.startswith("tests/"))).is_dir()
        return
    if argv[0].startswith("benchmarks/"):
        source = (REPO / argv[0]).read_text()
        for flag in (a for a in argv[1:] if a.startswith("--")):
            assert f'"{flag}"' in source, f"{argv[0]} has no {flag}"
        return
    assert argv[:2] == ["-m", "turbotrain"], argv
    try:
        args, extra = build_parser().parse_known_args(argv[2:])
    except SystemExit:  # argparse said why on stderr: a flag or a choice the command lacks
        pytest.fail(f"turbotrain refuses {' '.join(argv[2:])}")
    if extra:
        assert getattr(args, "accepts_overrides", False), f"unrecognized arguments: {extra}"
        # unknown key or bad value: ConfigError
        load_config(getattr(args, "preset", None), parse_overrides(extra))
    if getattr(args, "model", None) and args.command.__name__ != "main_bench":
        file, func = args.model.split(":")
        assert f"def {func}(" in (REPO / file).read_text()
    if args.command.__name__ == "main_bench":
        assert args.workload in workload_names()
        assert {c for c in args.contenders.split(",")} <= set(CONTENDERS)
        if args.inference:  # --rows are precision modes there
            for mode in filter(None, args.rows.split(",")):
                load_config(None, {"precision": {"mode": mode}})
        elif args.rows:
            assert len(set(args.matrix)) == 1
            names = (
                {v.name for v in precision_variants("cuda")}
                if args.matrix == ["precision"]
                else {v.name for v in ablation_variants(resolve_workload(args.workload, "cuda"), "cuda")}
            )
            assert set(args.rows.split(",")) <= names, f"{args.rows} not rows of {args.matrix}"


@pytest.mark.slow
def test_the_plan_runs_its_phases_in_value_order_within_480_s_and_packs_each(tmp_path):
    declared = _declared_limits(PLAN)
    assert declared and sum(declared) <= PLAN_LIMIT_S, f"{declared} sum to {sum(declared)} s"
    proc, out = _dry_run(tmp_path, PLAN, budget=100_000)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["plan.log", "plan.tgz"]  # the device returns at most 8
    log = (out / "plan.log").read_text()
    assert re.findall(r"== (\S+): start", log) == PLAN_PHASES
    assert "skipped nothing" in log and "TIMED OUT" not in log
    steps = re.findall(r"^== (\S+): .* \(limit (\d+)s\)", log, re.M)
    assert [int(limit) for _, limit in steps] == declared  # no step in a loop or branch the reading misses
    budget = int(re.search(r"BUDGET_S=\$\{BUDGET_S:-(\d+)\}", (BENCH / PLAN).read_text()).group(1))
    assert sum(declared) < budget <= PLAN_LIMIT_S + 30
    # every phase packed as it ended: each call finds the log of every earlier phase, to its last step, in the archive
    calls = _calls(tmp_path)
    assert len(calls) == len(steps)
    for n, (phase, _) in enumerate(steps):
        earlier = PLAN_PHASES[: PLAN_PHASES.index(phase)]
        packed = (tmp_path / f"calls.packed.{n}").read_text() if earlier else ""
        for done in earlier:
            assert packed.count(f"== {done}: exit") == sum(p == done for p, _ in steps), (phase, done)
    with tarfile.open(out / "plan.tgz") as tar:
        names = tar.getnames()
    # <gpu>/<date>/plan
    assert all(re.match(r"nvidia-h100-80gb-hbm3/\d{4}-\d\d-\d\d/plan(/|$)", n) for n in names)
    for member in (
        "COMMAND.txt",
        "plan.log",
        "w1-ladder/call-0.json",
        "logs/w1--fake-row-0.result.json",
        "logs/cnn-cifar--fake-row-1.txt",
        "runs/nccl-fsdp/summary.json",
        "runs/cnn-workload/summary.json",
    ):
        assert f"nvidia-h100-80gb-hbm3/{names[0].split('/')[1]}/plan/{member}" in names, member
    for argv in calls:
        _check_call(argv)


@pytest.mark.slow
def test_the_plan_asks_what_the_issue_owes(tmp_path):
    """The ladder's rows, the CNN's three, both NCCL strategies under torchrun with one process,
    the GPU tests to the end, the precision rows, `train --model`, W1 side by side."""
    proc, _ = _dry_run(tmp_path, PLAN)
    assert proc.returncode == 0, proc.stderr
    calls = [" ".join(c) for c in _calls(tmp_path)]
    ladder, cnn, tests, ddp, fsdp, precision, model, w1 = calls
    assert (
        "--matrix ablation --rows bf16-compile+chunked-loss,bf16-compile+cuda-graphs,bf16-compile+fp8"
        in ladder
    )
    assert (
        "--workload cnn-cifar --compare --contenders eager --matrix ablation --rows bf16-compile+cuda-graphs"
        in cnn
    )
    assert "tests/gpu" in tests and not re.search(r"\s-x\b|--exitfirst|--maxfail", tests)
    for line, strategy in ((ddp, "ddp"), (fsdp, "fsdp")):
        assert "-m torch.distributed.run --standalone --nproc-per-node 1 -m turbotrain train" in line
        assert f"--distributed.strategy {strategy}" in line and f"--run.name nccl-{strategy}" in line
    assert "--matrix precision --rows fp16-mixed,bf16-mixed,bf16-true" in precision
    assert "train --model examples/workload_cnn.py:make" in model
    assert "--compare --contenders handtuned,turbotrain" in w1
    assert ladder.split("--work-dir ")[1] == w1.split("--work-dir ")[1]  # one compile cache for W1's rows


@pytest.mark.slow
def test_the_second_command_runs_any_selection_within_180_s(tmp_path):
    """Each phase of gpu_extra.sh alone: the limits it logs are its LIMIT entry (<= 180 s) and
    every command line parses; a selection over 180 s, an unknown phase or none is one line, exit 2."""
    menu = _extra_menu()
    assert sum(_declared_limits(EXTRA)) == sum(menu.values())  # every step belongs to a listed phase
    for i, (phase, limit) in enumerate(menu.items()):
        run = tmp_path / str(i)
        run.mkdir()
        proc, out = _dry_run(run, EXTRA, phase, budget=100_000)
        assert proc.returncode == 0, (phase, proc.stderr)
        assert sorted(p.name for p in out.iterdir()) == ["extra.log", "extra.tgz"]
        log = (out / "extra.log").read_text()
        assert re.findall(r"== (\S+): start", log) == [phase] and "skipped nothing" in log
        assert _logged_limits(log) == {phase: limit} and limit <= EXTRA_LIMIT_S
        with tarfile.open(out / "extra.tgz") as tar:
            assert any(n.endswith("/extra/extra.log") for n in tar.getnames())
        for argv in _calls(run):
            _check_call(argv)
    over = sorted(menu, key=menu.get)[-2:]
    env = {**os.environ, "PYTHON": "/bin/false"}
    for args, message in (
        (over, f"need {sum(menu[p] for p in over)} s of step limits, over the 180 s"),
        (["w1-ladder"], "unknown phase 'w1-ladder'; choose from: env (40 s)"),
        ([], "name the phases to run (step limits <= 180 s together)"),
    ):
        proc = subprocess.run(
            ["bash", str(BENCH / EXTRA), *args], env=env, capture_output=True, text=True, timeout=HANG_S
        )
        assert (
            proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr
        ), proc.stderr


@pytest.mark.slow
def test_a_selection_runs_in_menu_order_and_only_what_was_named(tmp_path):
    proc, out = _dry_run(tmp_path, EXTRA, "memory-report", "env")
    assert proc.returncode == 0, proc.stderr
    log = (out / "extra.log").read_text()
    assert re.findall(r"== (\S+): start", log) == ["env", "memory-report"]
    assert "ran env memory-report; skipped nothing" in log
    assert (
        "extra.sh memory-report env" in next((tmp_path / "results").glob("*/*/extra/COMMAND.txt")).read_text()
    )


def test_the_readme_gives_the_15_minute_plan_and_its_run_command():
    readme = (BENCH / "README.md").read_text()
    assert (
        "15 minutes" in readme
        and "gpu_proof.sh" not in readme.split("## Committed results")[1].split("### `results/nvidia")[0]
    )
    runs = [line for line in readme.splitlines() if "bash benchmarks/gpu_" in line and "TT_COMMIT=" in line]
    assert any(f"bash benchmarks/{PLAN}" in line for line in runs) and any(
        f"bash benchmarks/{EXTRA}" in line for line in runs
    )
    for phase in PLAN_PHASES:
        # a row of the plan's table: limit, expected time, what it answers
        assert f"| `{phase}` |" in readme, phase


@pytest.mark.slow
def test_a_short_budget_skips_phases_and_says_which(tmp_path):
    """A phase that needs more seconds than are left is skipped, saying so; a later, smaller one still runs."""
    proc, out = _dry_run(tmp_path, PLAN, budget=25)
    assert proc.returncode == 0, proc.stderr
    log = (out / "plan.log").read_text()
    assert (
        re.search(r"w1-ladder: skipped \(2[3-5]s left, needs ~60s\)", log)  # a second or two gone under load
        and "nccl: start" in log
        and "train-model: start" in log
    )
    assert "ran nccl train-model; skipped w1-ladder cnn-cifar gpu-tests w1-precision w1-compare" in log


def test_every_python_step_runs_under_timeout_kill():
    for script in (PLAN, EXTRA, "gpu_common.sh"):
        lines = (BENCH / script).read_text().splitlines()
        for i, line in enumerate(lines):
            if '"$PY"' not in line or line.lstrip().startswith("#"):
                continue
            head = line.strip()
            assert head.startswith(("step ", "step_to ")) or "timeout -k" in head, f"{script}:{i + 1}: {head}"


@pytest.mark.slow
def test_the_commit_comes_from_tt_commit_without_git(tmp_path):
    """On the device the working tree arrives without .git: TT_COMMIT (set in the device command
    from the host) is what COMMAND.txt records and what every Python step sees."""
    no_git = {"GIT_DIR": str(tmp_path / "no-git")}
    proc, out = _dry_run(tmp_path, EXTRA, "env", env={**no_git, "TT_COMMIT": "0123abcd"})
    assert proc.returncode == 0, proc.stderr
    command = next((tmp_path / "results").glob("*/*/extra/COMMAND.txt")).read_text()
    assert "commit: 0123abcd (from TT_COMMIT)" in command
    assert re.search(
        r"^command: TT_COMMIT=0123abcd OUT=\S+ BUDGET_S=200 bash benchmarks/gpu_extra.sh env$", command, re.M
    )
    assert "stand-in ran (TT_COMMIT=0123abcd): benchmarks/sdpa_probe.py" in (out / "extra.log").read_text()

    proc, out = _dry_run(tmp_path, PLAN, env=no_git)
    assert proc.returncode == 0, proc.stderr
    command = next((tmp_path / "results").glob("*/*/plan/COMMAND.txt")).read_text()
    assert (
        "commit: unknown" in command
        and "TT_COMMIT" not in command
        and "BUDGET_S=500 bash benchmarks/gpu_plan.sh" in command
    )


@pytest.mark.slow
def test_no_gpu_is_one_line_and_exit_1(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/usr/bin/env bash\nexit 1\n")
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "OUT": str(tmp_path / "out"), "RESULTS": str(tmp_path / "r")}
    for script, args in ((PLAN, []), (EXTRA, ["env"])):
        proc = subprocess.run(
            ["bash", str(BENCH / script), *args], env=env, capture_output=True, text=True, timeout=HANG_S
        )
        assert proc.returncode == 1 and proc.stderr.strip() == f"{script}: no CUDA GPU visible to torch"


def test_bench_rows_is_one_line_for_a_row_the_matrix_lacks(capsys):
    """The plan picks matrix rows by name (`bench --rows`): a name that is not a row is said in one line."""
    code = cli_main(["bench", "--workload", "mlp-tiny", "--matrix", "precision", "--rows", "bf16-compile"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.splitlines() == [
        "turbotrain bench: error: unknown precision row(s) ['bf16-compile']; choose from fp32, tf32, fp16-mixed, bf16-mixed, bf16-true, fp8"
    ]


# ------------------------------------------------------------------ the results' README, generated

H100 = REPO / "benchmarks/results/nvidia-h100-80gb-hbm3/2026-11-24"


def _readme(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH / "results_readme.py"), *args],
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )


@pytest.mark.slow
def test_the_results_readme_of_the_2026_11_24_h100_window_has_its_figures():
    proc = _readme(str(H100), "--print")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "**NVIDIA H100 80GB HBM3** (sm 9.0" in text and "driver 580.159.04" in text
    assert "torch 2.11.0+cu130 (CUDA 13.0, cuDNN 9.19.0, NCCL 2.28.9)" in text
    assert (
        "| `turbotrain` | ok | 34.95 (35.0 / 34.9) | 468,823 tok/s | 40.5 % | 8.44 | 34.08 | 2.89311 |"
        in text
    )
    assert (
        "| `eager` | ok | 5.57 | 45,974 samples/s | 5.3 % | 0.58 | 0.67 | 0.00062 | +0.00001 | 0.84x |"
        in text
    )
    assert re.search(
        r"\| `lightning` \| `proof/frameworks/gpt2-small-compare.json` \| 58.02 \| .* \| 0.60x \|", text
    )
    assert (
        "| `rest-train/memory-gpt2-small.json` | gpt2-small | 16 | bf16-mixed | off | 5.72 | 5.89 | -2.9 % |"
        in text
    )
    assert "`rest-bench`: cut at the step limit: w1-precision (at 100 s), w2-cnn-224 (at 120 s)" in text
    # its README was written by hand: never overwritten
    proc = _readme(str(H100))
    assert (
        proc.returncode == 2
        and proc.stderr.strip().count("\n") == 0
        and "was not written by this script" in proc.stderr
    )


@pytest.mark.slow
def test_the_results_readme_of_a_cpu_dry_run_names_what_is_owed_and_keeps_the_findings(tmp_path):
    # w1-ladder, cnn-cifar, gpu-tests, w1-precision, w1-compare skipped
    proc, out = _dry_run(tmp_path, PLAN, budget=25)
    assert proc.returncode == 0, proc.stderr
    day = next((tmp_path / "results").glob("*/*"))
    plan = day / "plan"
    cpu = REPO / "benchmarks/results/cpu"
    (plan / "w1-compare").mkdir()
    (plan / "w1-compare/gpt-tiny-compare.json").write_text((cpu / "gpt-tiny-compare.json").read_text())
    (plan / "w1-ladder").mkdir()
    (plan / "w1-ladder/gpt-tiny-ablation.json").write_text((cpu / "gpt-tiny-ablation.json").read_text())
    (plan / "gpu-tests.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="3" failures="1" errors="0" skipped="1" time="12.5">'
        '<testcase classname="tests.gpu.test_gpu_engine" name="test_a"/><testcase classname="tests.gpu.test_gpu_engine" '
        'name="test_b"><failure message="boom"/></testcase><testcase classname="c" name="d"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    (plan / "runs/nccl-ddp/summary.json").write_text(
        json.dumps(
            {
                "run": "nccl-ddp",
                "status": "completed",
                "steps": 30,
                "max_steps": 30,
                "first_step_s": 4.7,
                "tokens_per_s_median": 959.56,
                "peak_memory_gib": None,
                "final_train_loss": 4.178,
                "final_val_loss": 4.0994,
                "steady_state": {"tokens_per_s": 959.56, "samples_per_s": 7.5, "mfu": None},
            }
        )
    )
    (plan / "w1-precision").mkdir()
    # cut mid-write
    (plan / "w1-precision/gpt2-small-precision.json").write_text('{"schema": "turbotrain-bench/1", "rows": [')

    proc = _readme(str(day))
    assert proc.returncode == 0, proc.stderr
    text = (day / "README.md").read_text()
    assert (
        "| `plan` | `OUT=" in text
        and "| nccl train-model | w1-ladder cnn-cifar gpu-tests w1-precision w1-compare |" in text
    )
    for phase in ("w1-ladder", "cnn-cifar", "gpu-tests", "w1-precision", "w1-compare"):
        assert f"`plan`: phase `{phase}` did not run (skipped: too little time left)" in text
    assert "`plan/w1-ladder/gpt-tiny-ablation.json`: `+cuda-graphs` skipped (CUDA only)" in text
    assert "`plan/w1-precision/gpt2-small-precision.json`: unreadable or not a JSON object" in text
    assert (
        "**1 of 3 passed**, 1 failed, 0 errors, 1 skipped" in text
        and "failed: `tests.gpu.test_gpu_engine::test_b`" in text
    )
    assert (
        "| `nccl-ddp` | `plan/runs/nccl-ddp` | completed | 30 / 30 | 960 tok/s | — | — | 4.7 | 4.0994 | 4.1780 |"
        in text
    )
    assert "### gpt-tiny: every row side by side" in text and re.search(
        r"\| `eager` \| `plan/w1-compare/gpt-tiny-compare.json` \| [\d.]+ \| .* \| 1.00x \|", text
    )

    with (day / "README.md").open("a") as f:
        f.write("## Findings\n\nWritten by hand.\n")
    (plan / "w1-precision/gpt2-small-precision.json").unlink()
    assert _readme(str(day)).returncode == 0
    text = (day / "README.md").read_text()
    assert (
        text.endswith("## Findings\n\nWritten by hand.\n")
        and "unreadable" not in text
        and text.count("## Findings") == 1
    )


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_every_benchmark_script_imports_what_it_names(script: str) -> None:
    """A GPU lease is not spent on an ImportError: each script's module level (its imports; the work
    waits behind ``if __name__ == "__main__"``) runs here."""
    import runpy

    namespace = runpy.run_path(str(BENCH / script), run_name="benchmark_import_check")
    assert "__name__" in namespace
