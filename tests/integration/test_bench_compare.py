"""`turbotrain bench --compare` on CPU: every contender in its own process, same model, same
batches, the same losses (correctness only: no assertion here is about speed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import inprocess
import pytest
from conftest import HANG_S
from faults.faultenv import fault_env

from turbotrain.app.bench import worker
from turbotrain.app.bench.contenders import CONTENDERS
from turbotrain.app.bench.results import ReportWriter
from turbotrain.app.bench.suite import (
    SAME_PRECISION_TOL,
    BenchOptions,
    run_ablation,
    run_compare,
    run_precision_matrix,
)
from turbotrain.app.bench.tables import render_report
from turbotrain.app.bench.workloads import resolve_workload, to_spec, write_data
from turbotrain.base.process import exit_on_sigterm

TINY_GPT = {"n_layer": 1, "n_head": 2, "d_model": 32, "block_size": 16}
CPU_CONTENDERS = ["eager", "handtuned", "accelerate", "lightning", "turbotrain"]


def _tiny(name: str = "gpt-tiny"):
    return resolve_workload(
        name,
        "cpu",
        batch_size=4,
        warmup_steps=2,
        timed_steps=3,
        model_overrides=TINY_GPT if name.startswith("gpt") else None,
    )


@pytest.fixture(scope="module")
def compare_report(tmp_path_factory):
    opts = BenchOptions(
        device="cpu", work_dir=tmp_path_factory.mktemp("bench"), log=lambda line: None, timeout_s=300
    )
    return run_compare(_tiny(), opts, CPU_CONTENDERS)


def test_every_contender_runs_or_says_why(compare_report):
    rows = {r["contender"]: r for r in compare_report["rows"]}
    assert list(rows) == CPU_CONTENDERS
    for name, row in rows.items():
        reason = CONTENDERS[name].unavailable("cpu")
        if reason:  # only a missing package may stop a contender, and it is named
            assert row["status"] == "skipped" and row["reason"] == reason
        else:
            assert row["status"] == "ok", f"{name}: {row.get('reason')}"
    assert rows["eager"]["status"] == rows["handtuned"]["status"] == rows["turbotrain"]["status"] == "ok"


def test_every_contender_trains_the_same_model_on_the_same_batches(compare_report):
    ok = [r for r in compare_report["rows"] if r["status"] == "ok"]
    assert len({r["init_digest"] for r in ok}) == 1, "initial weights differ"
    assert compare_report["summary"]["same_initial_weights"]
    first = [r["first_loss"] for r in ok]
    assert max(first) - min(first) <= 1e-6, f"first-step losses differ: {first}"
    # Same batches in the same order: the whole loss curve agrees, not only the first step.
    ref = next(r for r in ok if r["contender"] == "turbotrain")["losses"]
    for r in ok:
        assert len(r["losses"]) == 5
        assert max(abs(a - b) for a, b in zip(r["losses"], ref)) <= SAME_PRECISION_TOL, r["contender"]


def test_final_losses_agree_within_the_stated_tolerance(compare_report):
    ok = [r for r in compare_report["rows"] if r["status"] == "ok"]
    for r in ok:
        assert r["loss_tol"] == SAME_PRECISION_TOL  # all fp32 on CPU
        assert abs(r["loss_diff"]) <= SAME_PRECISION_TOL and r["loss_within_tol"], r["contender"]
    assert compare_report["summary"]["loss_parity"] is True


def test_report_figures_are_measured_and_the_table_prints(compare_report):
    text = render_report(compare_report)
    for row in compare_report["rows"]:
        assert f"| {row['contender']} |" in text
        if row["status"] == "ok":
            assert len(row["step_ms"]) == 3 and row["step_ms_median"] > 0 and row["tokens_per_s"] > 0
            assert "mfu" not in row  # CPU: no datasheet peak, so no MFU
            assert "peak_rss_gib" in row and "peak_mem_gib" not in row
    assert "MFU" not in text
    json.dumps(compare_report, allow_nan=False)


def test_a_missing_package_inside_the_worker_is_a_skip(tmp_path, monkeypatch):
    w = _tiny()
    spec = to_spec(w, device="cpu", seed=0, data_file=write_data(w, 0, tmp_path / "data.pt"))
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    monkeypatch.setitem(sys.modules, "lightning", None)  # import lightning -> ImportError
    result_path = tmp_path / "result.json"
    assert (
        worker.main(["lightning", "--spec", str(tmp_path / "spec.json"), "--result", str(result_path)]) == 0
    )
    result = json.loads(result_path.read_text())
    assert result["status"] == "skipped" and "lightning is not installed" in result["reason"]


def test_a_tiny_ablation_runs_the_chunked_loss_row_and_skips_cudnn_attention_on_cpu(tmp_path):
    opts = BenchOptions(device="cpu", work_dir=tmp_path, log=lambda line: None, timeout_s=300)
    report = run_ablation(_tiny(), opts, only=["+chunked-loss", "+cudnn-attention"])
    rows = {r["row"]: r for r in report["rows"]}
    assert list(rows) == ["baseline", "+cudnn-attention", "+chunked-loss"]
    assert rows["+cudnn-attention"]["status"] == "skipped" and "CUDA" in rows["+cudnn-attention"]["reason"]
    chunked = rows["+chunked-loss"]
    assert rows["baseline"]["status"] == chunked["status"] == "ok", chunked.get("reason")
    # same math, other kernels
    assert chunked["model_overrides"]["loss"] == "chunked" and chunked["loss_within_tol"]
    assert abs(chunked["loss_diff"]) <= SAME_PRECISION_TOL and chunked["speedup"] > 0
    assert "+chunked-loss" in render_report(report)


def test_batch_auto_searches_in_its_own_process_and_every_row_uses_the_answer(tmp_path, capsys, monkeypatch):
    """The search's trials report 1 ms a step (tests/faults: ``finder-step-ms``; their peaks are
    measured): on a loaded CPU a real step of 1024 rows could pass the CPU's 1 s step budget and
    move the answer, which here is the ceiling (no memory limit met)."""
    from turbotrain.cli import main

    env = fault_env("finder-step-ms:1")
    for name in ("PYTHONPATH", "TT_FAULT"):  # the search's process inherits them
        monkeypatch.setenv(name, env[name])
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench",
                "--workload",
                "mlp-tiny",
                "--batch",
                "auto",
                "--contenders",
                "eager,turbotrain",
                "--warmup",
                "1",
                "--steps",
                "2",
                "--work-dir",
                str(tmp_path / "w"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads((out / "mlp-tiny-compare.json").read_text())
    search = doc["batch_search"]
    ran = [t for t in search["trials"] if t["fits"]]
    assert search["micro"] == max(t["micro"] for t in ran) == 1024  # no memory limit met: the ceiling
    assert doc["workload"]["batch_size"] == 1024
    assert all(r["status"] == "ok" for r in doc["rows"])
    assert "batch finder: micro-batch 1024" in capsys.readouterr().err
    assert main(["bench", "--workload", "mlp-tiny", "--batch", "auto", "--timeout-s", "0.2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "took over 0.2 s" in err and "pass --work-dir DIR to keep its log" in err and "--batch N" in err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--batch", "lots"])
    assert exc.value.code == 2 and "whole number of samples or auto" in capsys.readouterr().err


USER_CNN = """
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(F.relu(self.conv(x)).mean((2, 3)))


