"""The example CNN (examples/workload_cnn.py) with a validation metric that stops improving at a
known step: ``val_score`` by the optimizer step it is computed at (0.2, 0.5, 0.6 at steps 1, 2,
3; then 0.6 and 0.64, which a min_delta of 0.05 does not count; 0.9 from step 6 on, which an
early stop at step 5 never sees). Read from the optimizer's own step count, so a resumed run
scores as the uninterrupted one. Used by tests/integration/test_early_stop.py (not a test module)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from turbotrain import Workload

_spec = importlib.util.spec_from_file_location(
    "workload_cnn_example", Path(__file__).resolve().parents[2] / "examples" / "workload_cnn.py"
)
assert _spec is not None and _spec.loader is not None
cnn = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cnn)

SCORES = {1: 0.2, 2: 0.5, 3: 0.6, 4: 0.6, 5: 0.64}


def make() -> Workload:
    w = cnn.make()
    optimizer = torch.optim.AdamW(w.model.parameters(), lr=1e-3)
    first = next(w.model.parameters())

    def scored(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = optimizer.state.get(first, {})
        step = int(state["step"]) if "step" in state else 0
        return {**cnn.accuracy(model, batch), "score": torch.tensor(SCORES.get(step, 0.9))}

    w.optimizer, w.metrics_fn = optimizer, scored
    return w


def make_nan() -> Workload:
    """The example CNN whose metrics_fn scores NaN at every validation pass (#44 items 3 and 4)."""
    w = cnn.make()

    def scored(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**cnn.accuracy(model, batch), "score": torch.tensor(float("nan"))}

    w.metrics_fn = scored
    return w
