"""fp8 per layer by timing (core/precision/fp8_choice.py): with an injected timer, exactly the
layers whose shape is faster in float8 (by the margin) are converted, each with its fastest recipe;
the table is written; nothing faster means bf16 and one line; a second decision comes from the cache."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from turbotrain.core.precision.fp8 import FP8, convert_linears
from turbotrain.core.precision.fp8_choice import (
    choose_fp8_layers,
    decide,
    linear_timer,
    time_fp8_layers,
)

TOKENS = 256  # M: tokens per micro-batch


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 192)  # 64 x 192: fp8 wins (rowwise)
        self.proj = nn.Linear(64, 64)  # small: bf16 wins
        self.up = nn.Linear(64, 256)  # fp8 wins (tensorwise)
        self.down = nn.Linear(256, 64)  # fp8 only 3 % faster: within the margin, bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(self.qkv(x)[..., :64])
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.classifier = nn.Linear(64, 10)  # 10 outputs: not divisible by 16, never a candidate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.blocks(x))


MS = {  # (K, N) -> ms per recipe, as a device would measure them
    (64, 192): {"bf16": 1.0, "tensorwise": 0.8, "rowwise": 0.7},
    (64, 64): {"bf16": 0.2, "tensorwise": 0.3, "rowwise": 0.35},
    (64, 256): {"bf16": 1.0, "tensorwise": 0.6, "rowwise": 0.9},
    (256, 64): {"bf16": 1.0, "tensorwise": 0.97, "rowwise": 1.1},
}


class Timer:
    def __init__(self, table: dict) -> None:
        self.table, self.calls = table, []

    def __call__(self, shape, recipe):
        self.calls.append((shape, recipe))
        m, k, n = shape
        assert m == TOKENS
        return self.table[(k, n)][recipe]


def test_exactly_the_faster_layers_are_converted_and_the_table_is_written(tmp_path):
    timer = Timer(MS)
    choice = choose_fp8_layers(Net(), TOKENS, FP8(), timer)
    assert choice.converted == {
        "blocks.0.qkv": "rowwise",
        "blocks.1.qkv": "rowwise",
        "blocks.0.up": "tensorwise",
        "blocks.1.up": "tensorwise",
    }
    assert len(timer.calls) == 4 * 3  # each distinct shape once per recipe, not once per layer
    assert choice.kept == {"classifier": "dims not divisible by 16"}
    choice.write(tmp_path)
    table = (tmp_path / "fp8_layers.md").read_text()
    assert "| blocks.0.down | 256 x 256 x 64 | 1.000 | 0.970 | 1.100 | **bf16** |" in table
    assert "4 of 8 timed linear layers in float8" in table
    saved = json.loads((tmp_path / "fp8_layers.json").read_text())
    assert {c["layer"]: c["choice"] for c in saved["layers"]}["blocks.1.proj"] == "bf16"


def test_no_layer_faster_means_bf16_and_one_line():
    slower = {shape: {"bf16": 1.0, "tensorwise": 1.2, "rowwise": 1.5} for shape in MS}
    choice = choose_fp8_layers(Net(), TOKENS, FP8(), Timer(slower))
    assert choice.converted == {}
    assert "\n" not in choice.line and "trains in bf16" in choice.line


def test_the_margin_keeps_a_near_tie_in_bf16():
    assert decide({"bf16": 1.0, "tensorwise": 0.97}) == "bf16"
    assert decide({"bf16": 1.0, "tensorwise": 0.94}) == "tensorwise"
    assert decide({"bf16": 1.0, "tensorwise": 0.9, "rowwise": 0.8}) == "rowwise"
    # the 5 % on both sides: 4.5 % faster stays bf16, 5.5 % faster converts
    assert decide({"bf16": 1.0, "tensorwise": 0.955}) == "bf16"
    assert decide({"bf16": 1.0, "rowwise": 0.945}) == "rowwise"


def test_a_second_decision_comes_from_the_cache(tmp_path):
    first = choose_fp8_layers(Net(), TOKENS, FP8(), Timer(MS), cache_dir=tmp_path)
    again = Timer(MS)
    second = choose_fp8_layers(Net(), TOKENS, FP8(), again, cache_dir=tmp_path)
    assert not again.calls and second.cached and not first.cached
    assert second.converted == first.converted
    other = Timer(MS)  # another micro-batch: other shapes, timed again
    choose_fp8_layers(Net(), 2 * TOKENS, FP8(), lambda s, r: other((TOKENS, *s[1:]), r), cache_dir=tmp_path)
    assert other.calls


def test_skip_prefixes_and_the_output_layer_rule_are_fp8s_own():
    choice = choose_fp8_layers(Net(), TOKENS, FP8(skip=("blocks.1.",)), Timer(MS))
    assert set(choice.converted) == {"blocks.0.qkv", "blocks.0.up"}
    assert choice.kept["blocks.1.up"] == "precision.fp8_skip"


def test_the_choice_converts_those_layers_with_their_recipes_in_emulation():
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    net = Net()
    choice = choose_fp8_layers(net, TOKENS, FP8(), Timer(MS))
    converted = convert_linears(net, choice.converted, emulate=True)
    assert sorted(converted) == sorted(choice.converted)
    assert isinstance(net.blocks[0].qkv, Float8Linear) and type(net.blocks[0].proj) is nn.Linear
    assert net.blocks[0].qkv.config.cast_config_input.scaling_granularity.name == "AXISWISE"  # rowwise
    assert net.blocks[0].up.config.cast_config_input.scaling_granularity.name == "TENSORWISE"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        net(torch.randn(4, 64)).float().sum().backward()
    assert torch.isfinite(net.blocks[0].qkv.weight.grad).all()


def test_each_layers_m_comes_from_a_forward_and_the_default_timer_runs():
    """M per layer from one forward (3 x 5 rows of 64 features: 15); the device timer on CPU
    (bf16 and emulated float8: runs, its speed means nothing here)."""
    pytest.importorskip("torchao")
    net = Net()
    x = torch.randn(3, 5, 64)
    slower = Timer({shape: {"bf16": 1.0, "tensorwise": 2.0, "rowwise": 2.0} for shape in MS})
    choice = time_fp8_layers(
        net, lambda: net(x), torch.device("cpu"), FP8(), timer=lambda s, r: slower((TOKENS, *s[1:]), r)
    )
    assert {c.shape[0] for c in choice.layers} == {15} and not choice.converted
    timer = linear_timer(torch.device("cpu"), emulate=True, repeats=1, warmup=1)
    assert timer((16, 32, 32), "bf16") > 0 and timer((16, 32, 32), "tensorwise") > 0


def test_a_timed_fp8_run_converts_exactly_the_faster_layers_and_writes_the_table(
    tmp_path, text_file, monkeypatch
):
    """precision.fp8_layers = 'timed' in turbotrain's own run (gpt-tiny cut down, emulated on CPU,
    an injected timer: float8 pays only for the MLP's up-projection, K=32 x N=128): those layers
    alone run in float8, the table is in the run directory, the summary says so in one line."""
    pytest.importorskip("torchao")
    import warnings

    from conftest import tiny_overrides

    from turbotrain.app.report import format_markdown
    from turbotrain.app.training import train
    from turbotrain.base.config import load_config
    from turbotrain.core.precision import fp8_choice

    def timer(shape, recipe):
        m, k, n = shape
        assert m == 4 * 32  # micro 4 x block 32 rows, from one forward
        faster = (k, n) == (32, 128)
        return {"bf16": 1.0, "tensorwise": 0.5 if faster else 1.5, "rowwise": 0.6 if faster else 1.6}[recipe]

    monkeypatch.setattr(fp8_choice, "linear_timer", lambda *a, **k: timer)
    monkeypatch.setattr(fp8_choice, "default_cache_dir", lambda: tmp_path / "fp8-cache")
    overrides = tiny_overrides(
        tmp_path,
        precision={"mode": "fp8", "fp8_emulate": True, "fp8_layers": "timed"},
        data={"path": str(text_file)},
        train={"max_steps": 2, "eval_every": 0, "checkpoint_every": 0},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summary = train(load_config(overrides=overrides), progress=False)
    assert sorted(summary["optimizations"]["fp8_converted"]) == ["blocks.0.mlp.0", "blocks.1.mlp.0"]
    run_dir = tmp_path / "runs" / "t"
    table = (run_dir / "fp8_layers.md").read_text()
    assert "| blocks.0.mlp.0 | 128 x 32 x 128 | 1.000 | 0.500 | 0.600 | **tensorwise** |" in table
    assert "| blocks.0.attn.qkv | 128 x 32 x 96 | 1.000 | 1.500 | 1.600 | **bf16** |" in table
    assert "2 of 8 timed linear layers in float8" in json.dumps(summary)
    markdown = format_markdown(summary)
    assert "## fp8 per layer (timed)" in markdown and "| blocks.1.mlp.0 | 128 x 32 x 128 |" in markdown


def test_a_timed_run_converts_each_layer_in_its_fastest_recipe(tmp_path):
    """The run's fp8 plugin converts each chosen layer with the recipe that timed fastest for its
    shape (qkv: rowwise, up: tensorwise), not one recipe for all (precision.fp8_layer_recipes)."""
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from turbotrain.base.config import load_config
    from turbotrain.core.precision import fp8_choice

    config = load_config(
        overrides={"run": {"device": "cpu"}, "precision": {"mode": "fp8", "fp8_emulate": True}}
    )
    torch.manual_seed(0)
    net = Net()
    x = torch.randn(TOKENS, 64)
    config, choice = fp8_choice.choose_for_run(
        config,
        net,
        x,
        lambda m, b: m(b).sum(),
        tmp_path,
        torch.device("cpu"),
        timer=Timer(MS),
        cache_dir=tmp_path / "cache",
    )
    assert config.precision.fp8_layer_recipes == "blocks.0.qkv=rowwise,blocks.1.qkv=rowwise"
    fp8 = FP8.from_settings(torch.device("cpu"), config.precision)
    fp8.convert_module(net)
    granularity = {
        name: m.config.cast_config_input.scaling_granularity.name
        for name, m in net.named_modules()
        if isinstance(m, Float8Linear)
    }
    assert granularity == {
        "blocks.0.qkv": "AXISWISE",
        "blocks.0.up": "TENSORWISE",
        "blocks.1.qkv": "AXISWISE",
        "blocks.1.up": "TENSORWISE",
    }
    assert "rowwise and tensorwise recipes" in fp8.summary()["fp8"]


def test_a_malformed_layer_recipe_is_one_line():
    from turbotrain.base.config import load_config
    from turbotrain.base.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(
            overrides={
                "precision": {"mode": "fp8", "fp8_emulate": True, "fp8_layer_recipes": "blocks.0=colwise"}
            }
        )
    assert "precision.fp8_layer_recipes" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: [],
        lambda data: None,
        lambda data: {**data, "value": {**data["value"], "layers": [{"layer": "blocks.0.qkv"}]}},
        lambda data: {**data, "value": {**data["value"], "layers": ["blocks.0.qkv"]}},
    ],
    ids=["list", "null", "layer-missing-its-figures", "layers-as-strings"],
)
def test_a_cache_file_of_another_shape_is_one_line_and_timed_again(tmp_path, caplog, damage):
    """Issue 44 item 5: valid JSON of another shape is no traceback: one line naming the file."""
    first = choose_fp8_layers(Net(), TOKENS, FP8(), Timer(MS), cache_dir=tmp_path)
    (path,) = tmp_path.glob("*.json")
    path.write_text(json.dumps(damage(json.loads(path.read_text()))))
    again = Timer(MS)
    with caplog.at_level("WARNING"):
        second = choose_fp8_layers(Net(), TOKENS, FP8(), again, cache_dir=tmp_path)
    assert again.calls and not second.cached and second.converted == first.converted
    lines = [r.getMessage() for r in caplog.records if "ignoring the cached" in r.getMessage()]
    assert len(lines) == 1 and str(path) in lines[0] and "\n" not in lines[0]


def test_a_layer_recipe_prefix_that_matches_no_layer_is_one_line():
    """#44 item 11: a prefix that matches no layer would do nothing: refused in one line."""
    pytest.importorskip("torchao")
    from turbotrain.base.config import load_config
    from turbotrain.base.errors import ConfigError

    precision = {"mode": "fp8", "fp8_emulate": True, "fp8_layer_recipes": "block.0.qkv=rowwise"}
    config = load_config(overrides={"run": {"device": "cpu"}, "precision": precision})
    fp8 = FP8.from_settings(torch.device("cpu"), config.precision)
    with pytest.raises(ConfigError) as err:
        fp8.convert_module(Net())
    assert str(err.value).startswith(
        "precision.fp8_layer_recipes: the prefix 'block.0.qkv' matches no linear layer of this model (they are blocks.0.qkv"
    )
    assert "\n" not in str(err.value)
