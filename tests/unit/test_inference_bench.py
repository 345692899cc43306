"""bench --inference: the evaluation forward under inference_mode with the run's precision, timed
per batch; your model untouched; a preset's model on random tokens."""

from __future__ import annotations

import torch
from torch import nn

from turbotrain.app.bench.inference import benchmark_inference, inference_target


def test_the_forward_is_timed_under_inference_mode_in_the_runs_precision():
    seen = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.lin(x)
            seen.append((torch.is_inference_mode_enabled(), out.dtype))
            return out.float().square().mean()

    model = Probe()
    before = model.lin.weight.detach().clone()
    batches = [torch.randn(4, 8) for _ in range(2)]
    figures = benchmark_inference(
        model,
        batches,
        loss_fn=lambda m, b: m(b),
        iterations=5,
        warmup=2,
        config={"run": {"device": "cpu"}, "precision": {"mode": "bf16-mixed"}},
    )
    assert len(seen) == 7 and all(mode and dtype == torch.bfloat16 for mode, dtype in seen)
    assert figures["precision"] == "bf16-mixed" and len(figures["ms_per_batch_all"]) == 5
    assert (
        figures["samples_per_batch"] == 4 and figures["samples_per_s"] > 0 and figures["tokens_per_s"] is None
    )
    assert torch.equal(model.lin.weight, before)


def test_a_preset_runs_on_random_tokens_and_counts_tokens():
    model, batches, loss_fn, label = inference_target(
        "gpt-tiny", None, {"model": {"n_layer": 1, "d_model": 32, "n_head": 2, "block_size": 16}}, batch=2
    )
    figures = benchmark_inference(
        model, batches, loss_fn=loss_fn, iterations=2, warmup=1, config={"run": {"device": "cpu"}}
    )
    assert label == "gpt-tiny" and figures["tokens_per_s"] == figures["samples_per_s"] * 16
    assert 4.0 < figures["last_loss"] < 7.0  # about ln(256) on random bytes
