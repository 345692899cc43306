"""Whole-step CUDA graphs on a real GPU (skipped without CUDA): a captured step trains as eager
(fused AdamW, accumulation 2, clipping, an LR schedule outside the graph), replays after the
warm-up, and a small launch-bound step gets faster (figure printed; timing is the GPU plan's)."""

import time

import pytest
import torch

from turbotrain import Engine
from turbotrain.core.graphs import StepGraph
from turbotrain.parts.models.mlp import TinyMLP, synthetic_batches

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
STEPS = 30


def _train(graphs: bool):
    torch.manual_seed(0)
    engine = Engine(
        {
            "precision": {"mode": "fp32", "tf32": False},
            "compile": {"scope": "off", "cuda_graphs": graphs},
            "batch": {"accumulation": 2},
            "optim": {"grad_clip": 0.5},
        }
    )
    model = TinyMLP(d_in=256, width=256, depth=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model, optimizer, _ = engine.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    batches = [tuple(t.cuda() for t in b) for b in synthetic_batches(2 * STEPS, batch_size=64, d_in=256)]
    kept = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in range(STEPS):
        engine.train_window(model, optimizer, batches[2 * s : 2 * s + 2])
        kept.append(engine.last_loss)
        scheduler.step()
    torch.cuda.synchronize()
    return [float(x) for x in kept], (time.perf_counter() - t0) / STEPS * 1000, engine


def test_a_captured_step_trains_as_eager_on_the_gpu():
    eager, eager_ms, _ = _train(False)
    captured, graph_ms, engine = _train(True)
    wrapper = engine.window.wrapper
    assert isinstance(wrapper, StepGraph) and not wrapper.refused, wrapper.refused
    assert wrapper.captures == 1 and wrapper.replays == STEPS - 2
    assert captured == pytest.approx(eager, rel=1e-5, abs=1e-6)  # the schedule reached the graph
    print(f"tiny MLP step (incl. warm-up and capture): eager {eager_ms:.3f} ms, CUDA graph {graph_ms:.3f} ms")
