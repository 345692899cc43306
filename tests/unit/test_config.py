import dataclasses
from pathlib import Path

import pytest
import torch

from turbotrain import Engine
from turbotrain.app.experts_growth import growth_stops
from turbotrain.base.config import (
    SECTIONS,
    RunConfig,
    audience,
    describe,
    load_config,
    parse_overrides,
    preset_names,
    range_text,
    to_toml,
)
from turbotrain.base.errors import ConfigError
from turbotrain.cli import main


def test_presets_ship_with_the_package():
    assert {"gpt-tiny", "gpt2-small", "gpt2-medium"} <= set(preset_names())
    small = load_config("gpt2-small")
    assert (small.model.n_layer, small.model.n_head, small.model.d_model, small.model.block_size) == (
        12,
        12,
        768,
        1024,
    )


def test_overrides_are_typed_and_win_over_the_preset():
    c = load_config(
        "gpt-tiny",
        ["--optim.lr=1e-3", "--train.max_steps", "7", "--precision.tf32=false", "--batch.micro=auto"],
    )
    assert (
        c.optim.lr == 1e-3
        and c.train.max_steps == 7
        and c.precision.tf32 is False
        and c.batch.micro == "auto"
    )


@pytest.mark.parametrize(
    "args, words",
    [
        (["--optim.lrr=1"], ["optim.lrr", "valid keys", "lr"]),
        (["--nosuch.key=1"], ["nosuch", "valid sections"]),
        (["--train.max_steps=ten"], ["train.max_steps", "int"]),
        (["--precision.mode=fp4"], ["precision.mode", "bf16-mixed", "fp16-mixed", "fp32", "fp8"]),
        (["--train.max_steps=0"], ["train.max_steps", "range [1, 99999999]"]),
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
    c = load_config("gpt2-small", ["--optim.lr=1e-4", '--run.name=x y"z'])
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


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="fp16-mixed is valid on a GPU; the error needs a CPU-only machine"
)
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
    # windows: one shape, fine
    assert load_config("gpt-tiny", [f"--compile.mode={mode}"]).compile.mode == mode
    assert load_config("gpt-tiny", ["--data.batching=tokens", "--batch.micro=8"]).compile.mode == "default"


# Issue 23, item 2: values that hung a run, stalled it silently, ended in allocator or overflow
# tracebacks, or silently built a dense model.
@pytest.mark.parametrize(
    "args, field, words",
    [
        # hung under torchrun
        (
            ["--distributed.timeout_s", "1e11"],
            "distributed.timeout_s",
            ["[1, 2147483]"],
        ),
        (["--distributed.timeout_s", "1e10"], "distributed.timeout_s", ["[1, 2147483]"]),  # DistNetworkError
        (["--distributed.timeout_s", "1e15"], "distributed.timeout_s", ["[1, 2147483]"]),  # OverflowError
        (["--batch.global_size", "4611686018427387904"], "batch.global_size", ["[0, 1048576]"]),  # stalled
        (["--data.prefetch_factor", "1000000000"], "data.prefetch_factor", ["[1, 256]"]),  # stalled
        (["--moe.n_experts", "1000000000"], "moe.n_experts", ["[1, 4096]"]),
        (["--moe.expert_hidden", "4611686018427387904"], "moe.expert_hidden", ["[0, 1048576]"]),
        (["--moe.capacity_factor", "1e300"], "moe.capacity_factor", ["[0, 4096]"]),
        (
            ["--distributed.bucket_cap_mb", "4611686018427387904"],
            "distributed.bucket_cap_mb",
            ["[1, 1048576]"],
        ),
        (["--moe.every", "99"], "moe.every", ["model.n_layer = 4"]),  # built a dense model
        (["--moe.capacity_factor", "5"], "moe.capacity_factor", ["n_experts / moe.top_k = 4"]),
        (["--moe.n_experts", "4096", "--moe.expert_hidden", "1048576"], "moe.n_experts", ["GiB", "memory"]),
    ],
)
def test_a_value_outside_its_range_is_one_line_naming_the_field_and_exit_2(
    tmp_path, capsys, args, field, words
):
    code = main(["train", "--preset", "moe-tiny", f"--run.out_dir={tmp_path}", "--run.device=cpu", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("turbotrain train: error: ") and field in err, err
    for word in words:
        assert word in err, err
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_every_numeric_field_declares_its_range_and_help_config_shows_it():
    text = describe()
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if isinstance(f.default, (int, float)) and not isinstance(f.default, bool):
                assert range_text(f), f"{name}.{f.name} declares no range"
                line = next(x for x in text.splitlines() if x.startswith(f"  --{name}.{f.name}="))
                assert f"(range {range_text(f)})" in line, line
    assert "--distributed.timeout_s=300.0" in text and "(range [1, 2147483])" in text
    for preset in preset_names():
        load_config(preset)  # every shipped preset lies inside the ranges


# Issue 22: the MoE family's own [moe] section (it was a flat union inside [model]).
def test_the_moe_family_reads_its_own_section_and_old_files_still_load(tmp_path):
    config = load_config("moe-tiny", ["--moe.n_experts=4", "--moe.every=2"])
    assert (config.moe.n_experts, config.moe.every, config.moe.top_k) == (4, 2, 2)
    assert "n_experts" not in {f.name for f in dataclasses.fields(config.model)}
    # a run saved before the move (its config.toml holds the experts under [model]) reads them in [moe]
    old = tmp_path / "config.toml"
    old.write_text(
        'preset = "moe-tiny"\n[model]\narch = "moe"\nn_layer = 4\nn_experts = 4\nmoe_every = 2\n'
        'moe_impl = "loop"\n'
    )
    loaded = load_config(str(old), ["--moe.top_k=1"])
    assert (loaded.moe.n_experts, loaded.moe.every, loaded.moe.impl, loaded.moe.top_k) == (4, 2, "loop", 1)
    # a dense run saved with a MoE field that never applied, and a MoE preset switched to the dense GPT, load:
    # only flags given for another family are refused (they would do nothing)
    dense = tmp_path / "dense.toml"
    dense.write_text('preset = "gpt-tiny"\n[model]\narch = "gpt"\nmoe_impl = "loop"\n')
    assert (
        load_config(str(dense)).moe.impl == "loop"
        and load_config("moe-tiny", ["--model.arch=gpt"]).model.arch == "gpt"
    )
    assert "n_experts = 4" in to_toml(loaded).split("\n[moe]\n")[1].split("\n[")[0]


@pytest.mark.parametrize(
    "preset, args, words",
    [
        ("moe-tiny", ["--model.n_experts=4"], ["model.n_experts is now moe.n_experts", "--moe.n_experts=4"]),
        (
            "gpt-tiny",
            ["--moe.n_experts=4"],
            ["moe.n_experts configure model.arch = 'moe'", "model.arch = 'gpt'", "--model.arch=moe"],
        ),
        # no advice that cannot pass
        (
            None,
            ["--model.workload=examples/workload_cnn.py:make", "--moe.top_k=1", "--model.arch=moe"],
            ["moe.top_k configure", "your model (model.workload)", "turbotrain.MoE(...)"],
        ),
    ],
)
def test_moe_settings_in_the_old_place_or_for_another_family_are_one_line(
    tmp_path, capsys, preset, args, words
):
    code = main(
        [
            "train",
            *(["--preset", preset] if preset else []),
            f"--run.out_dir={tmp_path}",
            "--run.device=cpu",
            *args,
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (
            ["--monitor.wandb_mode=online"],
            "monitor.wandb_mode only configures monitor.wandb, off in this run: nothing would use it; "
            "add --monitor.wandb=true, or drop it",
        ),
        (
            ["--monitor.mlflow_uri=sqlite:///x.db", "--monitor.wandb=true"],
            "monitor.mlflow_uri only configures monitor.mlflow, off in this run: nothing would use it; "
            "add --monitor.mlflow=true, or drop it",
        ),
        (
            ["--monitor.project=mine"],
            "monitor.project only configures monitor.wandb / monitor.mlflow / monitor.trackio, off in this run: "
            "nothing would use it; add --monitor.wandb=true or --monitor.mlflow=true or --monitor.trackio=true, "
            "or drop it",
        ),
    ],
)
def test_tracker_settings_without_their_tracker_are_refused_in_one_line(flags, line, capsys, tmp_path):
    """#44 item 11: accepted without a word before, while the same mistake elsewhere is refused."""
    safe = [f"--run.out_dir={tmp_path}", "--train.max_steps=1", "--run.device=cpu"]  # were it to train
    assert main(["train", "--preset=gpt-tiny", *safe, *flags]) == 2
    assert capsys.readouterr().err.strip() == f"turbotrain train: error: {line}"
    load_config("gpt-tiny", {"monitor": {"project": "mine", "trackio": True}})  # with its tracker: taken


def test_a_growth_step_at_or_past_the_end_is_one_warning(caplog):
    """#44 item 11: moe.grow_at_step >= train.max_steps grows nothing in this run: a warning (a
    later, longer resume grows at that step), not a refusal."""
    grow = {"moe": {"grow_at_step": 8, "grow_to": 16}}
    with caplog.at_level("WARNING"):
        assert growth_stops(load_config("moe-tiny", {**grow, "train": {"max_steps": 20}}))
        assert not caplog.records
        assert growth_stops(load_config("moe-tiny", {**grow, "train": {"max_steps": 8}}))
    assert [r.getMessage() for r in caplog.records] == [
        "moe.grow_at_step = 8 is at or past train.max_steps = 8: the experts do not grow in this run "
        '(a resume with {"train": {"max_steps": 16}}, or any end past it, grows them at step 8)'
    ]


# Issue 42, item 6: the out-of-memory fault injection is the tests' (tests/faults/oom.py), no setting.
def test_a_saved_config_with_the_dropped_oom_injection_key_loads_with_one_line_saying_so(tmp_path):
    old = tmp_path / "config.toml"
    old.write_text('preset = "gpt-tiny"\n[memory]\non_oom = "stop"\ninject_oom_at_step = 20\n')
    with pytest.warns(UserWarning) as caught:
        config = load_config(str(old))
    assert config.memory.on_oom == "stop" and not hasattr(config.memory, "inject_oom_at_step")
    (line,) = [str(w.message) for w in caught if "inject_oom_at_step" in str(w.message)]
    assert line == (
        "memory.inject_oom_at_step is no longer a setting (the tests inject out-of-memory errors themselves); ignored"
    )
    with pytest.raises(ConfigError, match="unknown key memory.inject_oom_at_step"):
        load_config(overrides={"memory": {"inject_oom_at_step": 20}})  # a new setting given: refused
