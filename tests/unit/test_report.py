"""turbotrain report: plots and summaries from run directories, including broken ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from turbotrain.app.report import format_markdown, summarize_records, write_report
from turbotrain.base.errors import TurbotrainError
from turbotrain.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def _gpu_records(n: int = 12) -> list[dict]:
    out = []
    for i in range(1, n + 1):
        step = 10 * i
        r = {
            "step": step,
            "loss": 5.0 / i,
            "step_ms": 100.0 + (50 if i == 1 else 0),
            "samples_per_s": 320.0,
            "tokens_per_s": 327_680.0 + i,
            "lr": 1e-3 * min(1, i / 3),
            "tflops": 400.0,
            "mfu": 0.40 + i / 1000,
            "mem_allocated_gib": 10.0,
            "mem_reserved_gib": 12.0,
            "mem_peak_gib": 11.0 + i / 10,
            "gpu_util_pct": 98.0,
            "gpu_mem_util_pct": 60.0,
            "gpu_power_w": 650.0,
            "gpu_temp_c": 60,
        }
        if i % 4 == 0:
            r["val_loss"] = 5.5 / i
        out.append(r)
    return out


def _run_dir(tmp_path: Path, records: list[dict], *, tail: str = "", summary: dict | None = None) -> Path:
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    (run / "config.toml").write_text('preset = "gpt2-small"\n\n[model]\nn_layer = 12\n')
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


@pytest.mark.slow
def test_gpu_run_gets_all_six_plots_and_a_summary(tmp_path):
    run = _run_dir(
        tmp_path,
        _gpu_records(),
        summary={
            "run": "r",
            "status": "completed",
            "steps": 120,
            "first_step_s": 31.5,
            "hardware": {"device": "cuda:0", "name": "NVIDIA H200"},
        },
    )
    result = write_report(run)
    names = sorted(Path(p).name for p in result.plots)
    assert names == ["gpu.png", "loss.png", "lr.png", "memory.png", "mfu.png", "throughput.png"]
    for p in result.plots:
        data = (run / p).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["first_step_s"] == 31.5  # training's keys kept
    steady = summary["steady_state"]
    assert steady["windows"] == 11 and steady["step_ms"] == 100.0  # first (warm-up) window left out
    assert summary["peak_memory_gib"] == pytest.approx(12.2) and summary["best_val_loss"] == pytest.approx(
        5.5 / 12
    )
    md = (run / "summary.md").read_text()
    for text in (
        "## Hardware",
        "NVIDIA H200",
        "## Optimizations in effect",
        "| MFU | 40.",
        "31.50 s",
        "![loss](plots/loss.png)",
        "## Resolved config",
    ):
        assert text in md, text


@pytest.mark.slow
def test_cpu_run_skips_memory_and_gpu_plots_and_says_why(tmp_path):
    records = [
        {k: v for k, v in r.items() if not k.startswith(("mem_", "gpu_", "mfu"))} for r in _gpu_records(5)
    ]
    result = write_report(_run_dir(tmp_path, records))
    assert sorted(Path(p).name for p in result.plots) == ["loss.png", "lr.png", "mfu.png", "throughput.png"]
    notes = "\n".join(result.skipped)
    assert "memory.png: skipped" in notes and "only measured on CUDA" in notes
    assert "gpu.png: skipped" in notes and "mfu.png: shows achieved TFLOP/s only" in notes
    assert any("no summary.json" in p for p in result.problems)


@pytest.mark.slow
def test_metrics_cut_off_mid_line_plot_what_is_there(tmp_path, capsys):
    run = _run_dir(tmp_path, _gpu_records(6), tail='{"step": 70, "loss": 0.7, "tokens_per')
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr()
    assert "the last line is cut off" in out.out and "Traceback" not in out.err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["last_step"] == 60 and summary["logged_steps"] == 6
    assert (run / "plots" / "loss.png").is_file()


def test_missing_dir_and_a_dir_that_is_not_a_run_are_one_line_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "does not exist" in err[0] and "not a run directory" in err[1]
    with pytest.raises(TurbotrainError):
        write_report(tmp_path / "nope")


def test_run_without_metrics_still_gets_a_summary(tmp_path):
    run = _run_dir(tmp_path, [])
    (run / "metrics.jsonl").unlink()
    result = write_report(run)
    assert result.plots == [] and any("no metrics.jsonl" in p for p in result.problems)
    md = (run / "summary.md").read_text()
    assert "no metrics.jsonl" in md and "n_layer" in md


def test_summarize_records_on_nothing_is_empty_not_an_error():
    s = summarize_records([])
    assert (
        s["steady_state"]["tokens_per_s"] is None and s["peak_memory_gib"] is None and s["last_step"] is None
    )


def test_a_run_without_token_ids_is_counted_in_samples():
    steady = {"windows": 4, "tokens_per_s": 0.0, "samples_per_s": 1500.0}
    images = format_markdown(
        {
            "run": "r",
            "status": "completed",
            "steps": 64,
            "max_steps": 64,
            "samples": 4096,
            "tokens": 0,
            "steady_state": steady,
        }
    )
    assert (
        "64 of 64 optimizer steps, 4,096 samples," in images and "tokens" not in images.split("## Losses")[0]
    )
    assert "| steady-state samples/s (median of 4 windows) | 1,500.0 |" in images
    text = format_markdown(
        {
            "run": "r",
            "status": "completed",
            "steps": 2,
            "max_steps": 2,
            "samples": 64,
            "tokens": 8192,
            "steady_state": {**steady, "tokens_per_s": 4096.0},
        }
    )
    assert (
        "2 of 2 optimizer steps, 8,192 tokens," in text
        and "| steady-state tokens/s (median of 4 windows) | 4,096 |" in text
    )
