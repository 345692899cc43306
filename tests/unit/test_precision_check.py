"""``turbotrain doctor --model FILE.py:FUNC``: one forward/backward per precision through the
Engine, NaN/inf and the loss against fp32, and whether the precision auto picks is sound."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from turbotrain.app.precision_check import check_precisions, format_check, load_target
from turbotrain.cli import main
from turbotrain.core.precision import DeviceCaps, resolve_precision
from turbotrain.core.precision.fp8 import FP8Settings

OVERFLOW = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from turbotrain import Workload

class Overflow(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x, y):
        h = self.a(x * 1e5)  # activations far past fp16's largest value (65504) going into a matmul
        return nn.functional.cross_entropy(self.b(torch.relu(h) * 1e-5), y)

def make():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    return Workload(model=Overflow(), train_loader=DataLoader(data, batch_size=16))

class Big(nn.Module):  # fine in fp16, but d loss / d output = 10 overflows the backward at loss scale 65536
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 8)

    def forward(self, x):
        return self.a(x).float().sum() * 10

def big():
    return Workload(model=Big(), train_loader=[(torch.randn(4, 16, generator=torch.Generator().manual_seed(0)),)])
"""


def _write(tmp_path):
    path = tmp_path / "overflow.py"
    path.write_text(textwrap.dedent(OVERFLOW))
    return path


def test_doctor_names_the_precision_that_overflows(tmp_path, capsys):
    path = _write(tmp_path)
    assert main(["doctor", "--json", "--model", f"{path}:make"]) == 0  # auto's precision is sound here
    report = json.loads(capsys.readouterr().out)["precision_check"]
    rows = {r["precision"]: r for r in report["results"]}
    assert rows["fp16-mixed"]["status"] == "nonfinite" and rows["fp16-mixed"]["finite_loss"] is False
    assert rows["fp32"]["status"] == "reference" and rows["fp32"]["finite_grads"]
    bf16 = rows["bf16-mixed"]
    assert bf16["status"] == "ok" and bf16["loss_rel_diff"] < 0.01 and bf16["grad_norm_rel_diff"] < 0.05
    device = torch.device(report["device"])
    verdict = report["verdict"]
    assert verdict["auto"] == resolve_precision("auto", DeviceCaps.of(device)) and verdict["sound"]
    if device.type == "cpu":  # what a GPU run would get: fp16 below compute capability 8.0 is not sound
        old = next(g for g in verdict["on_gpu"] if g["auto"] == "fp16-mixed")
        assert not old["sound"] and old["use_instead"] == "fp32"

    # the text
    fp16_line = next(line for line in format_check(report).splitlines() if line.startswith("| fp16-mixed"))
    assert "NON-FINITE: loss nan" in fp16_line


def test_scaled_gradients_that_overflow_are_the_gradscalers_business_not_the_models(tmp_path):
    """fp16 as training runs it: the scale is lowered until the gradients are finite."""
    report = check_precisions(
        load_target(f"{_write(tmp_path)}:big", None), "cpu", modes=("fp32", "fp16-mixed")
    )
    fp16 = report["results"][1]
    assert fp16["status"] == "ok" and fp16["loss_scale"] < 65536 and fp16["grad_norm_rel_diff"] < 0.01


def test_fp8_lists_the_layers_it_would_convert_and_says_in_one_line_where_it_cannot_run(tmp_path):
    """fp8 (asked for by name only): its filter read from the model, without torchao. On this CPU
    it does not run (one line, training's own refusal); `a` (16 -> 32) is under torchao's H100 size
    thresholds and `b` (32 -> 4) has a dimension not divisible by 16."""
    workload = load_target(f"{_write(tmp_path)}:make", None)
    report = check_precisions(workload, "cpu", modes=("fp32",))
    plan = report["fp8"]
    assert plan["converted"] == [] and plan["with_min_size_1"] == 1
    assert plan["kept"] == [
        "a: below the size threshold (precision.fp8_min_size)",
        "b: dims not divisible by 16",
    ]
    assert not plan["runs_here"] and len(plan["note"].splitlines()) == 1 and ">= 8.9" in plan["note"]
    assert "fp8" not in {r["precision"] for r in report["results"]}
    text = format_check(report).split("fp8 (asked for by name")[1].splitlines()
    assert [line for line in text if "no fp8:" in line] == [f"- this device: no fp8: {plan['note']}"]
    assert any("none of its 2 linear layers" in line and "fp8_min_size=1 converts 1" in line for line in text)


def test_fp8_is_a_row_where_it_runs_here_emulated_on_this_cpu(tmp_path):
    pytest.importorskip("torchao")
    workload = load_target(f"{_write(tmp_path)}:make", None)
    report = check_precisions(
        workload, "cpu", modes=("fp32",), fp8=FP8Settings(fp8_emulate=True, fp8_min_size=1)
    )
    assert report["fp8"]["runs_here"] and report["fp8"]["converted"] == ["a"]
    fp8 = {r["precision"]: r for r in report["results"]}["fp8"]
    assert fp8["status"] == "ok" and 0 < fp8["loss_rel_diff"] < 0.01  # float8 rounding: near fp32, not equal
