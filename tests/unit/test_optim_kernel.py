"""The AdamW kernel 'auto' picks: fused wherever the installed torch has it, and the same training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from turbotrain.core.optim import build_optimizer, has_fused_adamw, resolve_implementation

CPU = torch.device("cpu")


def test_auto_picks_the_fused_kernel_on_cpu_when_torch_has_it():
    assert has_fused_adamw("cpu")  # torch >= 2.4 ships a CPU fused AdamW
    assert resolve_implementation("auto", CPU) == "fused"
    assert resolve_implementation("foreach", CPU) == "foreach"  # an explicit choice stays


def _train(implementation: str, steps: int = 60) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 5))
    opt = build_optimizer(model, CPU, lr=3e-3, implementation=implementation)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 32, generator=g)
    y = torch.randint(0, 5, (16,), generator=g)  # one batch, fitted: the loss must fall
    losses = []
    for _i in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_fused_trains_like_foreach():
    """The default changes the kernel, not the math: every step's loss agrees to rounding."""
    fused, foreach = _train("auto"), _train("foreach")
    assert fused[-1] < fused[0] - 0.2  # it trained
    assert max(abs(a - b) for a, b in zip(fused, foreach)) < 1e-5
