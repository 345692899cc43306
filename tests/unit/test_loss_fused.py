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
