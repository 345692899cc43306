"""The regime named from a probe's figures (app/regime.py), injected: each of the four regimes
from the figures that define it, the CPU caveat, and the probe read from profile's figures."""

from __future__ import annotations

import dataclasses
import json
import logging
from types import SimpleNamespace

import pytest
import torch

from turbotrain import load_config
from turbotrain.app import regime
from turbotrain.app.choose.session import choose_for_run, doctor_regime, name_regime
from turbotrain.app.regime import CPU_LINE, Probe, Timeline, classify, probe_from, probe_of


def test_each_regime_from_the_figures_that_make_it():
    # a loader that holds the step
    assert classify(Probe(step_ms=10.0, data_wait_ms=4.0, device_busy_ms=5.0)).name == "data-bound"
    # the CIFAR CNN on an H100: kernels take 3 ms of a 5.6 ms step, the host enqueues for 5 ms
    launch = classify(Probe(step_ms=5.6, device_busy_ms=3.0, host_enqueue_ms=5.0, tflops=40, peak_tflops=989))
    assert launch.name == "launch-bound" and "idles 46%" in launch.why and "5.00 ms to enqueue" in launch.why
    # GPT-2 small: busy all the step at ~40% of the peak
    compute = classify(Probe(step_ms=35.0, device_busy_ms=34.5, tflops=400, peak_tflops=989))
    assert compute.name == "compute-bound" and "40% of the datasheet peak" in compute.why
    # busy, but at 8% of the peak: elementwise kernels waiting on memory
    bw = classify(Probe(step_ms=20.0, device_busy_ms=19.0, tflops=80, peak_tflops=989))
    assert bw.name == "memory-bandwidth-bound" and "wait on memory" in bw.why


def test_on_a_cpu_the_caveat_is_said():
    r = classify(Probe(step_ms=2.0, data_wait_ms=0.1))
    # train's and doctor's word for a CPU (CPU_LINE), in profile too (#47 item 6)
    assert r.name == "not separable" and "cannot be told apart" in r.why
    assert r.line().startswith("regime: not separable (")


def test_the_probe_from_profiles_figures_and_trace():
    figures = {"step_ms_median": 9.0, "data_wait_ms_per_step": 0.5, "tflops": 12.0}
    trace = {
        "profiled_step_ms": 10.0,
        "phases": {
            "data": {"host_ms": 0.5},
            "forward": {"host_ms": 3.0},
            "backward": {"host_ms": 2.0},
            "optimizer": {"host_ms": 1.0},
            "hooks": {"host_ms": 0.2},
            "other": {"host_ms": 3.3},
        },
        "device": {"busy_ms": 4.0},
    }
    p = probe_from(figures, trace, peak_tflops=989.0)
    # the report's one step time (the timed median, #47 item 6); the profiled host time scaled to it
    assert dataclasses.astuple(p) == pytest.approx((9.0, 0.5, 4.0, 5.4, 12.0, 989.0))
    assert classify(p).name == "launch-bound"
    assert probe_from(figures).step_ms == 9.0 and probe_from(figures).device_busy_ms is None


# ------------------------------------------------------------------ the timeline probe and where it is said


class FakeEvent:
    """torch.cuda.Event on a fake device clock (ms): ``record`` reads it, ``elapsed_time`` subtracts."""

    clock = [0.0]

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = None

    def record(self) -> None:
        self.t = FakeEvent.clock[0]

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.t - self.t


def _ctx(step: int):
    return SimpleNamespace(
        engine=SimpleNamespace(device=torch.device("cuda"), state=SimpleNamespace(step=step))
    )


def _drive(monkeypatch, host_ms: list[float], device_ms: list[float]) -> tuple[dict, dict]:
    """Steps 1..6 through a Timeline probing steps 3, 4, 5: each probed step takes ``host_ms`` on the
    host clock and ``device_ms`` on the device clock; what it measured and what it called."""
    calls = {"sleep": [], "sync": 0}
    host = [0.0]
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: calls["sleep"].append(cycles))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.__setitem__("sync", calls["sync"] + 1))
    monkeypatch.setattr(regime.time, "perf_counter", lambda: host[0] / 1000)
    t = Timeline(after=3)
    for step in range(1, 7):
        i = step - 4  # the probed step that ends here (steps 4, 5, 6 close 3's, 4's and 5's probes)
        if 0 <= i < 3:
            host[0] += host_ms[i]
            FakeEvent.clock[0] += device_ms[i]
        else:
            host[0] += 5.0
        t.on_step_end(_ctx(step))
    return t.figures(), calls


