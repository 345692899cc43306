"""MFU that says what it counts (issue 35 item 5): the FLOP convention in the summary, activation
checkpointing's recomputation counted apart (HFU), and MFU unchanged by gradient accumulation and
by the number of ranks; every figure checked against a FLOP count done by hand."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from turbotrain import Engine, fit
from turbotrain.app.report import format_markdown
from turbotrain.app.summary import summarize_records
from turbotrain.core.transforms import apply_activation_checkpointing
from turbotrain.loop.monitor import (
    COUNTED,
    FORMULA,
    MfuProbe,
    Monitor,
    build_mfu_probe,
    count_flops,
    estimate_flops,
)
from turbotrain.parts.hardware import DeviceSpec
from turbotrain.parts.models.gpt import GPT, GPTConfig

D, BLOCKS = 64, 3
SPEC = DeviceSpec("test GPU", 100.0, 100.0, 50.0, 10.0, None, 1000.0)  # fp32: 10 TFLOP/s


class Stack(nn.Module):
    """``BLOCKS`` blocks of a D x D matmul (no bias) and a ReLU, then a D -> 4 head: FLOPs by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(D, D, bias=False), nn.ReLU()) for _ in range(BLOCKS)
        )
        self.head = nn.Linear(D, 4, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x), y)


# per sample, 2 FLOPs a multiply-add: forward 2 x weights; backward 2 x weights for the weight
# gradients and 2 x weights for the input gradients, except the first block's (the data needs none)
MODEL_FLOPS = 6 * (BLOCKS * D * D + D * 4) - 2 * D * D
RECOMPUTE_FULL = BLOCKS * 2 * D * D  # each checkpointed block's forward, once more in backward


def _batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, D), torch.randint(4, (n,))


@pytest.mark.slow
def test_recomputation_is_counted_apart_from_the_model_flops():
    model = Stack()
    assert count_flops(model, _batch()).model == MODEL_FLOPS
    assert count_flops(model, _batch()).recompute == 0
    apply_activation_checkpointing(model, "full")
    full = count_flops(model, _batch())
    assert (full.model, full.recompute) == (MODEL_FLOPS, RECOMPUTE_FULL)  # MFU's count does not move
    # the probe a run builds carries it: the HFU in its records, the recomputation in its summary
    probe = build_mfu_probe(model, _batch(), torch.device("cpu"))
    assert (probe.flops_per_sample, probe.recompute_per_sample) == (MODEL_FLOPS, RECOMPUTE_FULL)
    selective = Stack()
    apply_activation_checkpointing(selective, "selective")  # blocks 0 and 2
    assert count_flops(selective, _batch()).recompute == 2 * 2 * D * D


@pytest.mark.slow
def test_the_convention_is_named_the_formula_for_a_gpt_and_counted_otherwise():
    gpt = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, block_size=16))
    x = torch.randint(0, 64, (2, 16))
    found = estimate_flops(gpt, (x, x))
    assert (
        found.convention == FORMULA and found.model == gpt.flops_per_token(16) * 16 and found.recompute == 0
    )
    apply_activation_checkpointing(gpt, "full")
    assert estimate_flops(gpt, (x, x)).recompute > 0  # the formula's model FLOPs, the recompute counted
    assert estimate_flops(Stack(), _batch()).convention == COUNTED


def _mfu_run(world: int, accumulation: int, checkpointing: str, monkeypatch) -> list[dict]:
    """A fit of Stack with micro-batches of 8, every clock read 1 s after the last, MFU against a
    10 TFLOP/s fp32 peak per device; ``world`` ranks simulated as the Monitor and probe see them."""
    ticks = iter(range(10_000))
    monkeypatch.setattr(
        "turbotrain.loop.monitor.hook.time", types.SimpleNamespace(perf_counter=lambda: next(ticks))
    )
    model = Stack()
    apply_activation_checkpointing(model, checkpointing)
    engine = Engine({"run": {"device": "cpu"}, "batch": {"accumulation": accumulation}})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = engine.setup(model, optimizer, [_batch() for _ in range(6 * accumulation)])
    found = count_flops(model, _batch())
    probe = MfuProbe(found.model, SPEC, "fp32", devices=world, recompute_per_sample=found.recompute)
    monitor = Monitor(2, probes=[probe], world=world)
    fit(engine, model, optimizer, loader, max_steps=6, hooks=[monitor])
    return [r for r in monitor.records if "mfu" in r]


@pytest.mark.slow
@pytest.mark.parametrize("world, accumulation", [(1, 1), (1, 4), (2, 1), (4, 4)])
def test_mfu_is_the_hand_count_under_accumulation_and_several_ranks(world, accumulation, monkeypatch):
    records = _mfu_run(world, accumulation, "off", monkeypatch)
    for r in records:
        steps_per_s = 1000 / r["step_ms"]
        per_rank_samples = 8 * accumulation * steps_per_s  # every micro-batch of the step counts
        assert r["samples_per_s"] == pytest.approx(world * per_rank_samples)
        assert r["mfu"] == pytest.approx(per_rank_samples * MODEL_FLOPS / 10e12)  # the world cancels
        assert "hfu" not in r


@pytest.mark.slow
def test_hfu_adds_the_recomputation_and_the_summary_names_both(monkeypatch):
    records = _mfu_run(2, 2, "full", monkeypatch)
    for r in records:
        assert r["hfu"] / r["mfu"] == pytest.approx((MODEL_FLOPS + RECOMPUTE_FULL) / MODEL_FLOPS)
    summary = {
        "run": "r",
        "status": "completed",
        "flops_per_sample": MODEL_FLOPS,
        "flops_source": "torch.utils.flop_counter",
        "flops_convention": COUNTED,
        "recompute_flops_per_sample": RECOMPUTE_FULL,
        **summarize_records(records),
    }
    md = format_markdown(summary)
    assert f"| MFU counts | {COUNTED}; recomputation not counted |" in md
    assert "| HFU (hardware FLOPs: with activation checkpointing's recomputation) |" in md
    assert f"recomputed: {RECOMPUTE_FULL:.4g} more" in md
