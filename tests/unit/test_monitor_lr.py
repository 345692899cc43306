"""The learning rate in a record is a number even where it is a device tensor (whole-step CUDA
graphs make the optimizer's LR a tensor so the schedule acts inside the replayed graph): a string
there would drop it from lr.png and the trackers (found in review: ``"lr": "tensor(0.0010)"``)."""

from __future__ import annotations

import json

import torch

from turbotrain.loop.monitor import JsonlSink, Monitor


def test_a_tensor_learning_rate_is_recorded_as_a_number(tmp_path):
    path = tmp_path / "metrics.jsonl"
    monitor = Monitor(interval=1, sinks=[JsonlSink(path)])
    monitor.observe(1, torch.tensor(2.0), lr=torch.tensor(1e-3))
    monitor.close()
    record = json.loads(path.read_text().splitlines()[-1])
    assert isinstance(record["lr"], float) and abs(record["lr"] - 1e-3) < 1e-9
