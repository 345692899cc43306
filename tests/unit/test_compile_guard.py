"""The compile guard counts torch.compile's recompilations and graph breaks of a run, reports
them in summary.json and summary.md, and warns naming the cause when they keep happening.

One tiny model compiled with dynamo's ``eager`` backend (no Inductor: seconds, not minutes);
the guard reads dynamo's own counters, which are the same whatever the backend."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from turbotrain import Engine
from turbotrain.app.tracking import track
from turbotrain.core.compile_guard import CompileGuard, collect_compile_counts


class TinyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)


@pytest.mark.slow
def test_recompiles_after_warmup_are_counted_in_the_summary_and_the_warning_names_the_cause(tmp_path, caplog):
    torch.manual_seed(0)
    model = TinyMLP()
    model.compile(backend="eager", dynamic=False)  # every new batch size is a new graph
    sizes = [4, 4, 5, 6, 7, 8, 9, 10]  # warm-up = the first log window (2 steps), then 6 new shapes
    batches = [(torch.randn(n, 8), torch.randn(n)) for n in sizes]
    engine = Engine({"monitor": {"log_every": 2}, "compile": {"max_recompiles": 2}})
    model, optimizer, loader = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.01), batches)
    with caplog.at_level(logging.WARNING, logger="turbotrain.core.compile_guard"):
        with track(
            engine, model, optimizer, tmp_path / "run", log_every=2, progress=False, nvml=False
        ) as run:
            for x, y in loader:
                engine.backward(model(x, y))
                engine.step(optimizer)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    comp = summary["compile"]
    assert comp["recompiles_after_warmup"] == 6  # sizes 5..10
    assert comp["recompiles"] >= 6 and comp["frames_compiled"] >= 7
    assert "size mismatch" in comp["warning"] and "expected 4" in " ".join(comp["recompile_reasons"])
    assert any("size mismatch" in r.getMessage() for r in caplog.records)
    md = (tmp_path / "run" / "summary.md").read_text()
    assert "## Compile" in md and "size mismatch" in md
    assert run.engine.compile_guard.warning == comp["warning"]


def test_a_run_without_compile_reports_nothing_and_never_warns():
    before = collect_compile_counts()
    guard = CompileGuard(max_recompiles=1, warmup_steps=1)
    for step in (1, 2, 3):
        assert guard.check(step) == ""
    assert guard.summary()["recompiles"] == 0 and guard.summary()["graph_breaks"] == 0
    assert collect_compile_counts().minus(before).frames == 0


class BrokenMLP(TinyMLP):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.net[0](x)
        torch._dynamo.graph_break()  # the compiled model runs as two graphs with Python between them
        return nn.functional.mse_loss(self.net[2](self.net[1](h)).squeeze(-1), y)


def test_graph_breaks_are_counted_with_their_reason():
    torch.manual_seed(0)
    model = BrokenMLP()
    model.compile(backend="eager")
    engine = Engine({"monitor": {"log_every": 2}})
    model, optimizer, loader = engine.setup(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        [(torch.randn(4, 8), torch.randn(4)) for _ in range(4)],
    )
    for x, y in loader:
        engine.backward(model(x, y))
        engine.step(optimizer)
    comp = engine.compile_guard.summary()
    assert comp["graph_breaks"] >= 1 and comp["recompiles"] == 0 and not comp["warning"]
    assert "graph_break" in " ".join(comp["graph_break_reasons"])
