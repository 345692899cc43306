from pathlib import Path

import pytest
import torch

from turbotrain import Engine
from turbotrain.config import RunConfig, audience, describe, load_config, parse_overrides, preset_names, to_toml
from turbotrain.errors import ConfigError


def test_presets_ship_with_the_package():
    assert {"gpt-tiny", "gpt2-small", "gpt2-medium"} <= set(preset_names())
    small = load_config("gpt2-small")
    assert (small.model.n_layer, small.model.n_head, small.model.d_model, small.model.block_size) == (12, 12, 768, 1024)


def test_overrides_are_typed_and_win_over_the_preset():
    c = load_config("gpt-tiny", ["--optim.lr=1e-3", "--train.max_steps", "7", "--precision.tf32=false", "--batch.micro=auto"])
    assert c.optim.lr == 1e-3 and c.train.max_steps == 7 and c.precision.tf32 is False and c.batch.micro == "auto"


@pytest.mark.parametrize(
    "args, words",
    [
        (["--optim.lrr=1"], ["optim.lrr", "valid keys", "lr"]),
        (["--nosuch.key=1"], ["nosuch", "valid sections"]),
        (["--train.max_steps=ten"], ["train.max_steps", "int"]),
        (["--precision.mode=fp8"], ["precision.mode", "bf16-mixed", "fp16-mixed", "fp32"]),
        (["--train.max_steps=0"], ["train.max_steps", ">= 1"]),
        (["--batch.micro=big"], ["batch.micro", "auto"]),
        (["--model.d_model=100", "--model.n_head=3"], ["model.d_model", "divisible"]),
        (["--compile.scope=everything"], ["compile.scope", "blocks"]),
    ],
)
def test_bad_values_name_the_field_and_the_valid_values(args, words):
    with pytest.raises(ConfigError) as err:
        load_config("gpt-tiny", args)
    for word in words:
        assert word in str(err.value)


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="gpt-tiny"):
        load_config("gpt5")


def test_written_config_reads_back_identically(tmp_path: Path):
    c = load_config("gpt2-small", ["--optim.lr=1e-4", "--run.name=x y\"z"])
    path = tmp_path / "config.toml"
    path.write_text(to_toml(c))
    assert load_config(str(path)) == c


def test_configs_are_frozen_and_replace_validates():
    c = RunConfig()
    with pytest.raises(Exception):
        c.optim.lr = 1.0  # type: ignore[misc]
    assert c.replace(optim={"lr": 0.5}).optim.lr == 0.5
    with pytest.raises(ConfigError):
        c.replace(optim={"schedule": "exp"})


def test_every_field_is_documented():
    text = describe()
    assert "--precision.mode" in text and "--data.path" in text
    for line in text.splitlines():
        if line.startswith("  --"):
            assert len(line.split(": ", 1)[1]) > 5, line


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="--section.key=value"):
        parse_overrides(["lr=1"])
    with pytest.raises(ConfigError, match="needs a value"):
        parse_overrides(["--optim.lr"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16-mixed is valid on a GPU; the error needs a CPU-only machine")
def test_errors_name_the_python_key_for_python_callers_and_the_flag_on_the_command_line():
    with pytest.raises(ConfigError) as info:
        Engine({"precision": {"mode": "fp16-mixed"}})  # no GPU here, and CI has none either
    assert 'use {"precision": {"mode": "fp32"}}' in str(info.value) and "--" not in str(info.value)
    with audience("cli"), pytest.raises(ConfigError) as info:
        Engine({"precision": {"mode": "fp16-mixed"}})
    assert "use --precision.mode=fp32" in str(info.value)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_compile_modes_are_refused_with_token_batching(mode):
    with pytest.raises(ConfigError, match=f"compile.mode = '{mode}' uses CUDA graphs.*data.batching") as err:
        load_config("gpt-tiny", ["--data.batching=tokens", "--batch.micro=8", f"--compile.mode={mode}"])
    assert "\n" not in str(err.value)
    assert load_config("gpt-tiny", [f"--compile.mode={mode}"]).compile.mode == mode  # windows: one shape, fine
    assert load_config("gpt-tiny", ["--data.batching=tokens", "--batch.micro=8"]).compile.mode == "default"
