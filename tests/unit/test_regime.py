"""The regime named from a probe's figures (app/regime.py), injected: each of the four regimes
from the figures that define it, the CPU caveat, and the probe read from profile's figures."""

from __future__ import annotations

from turbotrain.app.regime import Probe, classify, probe_from


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
    assert r.name == "compute-bound" and "cannot be told apart" in r.why
    assert r.line().startswith("regime: compute-bound (")


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
    assert p == Probe(10.0, 0.5, 4.0, 6.0, 12.0, 989.0)
    assert classify(p).name == "launch-bound"
    assert probe_from(figures).step_ms == 9.0 and probe_from(figures).device_busy_ms is None
