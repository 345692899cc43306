"""Whole-step CUDA graphs (core/graphs.py), on CPU with a stand-in graph: the bookkeeping around a
capture (static input buffers fed each step, the loss copied out before the next replay,
accumulation, clipping, the non-finite guard) trains exactly as without it; the refusals (CPU,
a host sync in the step, dynamic shapes) are one line each and the run goes on without graphs.
A real capture needs CUDA: tests/gpu/test_graphs_gpu.py."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from torch import nn

from turbotrain import Engine
from turbotrain.core.graphs import StepGraph
from turbotrain.core.precision import NonFiniteGuard
from turbotrain.parts.models.mlp import TinyMLP, synthetic_batches

ACCUMULATION, STEPS = 2, 8


class StandInGraph:
    """A CUDA graph's contract on CPU: ``capture`` records the step without running it; each
    ``replay`` runs it on the static inputs and writes the results into the same output tensors
    (as a graph overwrites its outputs)."""

    made = 0

    def __init__(self) -> None:
        StandInGraph.made += 1
        self.fn = None
        self.outputs = None

    def capture(self, fn):
        self.fn = fn

    def replay(self):
        out = self.fn()
        if self.outputs is None:
            self.outputs = out
        else:
            for dst, src in zip(self.outputs, out):
                if dst is not None:
                    dst.copy_(src)


class Syncing(nn.Module):
    """A model whose forward reads a device value on the host (data-dependent control flow)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = TinyMLP(d_in=16, width=32, depth=2)

    def forward(self, x, y):
        loss = self.mlp(x, y)
        if loss > 100:  # a Python if on a tensor: a host sync
            loss = loss * 0
        return loss


