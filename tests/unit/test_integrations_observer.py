"""The monitoring behind the integrations' callbacks (turbotrain.integrations.observer) and their
one-line errors: compile accounting reaches the summary, records read only what they are handed,
a missing framework is one line naming the extra, the recipe's user-wins merge."""

from __future__ import annotations

import importlib
import json
import logging
import sys

import pytest
import torch

from turbotrain import Engine
from turbotrain.base.batch import TokenTally, real_tokens, token_count
from turbotrain.integrations.observer import LoopObserver, peak_spec, run_name
from turbotrain.integrations.recipe import build_recipe, merge_user
from turbotrain.loop.monitor.flops import flop_tokens_per_sample


@pytest.mark.slow
def test_compiles_and_recompiles_reach_the_summary(tmp_path):
    obs = LoopObserver(tmp_path, device="cpu", framework="test", nvml=False)
    obs.start(0)
    fn = torch.compile(lambda x: (x * 2).sum(), dynamic=False, backend="eager")  # dynamo only: fast
    for step, n in enumerate((4, 5, 6), 1):  # a new shape each step: dynamo recompiles
        batch = torch.ones(n, 3)
        fn(batch)
        obs.count(batch)
        obs.step_end(step)
        obs.record(step, float(step))
    summary = obs.close(report=False)
    compiled = summary["compile"]
    assert compiled["frames_compiled"] >= 2 and compiled["recompiles"] >= 1
    assert any("size" in r or "shape" in r or "==" in r for r in compiled["recompile_reasons"])
    assert summary["samples"] == 15 and summary["steps"] == 3
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records] == [1.0, 2.0, 3.0]


def test_peak_and_flops_give_mfu(tmp_path):
    with pytest.raises(ValueError, match="peak_tflops"):
        peak_spec(torch.device("cpu"), 0.0)
    assert peak_spec(torch.device("cpu")) is None  # a CPU: no datasheet, no MFU
    obs = LoopObserver(tmp_path, device="cpu", framework="test", peak_tflops=2.0, nvml=False)
    obs.start(0)
    obs.set_flops(1e9, "given")
    for step in (1, 2):
        obs.count(torch.zeros(10, 4))
        obs.step_end(step)
    record = obs.record(2, 0.5)
    assert record["tflops"] == pytest.approx(record["samples_per_s"] * 1e9 / 1e12)
    assert record["mfu"] == pytest.approx(record["tflops"] / 2.0)
    obs.close(report=False)


@pytest.mark.parametrize(
    "module, extra",
    [
        ("turbotrain.integrations.hf", "turbotrain[hf]"),
        ("turbotrain.integrations.lightning", "turbotrain[lightning]"),
        ("turbotrain.integrations.accelerate", "pip install accelerate"),
        ("turbotrain.integrations.ray", "turbotrain[ray]"),
    ],
)
def test_a_missing_framework_is_one_line_naming_the_extra(module, extra, monkeypatch):
    framework = {"hf": "transformers", "lightning": "lightning", "accelerate": "accelerate", "ray": "ray"}[
        module.rsplit(".", 1)[1]
    ]
    monkeypatch.setitem(sys.modules, framework, None)  # import fails as if not installed
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=r"^turbotrain\.integrations\.\w+ needs \w+: pip install ") as err:
        importlib.import_module(module)
    assert extra in str(err.value) and "\n" not in str(err.value)


def test_yours_win_and_groups_step_aside_with_one_line_each(caplog):
    recipe = {"bf16": True, "fp16": False, "optim": "adamw_torch_fused", "tf32": True}
    with caplog.at_level(logging.WARNING, logger="turbotrain.integrations"):
        merged = merge_user(recipe, {"fp16": True, "tf32": True}, [("bf16", "fp16")], where=" (x)")
    assert merged == {"fp16": True, "optim": "adamw_torch_fused", "tf32": True}
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "turbotrain recipe (x): fp16 = False; you set fp16 = True: yours is kept",
        "turbotrain recipe (x): bf16 = True left out because you set fp16 = True: yours is kept",
    ]


def test_the_cpu_recipe_is_the_engines():
    recipe = build_recipe("cpu")
    assert (recipe.precision, recipe.tf32, recipe.compile, recipe.pin_memory) == ("fp32", False, False, False)
    assert recipe.optimizer_kwargs() in ({"fused": True}, {"foreach": True})
    assert recipe.loader_kwargs()["num_workers"] == recipe.num_workers
    assert set(recipe.why) == {"precision", "tf32", "compile", "optimizer", "loader"}


def test_an_explicit_none_is_not_given_for_every_recipe_keyword(caplog):
    """(#46 item 5) ``mixed_precision=None`` (an argparse default passed on) keeps the recipe's
    setting, without a warning line and without setting aside the rest of its group."""
    recipe = {"bf16": True, "fp16": False, "mixed_precision": "bf16", "workers": 2, "prefetch": 4}
    groups = [("bf16", "fp16"), ("workers", "prefetch")]
    with caplog.at_level(logging.WARNING, logger="turbotrain.integrations"):
        merged = merge_user(recipe, dict.fromkeys(recipe), groups)
        assert merged == recipe
        assert merge_user(recipe, {"mixed_precision": None, "workers": 1}, groups) == {
            "bf16": True,
            "fp16": False,
            "mixed_precision": "bf16",
            "workers": 1,
        }
    assert [r.getMessage() for r in caplog.records] == [
        "turbotrain recipe: workers = 2; you set workers = 1: yours is kept",
        "turbotrain recipe: prefetch = 4 left out because you set workers = 1: yours is kept",
    ]


def test_runs_are_named_after_their_directory_not_turbotrain(tmp_path):
    """(#46 item 6) The callbacks' default ``<output_dir>/turbotrain`` is named after the output
    directory; any other run directory after itself; the summary and the trackers say so."""
    assert run_name(tmp_path / "gpt-small" / "turbotrain") == "gpt-small"
    assert run_name(tmp_path / "runs" / "acc") == "acc"
    assert run_name("/turbotrain", "BertModel") == "BertModel"
    obs = LoopObserver(tmp_path / "exp7" / "turbotrain", device="cpu", framework="test", nvml=False)
    obs.start()
    assert obs.close(report=False)["run"] == "exp7"
    named = LoopObserver(tmp_path / "x", device="cpu", framework="test", nvml=False, name="mine")
    named.start()
    assert named.close(report=False)["run"] == "mine"


def test_tokens_are_the_attention_masks_ones_and_flops_the_padded_shapes(tmp_path):
    """(#46 item 7) A padded batch: tokens (the observer's, the engine's through its loader) are
    the mask's ones; FLOPs scale by samples (their count is the padded shape's), not by tokens."""
    padded = {
        "input_ids": torch.zeros(2, 4, dtype=torch.long),
        "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
    }
    plain = {"input_ids": torch.zeros(2, 4, dtype=torch.long)}
    assert (token_count(padded), real_tokens(padded), real_tokens(plain)) == (8, 5, 8)
    tally = TokenTally(100)
    tally.add(padded)
    tally.add(plain)
    assert tally.total() == 113
    assert flop_tokens_per_sample(padded) == 0.0 and flop_tokens_per_sample(plain) == 4.0
    engine = Engine({"run": {"device": "cpu"}})
    assert len(list(engine.setup_loader([padded, padded, plain]))) == 3
    assert (engine.state.samples, engine.state.tokens) == (6, 18)
    obs = LoopObserver(tmp_path, device="cpu", framework="test", nvml=False)
    obs.count(padded)
    obs.count(plain)
    assert (obs.samples, obs.tokens) == (4, 13)
    obs.close(report=False)
