"""The regime's device timeline on a real GPU (skipped without CUDA): gpt-tiny in eager on a
datacenter GPU is launch-bound (its kernels are tiny: the host's enqueue outlasts the device's busy
time), and doctor's probe says so in one line."""

import pytest

from turbotrain.app.choose.session import doctor_regime, probe_run
from turbotrain.app.measure import Target

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def test_a_tiny_eager_step_is_launch_bound_on_the_timeline(tmp_path):
    regime, figures = probe_run(Target(preset="gpt-tiny"), {"compile": {"scope": "off"}}, tmp_path)
    print(regime.line(), {k: figures.get(k) for k in ("step_ms_median", "device_busy_ms", "host_enqueue_ms")})
    assert figures["device_busy_ms"] > 0 and not figures["launch_queue_full"]
    assert figures["host_enqueue_ms"] > figures["device_busy_ms"]
    assert regime.name == "launch-bound"


def test_doctor_probes_once_and_says_the_regime(tmp_path):
    out = doctor_regime("gpt-tiny", None)
    assert out["line"].startswith("regime: ") and "a probe of 8 eager steps" in out["line"]
    assert out["figures"]["device_busy_ms"] is not None
