"""Adaptive learning rate: the plateau schedule (warmup, then lowered when the validation loss
stops improving, exactly as torch's ReduceLROnPlateau decides) and the LR scaling rule for a
global batch the batch finder changed."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from turbotrain import load_config
from turbotrain.base.errors import ConfigError
from turbotrain.core.optim import PlateauLR, build_scheduler, lr_batch_factor, rescale_lr


def _optimizer(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=lr)


def _lr(opt: torch.optim.Optimizer) -> float:
    return opt.param_groups[0]["lr"]


def test_plateau_warms_up_then_lowers_exactly_when_reduce_lr_on_plateau_does():
    opt = _optimizer(1.0)
    sched = build_scheduler(
        opt,
        schedule="plateau",
        warmup_steps=4,
        max_steps=100,
        lr=1.0,
        min_lr=0.1,
        plateau_factor=0.5,
        plateau_patience=2,
    )
    assert isinstance(sched, PlateauLR)
    seen = []
    for _ in range(4):  # warmup still applies: (s + 1) / 4 of the peak
        seen.append(_lr(opt))
        assert not sched.observe(10.0)  # evaluations during warmup do not count
        opt.step()
        sched.step()
    assert seen == [0.25, 0.5, 0.75, 1.0] and _lr(opt) == 1.0

    ref_opt = _optimizer(1.0)
    ref = torch.optim.lr_scheduler.ReduceLROnPlateau(ref_opt, factor=0.5, patience=2, min_lr=0.1)
    losses = [3.0, 2.0, 2.0, 1.9999, 2.1, 1.5, 1.6, 1.6, 1.6, 1.6, 1.6, 1.6, 1.6, 1.6, 1.6, 1.6, 1.6, 1.6]
    lowered_at = []
    for i, loss in enumerate(losses):
        for _ in range(3):  # three optimizer steps between evaluations: the scale holds
            opt.step()
            sched.step()
        if sched.observe(loss):
            lowered_at.append(i)
        ref.step(loss)
        assert _lr(opt) == pytest.approx(_lr(ref_opt)), f"evaluation {i}"
    # 2.0 then two evaluations without a 1e-4 relative gain (1.9999 is not one): lowered at the third
    assert lowered_at[:2] == [4, 8]
    assert _lr(opt) == pytest.approx(0.1)  # never below min_lr (0.1 of the peak)


def test_plateau_state_resumes_mid_patience():
    opt = _optimizer(2e-3)
    sched = PlateauLR(opt, warmup_steps=0, factor=0.5, patience=1, min_ratio=0.0)
    for loss in (1.0, 1.0, 1.0, 1.0):  # lowered once, then one bad evaluation pending
        opt.step()
        sched.step()
        sched.observe(loss)
    saved = sched.state_dict()
    assert saved["scale"] == 0.5 and saved["bad_evals"] == 1 and saved["best"] == 1.0

    opt2 = _optimizer(2e-3)
    again = PlateauLR(opt2, warmup_steps=0, factor=0.5, patience=1, min_ratio=0.0)
    again.load_state_dict(saved)
    for o, s in ((opt2, again), (opt, sched)):
        o.step()
        s.step()
    assert _lr(opt2) == pytest.approx(_lr(opt)) == pytest.approx(1e-3)
    assert again.observe(1.0) and sched.observe(1.0)  # the pending bad evaluation was kept: lowered now
    assert again.get_last_lr()[0] == pytest.approx(sched.get_last_lr()[0]) == pytest.approx(5e-4)


def test_lr_scaling_rule_math_and_the_default_changes_nothing():
    assert lr_batch_factor("linear", 32, 128) == 4.0
    assert lr_batch_factor("sqrt", 32, 128) == 2.0
    assert lr_batch_factor("sqrt", 64, 16) == 0.5
    assert lr_batch_factor("none", 32, 128) == 1.0
    assert lr_batch_factor("linear", 32, 32) == 1.0
    assert load_config().optim.lr_scaling == "none"

    opt = _optimizer(2e-3)
    sched = build_scheduler(opt, schedule="cosine", warmup_steps=2, max_steps=10, lr=2e-3, min_lr=2e-4)
    plain_opt = _optimizer(2e-3)
    plain = build_scheduler(plain_opt, schedule="cosine", warmup_steps=2, max_steps=10, lr=2e-3, min_lr=2e-4)
    rescale_lr(opt, sched, 4.0)
    for _ in range(10):  # the whole schedule (warmup, decay, floor) is 4x the unscaled one
        assert _lr(opt) == pytest.approx(4 * _lr(plain_opt))
        opt.step(), sched.step(), plain_opt.step(), plain.step()
    assert _lr(opt) == pytest.approx(4 * 2e-4)


def test_adaptive_lr_mistakes_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="lr_batch"):
        load_config(overrides={"batch": {"micro": "auto"}, "optim": {"lr_scaling": "sqrt"}})
    with pytest.raises(ConfigError, match="plateau_factor"):
        load_config(overrides={"optim": {"schedule": "plateau", "plateau_factor": 1.5}})
    with pytest.raises(ConfigError, match="train.eval_every"):
        load_config(overrides={"optim": {"schedule": "plateau"}, "train": {"eval_every": 0}})
    with pytest.raises(ConfigError, match="linear, sqrt"):
        load_config(overrides={"optim": {"lr_scaling": "cubic"}})
    assert math.isclose(
        load_config(
            overrides={"batch": {"micro": "auto", "global_size": 64}, "optim": {"lr_scaling": "linear"}}
        ).optim.lr,
        2e-3,
    )
