"""model.loss = 'fused' (torch's linear_cross_entropy): the full loss's value and gradients on
gpt-tiny, a lower peak for the loss step, and one line on a torch without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from turbotrain.base.errors import ConfigError
from turbotrain.parts.models import loss as loss_module
from turbotrain.parts.models.gpt import model as gpt_model
from turbotrain.parts.models.gpt.model import GPT, PRESETS, GPTConfig
from turbotrain.tools.memory.stats import TensorMemoryTracker

needs_fused = pytest.mark.skipif(not loss_module.FUSED_AVAILABLE, reason=loss_module.FUSED_MISSING)
TINY = dict(PRESETS["gpt-tiny"], vocab_size=256)  # gpt-tiny on bytes


@pytest.mark.slow
@needs_fused
def test_the_loss_and_every_gradient_equal_the_full_loss_on_gpt_tiny():
    """(chunked against full: tests/unit/test_gpt.py)"""
    torch.manual_seed(0)
    full = GPT(GPTConfig(**TINY))
    fused = GPT(GPTConfig(**TINY, loss="fused"))
    fused.load_state_dict(full.state_dict())
    x, y = torch.randint(256, (2, 64)), torch.randint(256, (2, 64))
    y[0, :10] = -100  # padding (data.batching = 'tokens'): skipped by both
    a, b = full(x, y), fused(x, y)
    torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    a.backward()
    b.backward()
    for (name, p), q in zip(full.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-5, msg=name)
    with torch.no_grad():  # evaluation: the loss alone
        torch.testing.assert_close(fused(x, y), full(x, y), rtol=0, atol=1e-5)


@needs_fused
def test_under_bf16_autocast_it_stays_within_rounding_of_the_full_loss():
    torch.manual_seed(0)
    full = GPT(GPTConfig(**TINY))
    fused = GPT(GPTConfig(**TINY, loss="fused"))
    fused.load_state_dict(full.state_dict())
    x, y = torch.randint(256, (2, 64)), torch.randint(256, (2, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = full(x, y), fused(x, y)
    assert b.dtype == torch.float32
    torch.testing.assert_close(b, a, rtol=2e-2, atol=0)


@needs_fused
def test_under_bf16_autocast_the_mean_over_tokens_is_taken_in_fp32():
    """Each token's loss comes out in bf16; their mean is an fp32 sum over an fp32 count: a bf16
    sum of 4,096 losses of ~7 nats (spacing 128 near 28,000) would be off by up to 0.2 %."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(4096, 32, generator=g), torch.randn(1000, 32, generator=g)
    targets = torch.randint(1000, (4096,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_module.fused_cross_entropy(hidden, weight, targets)
    fp32_sum = torch.nn.LinearCrossEntropyOptions(acc_dtype=torch.float32)
    per_token = F.linear_cross_entropy(
        hidden.bfloat16(), weight.bfloat16(), targets, reduction="none", options=fp32_sum
    )
    assert loss.dtype == torch.float32 and per_token.dtype == torch.bfloat16
    torch.testing.assert_close(loss, per_token.float().mean(), rtol=1e-5, atol=0)
    assert abs(float(per_token.sum()) / 4096 - float(loss)) > 1e-3  # what a bf16 sum would give


@needs_fused
def test_the_loss_step_peaks_lower_than_the_full_logits():
    """gpt-tiny's output layer at 16 x 128 tokens: hidden (2048 x 128) -> loss -> backward; the
    live tensor bytes counted by the dispatch-level tracker, over the inputs."""
    torch.manual_seed(0)
    h = torch.randn(16 * 128, 128, requires_grad=True)
    w = torch.randn(256, 128, requires_grad=True)
    t = torch.randint(256, (16 * 128,))
    peaks = {}
    for name, fn in {
        "full": lambda: F.cross_entropy((h @ w.t()).float(), t),
        "fused": lambda: loss_module.fused_cross_entropy(h, w, t),
    }.items():
        h.grad = w.grad = None
        with TensorMemoryTracker() as tracker:
            tracker.add([h, w, t])
            base = tracker.current
            fn().backward()
        peaks[name] = tracker.peak - base
    logits = 16 * 128 * 256 * 4
    assert peaks["full"] >= 2 * logits  # the logits and their gradient at least
    assert peaks["fused"] < peaks["full"] / 2


def test_a_torch_without_it_gets_one_line_naming_what_to_use(monkeypatch):
    monkeypatch.setattr(gpt_model, "FUSED_AVAILABLE", False)
    with pytest.raises(ConfigError) as err:
        GPT(GPTConfig(**TINY, loss="fused"))
    message = str(err.value)
    assert "\n" not in message and "linear_cross_entropy" in message and "--model.loss=chunked" in message
