"""The throughput a record reports is the logging window's, not the run's so far: step_ms,
samples/s, tokens/s, TFLOP/s and MFU each computed from the steps, samples and tokens of the
window and the seconds it took (evaluation and checkpoint time left out). The window's length is
set by a fake clock, so every figure is known exactly; the pace changes between windows, so a
figure from the run's totals would differ."""

from __future__ import annotations

import types

import pytest

import turbotrain.loop.monitor.hook as monitor_module
from turbotrain.loop.monitor import MfuProbe, Monitor
from turbotrain.parts.hardware import lookup_peak

# per step; FLOPs of one sample's forward + backward
SAMPLES, TOKENS_PER_SAMPLE, FLOPS_PER_SAMPLE = (
    8,
    16,
    3e9,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0  # seconds; every value here is a binary fraction, so differences are exact

    def __call__(self) -> float:
        return self.now


def test_each_record_is_its_windows_throughput_tflops_and_mfu(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(monitor_module, "time", types.SimpleNamespace(perf_counter=clock, monotonic=clock))
    spec = lookup_peak("NVIDIA H100 80GB HBM3")
    assert spec is not None
    probe = MfuProbe(FLOPS_PER_SAMPLE, spec, "bf16-mixed", tokens_per_sample=TOKENS_PER_SAMPLE)
    monitor = Monitor(2, probes=[probe])
    monitor.start()
    # step 1 takes 1 s (warm-up, reported apart), steps 2-4 0.25 s each, steps 5-6 0.5 s each, and
    # 0.5 s of evaluation before step 6's record
    seconds = {1: 1.0, 2: 0.25, 3: 0.25, 4: 0.25, 5: 0.5, 6: 1.0}
    side_s, records = 0.0, {}
    for step in range(1, 7):
        clock.now += seconds[step]
        side_s += 0.5 if step == 6 else 0.0
        record = monitor.observe(
            step,
            1.0,
            lr=1e-3,
            samples=step * SAMPLES,
            tokens=step * SAMPLES * TOKENS_PER_SAMPLE,
            side_s=side_s,
        )
        if record is not None:
            records[record["step"]] = record
    assert sorted(records) == [2, 4, 6] and monitor.first_step_s == 1.0
    pace = {2: (0.25, 1), 4: (0.5, 2), 6: (1.0, 2)}  # the window's training seconds and optimizer steps
    for step, (window_s, steps) in pace.items():
        r = records[step]
        assert r["step_ms"] == 1000 * window_s / steps
        assert r["samples_per_s"] == steps * SAMPLES / window_s
        assert r["tokens_per_s"] == steps * SAMPLES * TOKENS_PER_SAMPLE / window_s
        flops_per_s = r["samples_per_s"] * FLOPS_PER_SAMPLE
        assert r["tflops"] == pytest.approx(flops_per_s / 1e12, rel=1e-12)
        # H100 SXM: 989 dense bf16 TFLOP/s
        assert r["mfu"] == pytest.approx(flops_per_s / (989 * 1e12), rel=1e-12)
    # since the first step: 40 samples in 1.75 s, not 16/s
    assert [records[s]["samples_per_s"] for s in (2, 4, 6)] == [
        32.0,
        32.0,
        16.0,
    ]
    assert records[6]["elapsed_s"] == 3.25 and records[6]["samples"] == 48


def test_the_window_restarts_after_a_resume_at_the_saved_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    # a resumed run starts its clock at the checkpoint's step, samples and tokens: its first window
    # counts only what this invocation trained
    clock = Clock()
    monkeypatch.setattr(monitor_module, "time", types.SimpleNamespace(perf_counter=clock, monotonic=clock))
    monitor = Monitor(1)
    monitor.start(step=10, samples=80, tokens=1280)
    clock.now += 2.0
    monitor.observe(11, 1.0, samples=88, tokens=1408)  # the first step: warm-up, measured apart
    clock.now += 0.5
    record = monitor.observe(12, 1.0, samples=96, tokens=1536)
    assert record is not None and monitor.first_step_s == 2.0
    assert (record["step_ms"], record["samples_per_s"], record["tokens_per_s"]) == (500.0, 16.0, 256.0)
