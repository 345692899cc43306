"""Opt-in tuning of the objects a user gives ``engine.setup``: ``optim.tune_user_optimizer``
(Adam/AdamW to the fused kernel, in place) and ``data.tune_user_loader`` (the DataLoader rebuilt
with the data section's workers, pinning and persistent workers). Off by default."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from turbotrain import Engine

G = torch.Generator().manual_seed(1)
X, Y = torch.randn(32, 16, generator=G), torch.randint(0, 4, (32,), generator=G)


def _train(
    tune: bool, opt_class: type = torch.optim.Adam, steps: int = 12
) -> tuple[list[float], torch.optim.Optimizer, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    opt = opt_class(model.parameters(), lr=1e-2, betas=(0.8, 0.99), weight_decay=0.01)
    # built before setup, stepped by the loop
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    nn.functional.cross_entropy(model(X), Y).backward()  # one step before setup: the state must carry over
    opt.step()
    opt.zero_grad()
    # fused: clipping folded into the kernel
    engine = Engine({"optim": {"tune_user_optimizer": tune, "grad_clip": 0.5}})
    model, out, _ = engine.setup(model, opt)
    assert out is opt
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(X), Y)
        engine.backward(loss)
        engine.step(out)
        sched.step()
        losses.append(loss.item())
    return losses, out, out.param_groups[0]["lr"]


@pytest.mark.slow
def test_the_fused_optimizer_trains_to_the_same_losses_and_keeps_the_schedule():
    for opt_class in (torch.optim.Adam, torch.optim.AdamW):
        plain, plain_opt, plain_lr = _train(False, opt_class)
        tuned, tuned_opt, tuned_lr = _train(True, opt_class)
        assert plain_opt.param_groups[0]["fused"] is None  # off: the user's optimizer is untouched
        assert all(g["fused"] is True and not g["foreach"] for g in tuned_opt.param_groups)
        assert (
            tuned_opt.param_groups[0]["betas"] == (0.8, 0.99)
            and tuned_opt.param_groups[0]["weight_decay"] == 0.01
        )
        assert tuned[-1] < tuned[0] - 0.3  # it trained
        assert max(abs(a - b) for a, b in zip(plain, tuned)) < 1e-5, (plain, tuned)
        # the scheduler built before setup still drives the lr
        assert tuned_lr == plain_lr == 1e-2 / (1 + 0.1 * 12)


def test_other_optimizers_are_left_alone():
    model = nn.Linear(4, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    _, out, _ = Engine({"optim": {"tune_user_optimizer": True}}).setup(model, sgd)
    assert out is sgd and not sgd.param_groups[0].get("fused")


def _batches(loader) -> list[torch.Tensor]:
    torch.manual_seed(5)  # the shuffling draws from the global RNG in both
    return [x for x, _ in loader]


def test_the_rebuilt_loader_yields_the_same_batches():
    loader = DataLoader(TensorDataset(X, Y), batch_size=8, shuffle=True)
    expected = _batches(loader)
    engine = Engine({"data": {"tune_user_loader": True, "num_workers": 1, "prefetch_factor": 3}})
    _, _, tuned = engine.setup(nn.Linear(16, 4), None, loader)
    assert tuned.loader is not loader
    assert (tuned.loader.num_workers, tuned.loader.persistent_workers, tuned.loader.prefetch_factor) == (
        1,
        True,
        3,
    )
    assert not tuned.loader.pin_memory  # pinning is for CUDA copies only
    got = _batches(tuned)
    assert len(got) == len(expected) == 4
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_off_by_default_the_loader_is_the_users_and_a_list_stays_a_list():
    loader = DataLoader(TensorDataset(X, Y), batch_size=8)
    _, _, wrapped = Engine().setup(nn.Linear(16, 4), None, loader)
    assert wrapped.loader is loader
    batches = [(X[:8], Y[:8])]
    _, _, wrapped = Engine({"data": {"tune_user_loader": True}}).setup(nn.Linear(16, 4), None, batches)
    assert wrapped.loader is batches