def make():
    images, labels = torch.randn(64, 3, 8, 8), torch.randint(4, (64,))
    loader = DataLoader(TensorDataset(images, labels), batch_size=16, shuffle=True)
    return {"model": Net(), "train_loader": loader, "loss_fn": lambda model, batch: F.cross_entropy(model(batch[0]), batch[1])}
"""


def test_the_precision_matrix_runs_what_cpu_supports_on_your_own_cnn(tmp_path, capsys):
    from turbotrain.cli import main

    path = tmp_path / "my_cnn.py"
    path.write_text(USER_CNN)
    out = tmp_path / "out"
    assert (
        main(
            [
                "bench",
                "--model",
                f"{path}:make",
                "--matrix",
                "precision",
                "--warmup",
                "1",
                "--steps",
                "2",
                "--threads",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads((out / "my_cnn-precision.json").read_text())  # named after the file, as train names runs
    rows = {r["row"]: r for r in doc["rows"]}
    assert rows["fp32"]["status"] == "ok" and rows["bf16-mixed"]["status"] == "ok"
    assert rows["tf32"]["status"] == "skipped" and "CUDA" in rows["tf32"]["reason"]
    assert rows["fp16-mixed"]["status"] == "skipped" and "needs a CUDA GPU" in rows["fp16-mixed"]["reason"]
    assert rows["fp32"]["speedup"] == 1.0 and rows["fp32"]["loss_diff"] == 0.0
    assert doc["summary"]["recommendation"]["row"] in rows and "recommended:" in render_report(doc)
    # FUNC re-run, seeded: same weights
    assert len({r["init_digest"] for r in rows.values() if r["status"] == "ok"}) == 1
    assert doc["workload"]["batch_size"] == 16 and doc["workload"]["task"] == "custom"
    assert doc["flops_per_step"] > 0 and "samples/s" in render_report(doc)
    assert abs(rows["bf16-mixed"]["loss_diff"]) <= rows["bf16-mixed"]["loss_tol"]
    assert main(["bench", "--model", f"{path}:missing", "--matrix", "precision"]) == 2
    assert "has no function 'missing'" in capsys.readouterr().err.strip().splitlines()[-1]


# A stand-in for the row processes' interpreter: each row "runs" for a moment and writes an ok
# result; the HANG_AT-th row hangs (leaves a marker first), like a row still compiling at the limit.
STAND_IN = """#!/bin/sh
dir=$(dirname "$0")
n=$(( $(cat "$dir/count" 2>/dev/null || echo 0) + 1 )); echo $n > "$dir/count"
while [ "$1" != --result ]; do shift; done
if [ $n -eq {hang_at} ]; then touch "$dir/hanging"; sleep {hang_s}; fi
sleep 0.2
printf '{{"status": "ok", "step_ms_median": %s.0, "step_ms": [1.0], "time_to_first_step_s": 0.5, "first_loss": 2.0,
 "final_loss": 1.0, "losses": [2.0, 1.0], "init_digest": "d", "math_precision": "fp32", "device": "cpu",
 "device_name": "stand-in"}}' $((10 + n)) > "$2"