def _train(graphs: StepGraph | None, model_cls=None, batches=None, device_guard=True):
    torch.manual_seed(0)
    model = model_cls() if model_cls else TinyMLP(d_in=16, width=32, depth=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    engine = Engine(
        {"run": {"device": "cpu"}, "batch": {"accumulation": ACCUMULATION}, "optim": {"grad_clip": 0.5}}
    )
    model, optimizer, _ = engine.setup(model, optimizer)
    if device_guard:  # as on CUDA: the guard counts on the device (the CPU one reads the loss on the host)
        engine.window.guard = NonFiniteGuard(engine.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    if graphs is not None:
        engine.wrap_window(graphs)
    batches = batches or synthetic_batches(STEPS * ACCUMULATION, batch_size=8, d_in=16)
    kept = []  # the engine's loss tensors, kept across steps as a user's loop keeps them
    for s in range(len(batches) // ACCUMULATION):
        assert engine.train_window(model, optimizer, batches[s * ACCUMULATION : (s + 1) * ACCUMULATION])
        kept.append(engine.last_loss)
        scheduler.step()  # outside the graph: the learning rate the next replay reads
    return [float(x) for x in kept], [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
def test_a_captured_step_trains_exactly_as_eager_and_its_losses_survive_the_next_replay():
    eager, w_eager = _train(None)
    graphs = StepGraph(torch.device("cpu"), warmup=2, graph_factory=StandInGraph)
    captured, w_captured = _train(graphs)
    assert not graphs.refused
    assert (graphs.captures, graphs.replays) == (1, STEPS - 2)  # two eager warm-up steps, then replays
    assert captured == eager  # each step's loss its own: copied out before the next replay
    assert len(set(captured)) == STEPS
    assert all(torch.equal(a, b) for a, b in zip(w_captured, w_eager))  # clipping, accumulation, schedule


@pytest.mark.slow
def test_on_cpu_without_a_stand_in_it_is_refused_in_one_line(caplog):
    caplog.set_level(logging.WARNING)
    eager, _ = _train(None)
    graphs = StepGraph(torch.device("cpu"))
    assert _train(graphs)[0] == eager
    assert graphs.refused == "CUDA graphs need a CUDA device; this run is on cpu"
    lines = [r.message for r in caplog.records if "cuda_graphs" in r.message]
    assert len(lines) == 1 and "\n" not in lines[0] and "goes on without" in lines[0]


@pytest.mark.slow
def test_a_host_sync_in_the_step_is_refused_naming_where():
    eager, _ = _train(None, Syncing)
    graphs = StepGraph(torch.device("cpu"), graph_factory=StandInGraph)
    assert _train(graphs, Syncing)[0] == eager
    assert "aten._local_scalar_dense at test_graphs.py:" in graphs.refused
    assert "data-dependent control flow" in graphs.refused and graphs.captures == 0


@pytest.mark.slow
def test_the_cpu_guard_reads_the_host_and_is_refused_too():
    graphs = StepGraph(torch.device("cpu"), graph_factory=StandInGraph)
    _train(graphs, device_guard=False)
    assert "aten._local_scalar_dense" in graphs.refused and graphs.captures == 0


@pytest.mark.slow
def test_dynamic_shapes_after_capture_are_refused_and_the_run_goes_on():
    batches = synthetic_batches(STEPS * ACCUMULATION, batch_size=8, d_in=16)
    batches[-2:] = synthetic_batches(2, batch_size=5, d_in=16, seed=1)  # a short last step
    eager, _ = _train(None, batches=batches)
    graphs = StepGraph(torch.device("cpu"), graph_factory=StandInGraph)
    assert _train(graphs, batches=batches)[0] == eager
    assert graphs.refused.startswith("dynamic shapes: ") and "[8, 16] float32" in graphs.refused
    assert "[5, 16] float32" in graphs.refused


def test_the_setting_turns_it_on_and_cpu_refuses(caplog):
    caplog.set_level(logging.WARNING)
    engine = Engine({"run": {"device": "cpu"}, "compile": {"cuda_graphs": True}})
    model, optimizer, _ = engine.setup(TinyMLP(d_in=16, width=32, depth=2), None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in synthetic_batches(2, batch_size=8, d_in=16):
        assert engine.train_window(model, optimizer, [batch])
    assert any("CUDA graphs need a CUDA device" in r.message for r in caplog.records)


def _sum_step(model, optimizer, micro, *_):
    """A window body whose loss is its micro-batches' sum (fresh tensors each call, as a step's)."""
    return sum(b.float().sum() for b, _ in micro), None


def _call(step, batch: torch.Tensor):
    """One window of one micro-batch through the wrapped body (the body's arguments after the loss
    function, if any, are its accumulation)."""
    extra = len(inspect.signature(step).parameters) - 4
    return step(None, None, [(batch, 1.0)], None, *[1] * extra)


def test_each_replays_loss_is_copied_out_before_the_next_replay_overwrites_it():
    """The graph writes every replay's loss into the same output tensor: the step's returned loss
    is a copy, so a loss a caller keeps (a list of losses, a logger's window) stays its own step's."""
    graphs = StepGraph(torch.device("cpu"), warmup=1, graph_factory=StandInGraph)
    step = graphs(_sum_step)
    losses = [_call(step, torch.full((4,), float(s)))[0] for s in range(1, 5)]
    assert (graphs.captures, graphs.replays) == (1, 3)
    assert [float(x) for x in losses] == [4.0, 8.0, 12.0, 16.0]


def test_a_step_whose_dtypes_differ_from_the_captured_ones_is_refused_naming_both():
    graphs = StepGraph(torch.device("cpu"), warmup=1, graph_factory=StandInGraph)
    step = graphs(_sum_step)
    for s in range(3):
        _call(step, torch.full((4,), float(s)))
    assert graphs.captures == 1 and not graphs.refused
    loss, _ = _call(step, torch.full((4,), 5.0, dtype=torch.float64))
    assert float(loss) == 20.0  # run eagerly on its own inputs, not copied into the float32 buffer
    assert graphs.refused.startswith("dynamic shapes: ") and "changed shape or dtype" in graphs.refused
    assert "captured [4] float32, now [4] float64" in graphs.refused