def test_the_timeline_times_host_enqueue_and_device_busy_with_one_sync(monkeypatch):
    # the CIFAR CNN's pattern: the host takes 5 ms to enqueue a step the device runs in 3
    figures, calls = _drive(monkeypatch, host_ms=[5.0, 5.2, 4.8], device_ms=[3.0, 3.1, 2.9])
    assert figures["device_busy_ms"] == pytest.approx(3.0) and figures["host_enqueue_ms"] == pytest.approx(
        5.0
    )
    assert figures["launch_queue_full"] is False
    assert calls["sync"] == 1  # read once, at the probe's end
    # the device held asleep before each probed step, longer than the host's last step (>= 20 ms)
    assert len(calls["sleep"]) == 3 and min(calls["sleep"]) >= 20 * regime.SLEEP_CYCLES_PER_MS
    p = probe_of({"step_ms_median": 5.6, **figures})
    assert classify(p).name == "launch-bound"


def test_a_host_that_waited_on_a_full_launch_queue_has_no_enqueue_time(monkeypatch):
    # the host's span reached the sleep (20 ms): it waited on the device, so only busy time counts
    figures, _ = _drive(monkeypatch, host_ms=[40.0, 40.0, 40.0], device_ms=[35.0, 35.0, 35.0])
    assert figures["launch_queue_full"] and figures["host_enqueue_ms"] is None
    r = classify(probe_of({"step_ms_median": 35.5, "tflops": 400.0, "peak_tflops": 989.0, **figures}))
    assert r.name == "compute-bound"


def test_on_a_cpu_the_timeline_measures_nothing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("no sync on a CPU"))
    t = Timeline(after=1)
    for step in range(1, 6):
        t.on_step_end(
            SimpleNamespace(
                engine=SimpleNamespace(device=torch.device("cpu"), state=SimpleNamespace(step=step))
            )
        )
    assert t.figures() == {}


def _config(tmp_path, **sections):
    base = {
        "run": {"device": "cpu"},
        "data": {"cache_dir": str(tmp_path / "cache")},
        "choose": {"measure": "always"},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return load_config("gpt-tiny", base)


def test_train_says_the_regime_from_chooses_figures_and_again_from_the_cache(tmp_path):
    """The kept recipe's figures name the regime (no probe of its own); the next run of the same
    model says it from the cached figures without measuring."""

    def timer(cand):
        if cand.name != "eager":
            raise RuntimeError("only eager in this test")
        return {
            "step_ms_median": 10.0,
            "first_step_s": 0.5,
            "final_loss": 3.0,
            "math_precision": "fp32",
            "data_wait_ms_per_step": 0.2,
            "device_busy_ms": 4.0,  # as a GPU's timeline would give them
            "host_enqueue_ms": 9.5,
        }

    config = _config(tmp_path, compile={"scope": "off"})
    said: list[str] = []
    for run in ("run1", "run2"):
        (tmp_path / run).mkdir()
    choose_for_run(config, tmp_path / "run1", say=said.append, measure=timer)
    line = said[-1]
    assert line.startswith("regime: launch-bound (") and "[choose's figures of eager]" in line
    assert json.loads((tmp_path / "run1" / "choose.json").read_text())["regime"]["name"] == "launch-bound"
    said.clear()
    choose_for_run(
        config, tmp_path / "run2", say=said.append, measure=lambda c: pytest.fail("measured again")
    )
    assert said[-1] == line


def test_a_cpu_run_that_measures_nothing_says_the_caveat_in_one_line(tmp_path, caplog):
    said: list[str] = []
    config = _config(tmp_path, choose={"measure": "off"})
    with caplog.at_level(logging.DEBUG, logger="turbotrain.app.choose"):
        assert choose_for_run(config, tmp_path / "run", say=said.append) == config
    # nothing measured: the caveat at debug level, off the first screen (#47 item 1)
    assert said == [] and [r.getMessage() for r in caplog.records] == [CPU_LINE]
    assert "cannot be" in CPU_LINE and not (tmp_path / "run").exists()
    assert name_regime(config, None) == CPU_LINE
    assert doctor_regime("gpt-tiny", None) == {"line": CPU_LINE}  # no GPU here: nothing probed