"""


def _drive(standin: Path, work: Path, out: Path, kind: str, repeat: int) -> None:
    """What `turbotrain bench --out DIR` does, with the stand-in as the rows' interpreter."""
    sys.executable = str(standin)
    exit_on_sigterm()
    w = resolve_workload("mlp-tiny", "cpu", warmup_steps=1, timed_steps=2)
    opts = BenchOptions(device="cpu", work_dir=work, repeat=repeat, progress=ReportWriter(out, "driver", []))
    if kind == "compare":
        run_compare(w, opts, ["eager", "handtuned", "turbotrain"])
    elif kind == "precision":
        run_precision_matrix(w, opts)
    else:
        run_ablation(w, opts, only=["+compile", "+fused-adamw"])


@pytest.mark.parametrize(
    "kind, repeat, hang_at, expect_ok, expect_missing",
    [
        ("compare", 1, 3, ["eager", "handtuned"], ["turbotrain"]),
        (
            "precision",
            2,
            6,
            ["fp32", "fp16-mixed", "bf16-mixed", "bf16-true"],  # tf32: skipped on CPU
            ["fp16-mixed (run 2)", "bf16-mixed (run 2)", "bf16-true (run 2)"],
        ),
        ("ablation", 1, 2, ["baseline"], ["+compile", "+fused-adamw"]),
    ],
)
def test_a_bench_stopped_at_its_limit_keeps_every_finished_row(
    tmp_path, kind, repeat, hang_at, expect_ok, expect_missing
):
    import os
    import signal
    import time

    standin = tmp_path / "python"
    # the hanging row outlives the SIGTERM wait below: a bench that waited for it would fail the test
    standin.write_text(STAND_IN.format(hang_at=hang_at, hang_s=int(3 * HANG_S)))
    standin.chmod(0o755)
    out = tmp_path / "out"
    # the bench's own process (forked: it is SIGTERM-ed below), its rows the stand-in's
    proc = inprocess.fork(
        lambda: _drive(standin, tmp_path / "work", out, kind, repeat), tmp_path / "driver.txt"
    )
    try:
        deadline = time.monotonic() + HANG_S
        while not (tmp_path / "hanging").exists():
            assert proc.poll() is None and time.monotonic() < deadline, (
                "the bench ended before the hanging row"
            )
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)  # the step limit: `timeout` sends SIGTERM
        assert proc.wait(timeout=HANG_S) == 128 + signal.SIGTERM, (tmp_path / "driver.txt").read_text()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    doc = json.loads((out / f"mlp-tiny-{kind}.json").read_text())
    rows = {r["row"]: r for r in doc["rows"]}
    assert doc["complete"] is False and doc["missing"] == expect_missing
    assert [n for n, r in rows.items() if r["status"] == "ok"] == expect_ok
    assert all(rows[n]["status"] in ("not run", "skipped") for n in rows if n not in expect_ok)
    if repeat > 1:  # fp32 finished both runs, the others one each
        assert len(rows["fp32"]["runs"]) == 2 and "runs" not in rows["bf16-true"]
    assert doc["git"] and doc["env"] and doc["command"] == "driver"
    text = (out / f"mlp-tiny-{kind}.md").read_text()
    assert "INCOMPLETE" in text and ", ".join(expect_missing) in text
    assert ("not run (bench stopped before this row)" in text) == (repeat == 1)
