"""The learning rate a run uses at each optimizer step equals the closed-form schedule: linear
warmup to ``optim.lr``, then cosine or linear decay to ``optim.min_lr`` at ``max_steps``, or flat.
Read from the optimizer after each step, as a user's loop (and metrics.jsonl's ``lr``) sees it."""

from __future__ import annotations

import math

import pytest
import torch

from turbotrain import load_config
from turbotrain.app.resume import kept_schedule
from turbotrain.base.config import OptimConfig
from turbotrain.core.optim import build_scheduler, scheduler_from_config

PEAK, FLOOR, WARMUP, STEPS = 1e-3, 1e-4, 4, 20


def reference(schedule: str, s: int) -> float:
    """The LR for optimizer step ``s`` (0-based, the LR its update used), written out by hand."""
    if s < WARMUP:
        return PEAK * (s + 1) / WARMUP
    if schedule == "constant":
        return PEAK
    progress = min(1.0, (s - WARMUP) / (STEPS - WARMUP))
    shape = (1 + math.cos(math.pi * progress)) / 2 if schedule == "cosine" else 1 - progress
    return FLOOR + (PEAK - FLOOR) * shape


def used_lrs(schedule: str) -> list[float]:
    """The LR of each of STEPS + 2 optimizer steps (past the end: it stays at the floor)."""
    w = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([w], lr=PEAK)
    scheduler = build_scheduler(
        optimizer, schedule=schedule, warmup_steps=WARMUP, max_steps=STEPS, lr=PEAK, min_lr=FLOOR
    )
    lrs = []
    for _ in range(STEPS + 2):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_the_lr_at_every_step_is_the_closed_form_schedule(schedule: str) -> None:
    lrs = used_lrs(schedule)
    expected = [reference(schedule, s) for s in range(STEPS + 2)]
    # the same formula; only the float order of operations may differ
    assert lrs == pytest.approx(expected, rel=1e-12, abs=0)
    assert lrs[WARMUP - 1] == pytest.approx(PEAK, rel=1e-12)  # the warmup ends at the peak


def test_cosine_and_linear_differ_where_their_shapes_do() -> None:
    # halfway through the decay both are at the midpoint; a quarter in, cosine is above linear
    cosine, linear = used_lrs("cosine"), used_lrs("linear")
    quarter, half = WARMUP + (STEPS - WARMUP) // 4, WARMUP + (STEPS - WARMUP) // 2
    assert (
        cosine[half] == pytest.approx(linear[half], rel=1e-12) == pytest.approx((PEAK + FLOOR) / 2, rel=1e-12)
    )
    assert cosine[quarter] == pytest.approx(
        FLOOR + (PEAK - FLOOR) * (1 + math.cos(math.pi / 4)) / 2, rel=1e-12
    )
    assert cosine[quarter] > linear[quarter] + 1e-5
    assert cosine[STEPS] == linear[STEPS] == pytest.approx(FLOOR, rel=1e-12)


@pytest.mark.parametrize(("steps", "warmup"), [(16, 1), (20, 2), (300, 30), (3000, 30)])
def test_the_default_warmup_is_a_tenth_of_a_short_run_so_it_reaches_the_peak_and_decays(
    steps: int, warmup: int
) -> None:
    """#47 item 4a: the default warm-up (30 steps) left the README's 16-step epochs example at 57 %
    of its learning rate, never decaying; 'auto' is 10 % of the run, at most 30 (the default
    300-step run keeps its 30)."""
    optim = OptimConfig()
    assert optim.warmup_steps == "auto"
    w = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([w], lr=optim.lr)
    scheduler = scheduler_from_config(optimizer, optim, steps)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs.index(max(lrs)) == warmup - 1 and max(lrs) == pytest.approx(optim.lr)  # the full LR
    assert lrs[-1] < 0.02 * optim.lr + optim.min_lr  # decayed to about the floor at the run's end
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1 :]))


def test_a_plateau_schedule_resumed_with_another_lr_or_length_says_it_keeps_its_learning_rate(caplog):
    """A resume re-plans only the built-in step schedules; a plateau schedule keeps the checkpoint's
    learning rate, and a new optim.lr / train.max_steps given on the resume is said, not dropped."""
    c = load_config(overrides={"optim": {"schedule": "plateau", "lr": 0.001}, "train": {"max_steps": 40}})
    with caplog.at_level("WARNING"):
        kept_schedule({"optim": {"lr": 0.002}, "train": {"max_steps": 20}}, c)
    (line,) = [r.getMessage() for r in caplog.records]
    assert '"lr": 0.001' in line and '"max_steps": 40' in line and "plateau keeps" in line
    caplog.clear()
    kept_schedule({"optim": {"lr": 0.001}, "train": {"max_steps": 40}}, c)
    assert not caplog.records  # nothing changed: nothing said
