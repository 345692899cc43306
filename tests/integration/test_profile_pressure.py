"""`turbotrain profile`'s memory-pressure and throughput-trend rules (app/profile/pressure.py)."""

from __future__ import annotations

import textwrap

from turbotrain.app.measure import Target
from turbotrain.app.profile import ProfileOptions, profile_target
from turbotrain.app.profile.pressure import throughput_trend
from turbotrain.base.config import audience

WORKLOAD = """
import torch
from torch import nn
from turbotrain import Workload

def wide():
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 4))
    batches = [(torch.randn(64, 256), torch.randint(4, (64,))) for _ in range(4)]
    loss = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])
    return Workload(model=model, train_loader=batches, loss_fn=loss)
"""


def test_a_step_near_its_memory_budget_is_named_with_the_two_ways_out(tmp_path):
    path = tmp_path / "wl.py"
    path.write_text(textwrap.dedent(WORKLOAD))
    # the weights (~1 MiB) plus 1 MiB: the step's gradients, Adam's state and activations fill it
    target = Target(
        model=f"{path}:wide",
        overrides={
            "run": {"device": "cpu", "out_dir": str(tmp_path / "runs")},
            "batch": {"max_memory_gib": 1 / 1024},
        },
    )
    with audience("cli"):  # on one CPU thread, as the whole suite (tests/conftest.py)
        doc = profile_target(target, ProfileOptions(warmup=1, timed=3, steps=1), log=lambda line: None)
    (memory,) = [r for r in doc["recommendations"] if r["category"] == "memory"]
    assert "GiB it may use (batch.max_memory_gib, plus the weights already in RAM)" in memory["why"]
    assert memory["change"] == "--memory.checkpointing=selective or --batch.micro=32 --batch.accumulation=2"
    assert memory["settings"] == {}  # not a speed-up: --verify does not time it


def test_a_falling_throughput_is_named_and_a_steady_one_is_not():
    assert throughput_trend([10.0, 10.2, 9.9, 10.1, 10.3, 10.0, 10.1, 9.8, 10.2]) == []
    (found,) = throughput_trend([10.0, 10.1, 9.9, 11.0, 11.5, 12.0, 12.5, 13.0, 13.2])
    assert found["category"] == "trend" and "30% above the first 3's 10.0 ms" in found["why"]
    assert "gpu_sm_clock_mhz" in found["change"] and "host_rss_gib" in found["change"]
    assert throughput_trend([10.0, 20.0, 30.0]) == []  # too few steps to say
