"""The Python API's argument checks (#44 item 8): a wrong argument to ``get_optimal_batch_size``,
``TrainedRun.evaluate`` or ``turbotrain.train`` is one TurbotrainError naming the argument, as the
other bad calls already give; a loss that is not a scalar or a batch the model cannot take is the
one line a training step gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import turbotrain
from turbotrain.app.run import overrides_of
from turbotrain.base.errors import TurbotrainError
from turbotrain.cli import main
from turbotrain.tools.memory import get_optimal_batch_size

CPU = {"run": {"device": "cpu"}}
X, Y = torch.randn(4, 4), torch.randn(4, 2)


def _loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(m(b[0]), b[1])


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: get_optimal_batch_size(None, (X, Y), loss_fn=_loss, config=CPU),
            r"model = None .*torch.nn.Module",
        ),
        (
            lambda: get_optimal_batch_size("m", (X, Y), loss_fn=_loss, config=CPU),
            r"model = 'm' .*torch.nn.Module",
        ),
        (
            lambda: get_optimal_batch_size(nn.Linear(4, 2), (X[:0], Y[:0]), loss_fn=_loss, config=CPU),
            r"example .*0 rows",
        ),
        (
            lambda: get_optimal_batch_size(nn.Linear(4, 2), (X, Y), loss_fn=_loss, config=7),
            r"config = 7 .*dict",
        ),
        (
            lambda: get_optimal_batch_size(nn.Linear(4, 2), (X, Y), loss_fn=_loss, config=CPU, max_micro="x"),
            r"max_micro = 'x' .*whole number",
        ),
        (
            lambda: get_optimal_batch_size(
                nn.Linear(4, 2),
                DataLoader(TensorDataset(X[:0], Y[:0]), batch_size=2),
                loss_fn=_loss,
                config=CPU,
            ),
            r"example: the loader yielded no batch \(it is empty\)",
        ),
        (
            lambda: get_optimal_batch_size(
                nn.Linear(4, 2), (X, Y), loss_fn=lambda m, b: (m(b[0]) - b[1]) ** 2, config=CPU, max_micro=8
            ),
            r"the loss must be a scalar tensor .*got a tensor of shape \(1, 2\)",
        ),
        (
            lambda: get_optimal_batch_size(
                nn.Linear(4, 2), (torch.randn(4, 5), Y), loss_fn=_loss, config=CPU
            ),
            r"get_optimal_batch_size: a training step of the search failed: RuntimeError: mat1 and mat2",
        ),
    ],
)
def test_get_optimal_batch_size_refuses_a_wrong_argument_in_one_line(call, match):
    with pytest.raises(TurbotrainError, match=match) as caught:
        call()
    assert "\n" not in str(caught.value)


def test_two_values_for_one_field_are_refused():
    """``train(make, optim={"lr": 1e-3}, lr=2e-3)`` trained at 2e-3 without a word."""
    with pytest.raises(TurbotrainError, match=r"train\(\): optim.lr is given twice .*give it once"):
        overrides_of({"optim": {"lr": 1e-3}, "lr": 2e-3})
    with pytest.raises(TurbotrainError, match=r"optim.lr is given twice"):
        overrides_of({"lr": 2e-3, "optim": {"lr": 1e-3}})
    assert overrides_of({"optim": {"lr": 1e-3}, "max_steps": 4}) == {
        "optim": {"lr": 1e-3},
        "train": {"max_steps": 4},
    }


def test_run_evaluate_refuses_what_is_not_batches(tmp_path: Path, text_file: Path):
    run = turbotrain.train(**tiny_overrides(tmp_path, data={"path": str(text_file)}, train={"max_steps": 2}))
    with pytest.raises(TurbotrainError, match=r"evaluate\(\): loader = 5 is not an iterable of batches"):
        run.evaluate(5)  # type: ignore[arg-type]
    t = run.training
    assert set(run.evaluate(t.data.val_batches(t.config, 0, 1))) >= {"loss"}  # what it takes


def test_train_errors_speak_python_to_a_python_caller_and_flags_on_the_command_line(tmp_path, capsys):
    """#44 item 12: turbotrain.train()'s resume mistakes name its own arguments, not CLI flags;
    the command line's words are unchanged."""
    out = str(tmp_path / "none")
    with pytest.raises(TurbotrainError) as nothing:
        turbotrain.train(run={"out_dir": out}, resume=True)
    assert "start one with turbotrain.train()" in str(nothing.value) and "`turbotrain train`" not in str(
        nothing.value
    )
    with pytest.raises(TurbotrainError) as both:
        turbotrain.train("examples/workload_cnn.py:make", run={"out_dir": out}, resume=True)
    assert "a workload names the workload of a new run" in str(both.value) and "--model" not in str(
        both.value
    )
    assert main(["train", "--resume", "--run.out_dir", out]) == 2
    assert "start one with `turbotrain train`" in capsys.readouterr().err
