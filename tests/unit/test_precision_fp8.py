"""Issue 26: precision as a registry of plugins, and fp8 (torchao float8 training) tested on CPU in
emulation: it trains, stays near bf16, lists its converted layers, resumes exactly, loads into a
bf16 run, falls back to bf16-mixed on non-finite steps, and every refusal is one line (exit 2)."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from conftest import tiny_overrides

from turbotrain import Engine
from turbotrain.app.training import train
from turbotrain.base.config import PRECISION_MODES, describe, load_config
from turbotrain.base.errors import ConfigError
from turbotrain.cli import main
from turbotrain.core.precision import (
    FP8,
    PRECISIONS,
    DeviceCaps,
    build_precision,
    fallback_mode,
    resolve_precision,
)
from turbotrain.core.precision import fp8 as fp8_module
from turbotrain.core.precision.fp8 import FP8Settings
from turbotrain.loop.checkpoint import load_latest_weights
from turbotrain.loop.monitor import MfuProbe
from turbotrain.parts.hardware import PEAK_KEYS, lookup_peak, precision_key
from turbotrain.parts.models.gpt import GPT, GPTConfig

pytest.importorskip("torchao")

CPU = DeviceCaps("cpu")
A100 = DeviceCaps("cuda", (8, 0), bf16=True)
H100 = DeviceCaps("cuda", (9, 0), bf16=True)
B200 = DeviceCaps("cuda", (10, 0), bf16=True)
EMULATE = {"mode": "fp8", "fp8_emulate": True, "fp8_min_size": 1}  # every linear with dims divisible by 16


def _records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- the registry


def test_the_valid_modes_and_help_config_come_from_the_registry():
    assert list(PRECISION_MODES) == list(PRECISIONS) and "fp8" in PRECISIONS
    line = next(l for l in describe().splitlines() if "--precision.mode=" in l)
    assert all(name in line for name in PRECISIONS)


@pytest.mark.parametrize("caps", [CPU, A100, H100, B200])
def test_auto_never_picks_fp8(caps):
    assert resolve_precision("auto", caps) != "fp8"


def test_fp8_falls_back_to_bf16_mixed_then_fp32_and_is_measured_against_the_fp8_peak():
    assert fallback_mode("fp8", H100) == "bf16-mixed" and fallback_mode("bf16-mixed", H100) == "fp32"
    assert precision_key("fp8") == "fp8" and precision_key("bf16-mixed") == "bf16"


# ----------------------------------------------------------------------------- refusals


def test_each_refusal_is_one_line_naming_the_fix(monkeypatch):
    for caps, words in [
        (CPU, ("on cpu", "fp8_emulate")),
        (A100, ("compute capability (8, 0)", ">= 8.9", "bf16-mixed")),
    ]:
        with pytest.raises(ConfigError) as err:
            resolve_precision("fp8", caps)
        assert len(str(err.value).splitlines()) == 1 and all(w in str(err.value) for w in words), err.value
    resolve_precision("fp8", H100)  # float8 hardware: no refusal, no emulation needed
    monkeypatch.setattr(fp8_module, "torchao_available", lambda: False)
    with pytest.raises(ConfigError, match=r"needs torchao.*turbotrain\[fp8\]"):
        resolve_precision("fp8", H100)


def test_the_cli_refuses_fp8_in_one_line_with_exit_2(tmp_path, capsys, monkeypatch):
    args = ["train", "--no-progress", f"--run.out_dir={tmp_path}", "--run.device=cpu", "--precision.mode=fp8"]
    for extra, word in [
        ([], "fp8_emulate=True"),
        (["--precision.fp8_emulate=true"], "pip install 'turbotrain[fp8]'"),
    ]:
        if extra:
            monkeypatch.setattr(fp8_module, "torchao_available", lambda: False)
        assert main(args + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        errors = [l for l in err if "error" in l.lower()]
        assert len(errors) == 1 and word in errors[0] and "Traceback" not in "\n".join(err), err


# ----------------------------------------------------------------------------- the model transform


def _tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, d_model=32))


def test_the_filter_converts_divisible_linears_above_the_size_and_keeps_the_output_layer():
    with pytest.warns(UserWarning, match="correctness"):
        p = build_precision("fp8", torch.device("cpu"), CPU, FP8Settings(**EMULATE, fp8_skip="blocks.1."))
    model = p.convert_module(_tiny_gpt())
    assert p.converted == ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.0", "blocks.0.mlp.2"]
    assert any(k.startswith("lm_head") and "output layer" in k for k in p.kept)
    assert model.lm_head.weight is model.wte.weight  # still tied
    assert p.summary()["fp8_converted"] == p.converted
    auto = FP8(torch.device("cpu"), emulate=True)  # min_size 0: torchao's H100 thresholds leave d=32 alone
    auto.convert_module(_tiny_gpt())
    assert auto.converted == []
    # MFU's ceiling is what ran: the fp8 peak with float8 layers, the bf16 one when none was converted
    assert p.mfu_peak() == "fp8" and auto.mfu_peak() == "bf16" and "bf16 dense" in auto.summary()["mfu_peak"]
    h100 = lookup_peak("NVIDIA H100 80GB HBM3")
    record = {"samples_per_s": 1000.0, "precision": "fp8"}
    mfu = {peak: MfuProbe(1e9, h100)({**record, "mfu_peak": peak})["mfu"] for peak in ("fp8", "bf16")}
    assert mfu["bf16"] == pytest.approx(1 / h100.bf16_tflops) and mfu["fp8"] == pytest.approx(
        1 / h100.fp8_tflops
    )
    assert fp8_module.worth_converting(3072, 768, "tensorwise", 0) and not fp8_module.worth_converting(
        768, 768, "tensorwise", 0
    )


@pytest.mark.slow
def test_fp8_emulated_trains_near_bf16_lists_its_layers_resumes_exactly_and_loads_into_bf16(
    tmp_path, text_file
):
    data = {"path": str(text_file)}

    def run(where, precision, **kw):
        overrides = tiny_overrides(
            where,
            precision=precision,
            data=data,
            train={"max_steps": 12, "eval_every": 0, "checkpoint_every": 6, **kw},
            monitor={"log_every": 1},
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return train(load_config(overrides=overrides), progress=False)

    full = run(tmp_path / "a", EMULATE)
    losses = [r["loss"] for r in _records(tmp_path / "a" / "runs" / "t")]
    assert losses[-1] < losses[0] - 0.5, losses  # it trains
    opts = full["optimizations"]
    assert opts["precision"] == "fp8" and len(opts["fp8_converted"]) == 8 and "mfu_peak" in opts

    run(tmp_path / "b", {"mode": "bf16-mixed"})
    bf16 = [r["loss"] for r in _records(tmp_path / "b" / "runs" / "t")]
    # the stated tolerance (docs/precision.md)
    assert max(abs(a - b) for a, b in zip(losses, bf16)) < 0.05, (
        losses,
        bf16,
    )

    assert run(tmp_path / "c", EMULATE, stop_after_steps=6)["status"] == "stopped"
    out = tmp_path / "c" / "runs"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert (
            main(
                [
                    "train",
                    "--resume",
                    "--run.out_dir",
                    str(out),
                    "--run.name=t",
                    "--train.stop_after_steps=0",
                    "--no-progress",
                ]
            )
            == 0
        )
    resumed = {r["step"]: r["loss"] for r in _records(out / "t")}  # (the stop writes its step's record again)
    assert [resumed[step] for step in range(1, 13)] == losses  # exactly

    _, weights = load_latest_weights(tmp_path / "a" / "runs" / "t" / "checkpoints")
    # weights stay high precision
    assert all(t.dtype == torch.float32 for t in weights.values() if t.is_floating_point())
    plain = _tiny_gpt_like(full)
    plain.load_state_dict(weights)  # an fp8 checkpoint is a plain model's checkpoint
    with pytest.warns(UserWarning):
        engine = Engine({"run": {"device": "cpu"}, "precision": {"mode": "bf16-mixed"}})
    plain, _, _ = engine.setup(plain)
    tokens = torch.randint(0, plain.cfg.vocab_size, (2, 2, 32))
    assert math.isfinite(engine.evaluate(plain, [(tokens[0], tokens[1])]))


def _tiny_gpt_like(summary) -> GPT:
    m = summary["config"]["model"]
    return GPT(
        GPTConfig(
            vocab_size=summary["resolved"]["vocab_size"],
            block_size=m["block_size"],
            n_layer=m["n_layer"],
            n_head=m["n_head"],
            d_model=m["d_model"],
        )
    )


# ----------------------------------------------------------------------------- FSDP2's float8 all-gather


def test_the_float8_all_gather_is_tensorwise_only_one_line_naming_both_fields(capsys):
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"precision": {"mode": "fp8", "fp8_all_gather": True, "fp8_recipe": "rowwise"}})
    line = str(err.value)
    assert (
        len(line.splitlines()) == 1 and "precision.fp8_all_gather" in line and "precision.fp8_recipe" in line
    ), line
    # tensorwise (the default): accepted
    load_config(overrides={"precision": {"mode": "fp8", "fp8_all_gather": True}})
    # a plugin object is checked by its own fields
    with pytest.raises(ConfigError, match="precision.fp8_recipe"):
        build_precision(FP8(recipe="rowwise", emulate=True, all_gather=True), torch.device("cpu"), CPU)
    assert (
        main(
            [
                "train",
                "--precision.mode=fp8",
                "--precision.fp8_all_gather=true",
                "--precision.fp8_recipe=rowwise",
            ]
        )
        == 2
    )
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and "--precision.fp8_recipe=tensorwise" in err_lines[0], err_lines


@pytest.mark.slow
def test_sharded_conversion_wraps_the_weights_for_the_all_gather_keeps_them_and_reverts_to_plain():
    """convert_module(sharded=True) with fp8_all_gather: the float8 layers' weights become torchao's
    all-gather subclass, yet stay the same Parameter objects (an optimizer built before setup, and a
    tied output layer, still hold them); the state dict holds plain float32 tensors; forward is the
    same as without the all-gather (in one process it only changes how FSDP2 would gather); revert
    (the fallback) gives plain tensors again. Not sharded, the flag changes nothing."""
    float8 = fp8_module.float8_module()
    subclass = float8.WeightWithDynamicFloat8CastTensor
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def converted(sharded: bool) -> tuple[FP8, GPT]:
        p = FP8(torch.device("cpu"), emulate=True, min_size=1, lm_head=True, all_gather=True)
        return p, p.convert_module(_tiny_gpt(), sharded=sharded)

    plain_p, plain = converted(sharded=False)
    assert (
        not any(isinstance(w, subclass) for w in plain.parameters())
        and not plain_p.summary()["fp8_all_gather"]
    )
    assert "FSDP2 does not shard this model" in plain_p.summary()["fp8"]

    model = _tiny_gpt()
    before = dict(model.named_parameters())
    p = FP8(torch.device("cpu"), emulate=True, min_size=1, lm_head=True, all_gather=True)
    p.convert_module(model, sharded=True)
    # 8 block linears and the (tied) output layer
    assert len(p.converted) == 9 and p.summary()["fp8_all_gather"]
    assert dict(model.named_parameters()) == before  # the same objects, by name
    wrapped = {n for n, w in model.named_parameters() if isinstance(w, subclass)}
    # tied: one object
    assert wrapped == {f"{n}.weight" for n in p.converted} - {"lm_head.weight"} | {"wte.weight"}
    assert model.lm_head.weight is model.wte.weight
    state = model.state_dict()
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in state.values()), {
        k: type(t).__name__ for k, t in state.items()
    }
    # no copy
    assert state["blocks.0.mlp.0.weight"].data_ptr() == before["blocks.0.mlp.0.weight"]._tensor.data_ptr()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(tokens), plain(tokens))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(tokens, tokens).backward()
    p.optimizer_step(optimizer, True)  # with no FSDP2 the scale precomputation has nothing to do

    p.revert_module(model)
    assert not any(isinstance(w, subclass) for w in model.parameters()) and not p.all_gathered
    assert dict(model.named_parameters()) == before and model.lm_head.weight is model.wte.weight
    assert all(type(w.data) is torch.Tensor for w in model.parameters())
    assert not any(isinstance(m, float8.Float8Linear) for m in model.modules())
    model(tokens, tokens)  # trains on as plain linears


@pytest.mark.slow
def test_fp8_composes_with_activation_checkpointing_to_the_same_losses():
    """Recomputing the float8 blocks in backward is the same math: checkpointed and plain fp8 runs
    of the same GPT give the same losses step for step (emulated)."""
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))

    def losses(checkpointing: str) -> list[float]:
        with pytest.warns(UserWarning, match="correctness"):
            engine = Engine(
                {"run": {"device": "cpu"}, "precision": EMULATE, "memory": {"checkpointing": checkpointing}}
            )
        model = _tiny_gpt()
        model, opt, _ = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        assert len(engine.precision.converted) == 8
        out = []
        for _ in range(4):
            engine.forward_backward(model, (tokens, tokens))
            engine.step(opt)
            out.append(float(engine.last_loss))  # host-device sync: a test reads every step
        return out

    plain, checkpointed = losses("off"), losses("full")
    assert plain[-1] < plain[0]
    assert checkpointed == pytest.approx(plain, abs=1e-6)


def test_tune_searches_fp8_only_where_it_runs_as_it_is(monkeypatch):
    """fp8 joins tune's precision choices on float8 tensor cores with torchao, never emulated."""
    from turbotrain.app.tune import space

    for caps, expected in ((H100, True), (A100, False), (CPU, False)):
        monkeypatch.setattr(space.DeviceCaps, "of", classmethod(lambda cls, device, caps=caps: caps))
        choices = space.precision_choices(torch.device("cuda" if caps.type == "cuda" else "cpu"))
        assert ("fp8" in choices) is expected, (caps, choices)


# ----------------------------------------------------------------------------- the non-finite fallback


def test_an_injected_inf_falls_back_from_fp8_to_bf16_mixed_with_plain_linears():
    with pytest.warns(UserWarning):
        engine = Engine(
            {
                "run": {"device": "cpu"},
                "precision": {**EMULATE, "max_nonfinite_steps": 1},
                "monitor": {"log_every": 1},
            }
        )
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    model, opt, _ = engine.setup(model, opt)
    assert len(engine.precision.converted) == 2
    x, y = torch.randn(8, 32), torch.randn(8, 16)

    def loss_fn(m, batch, scale=1.0):
        return torch.nn.functional.mse_loss(m(batch[0]).float(), batch[1]) * scale

    engine.forward_backward(model, (x, y), loss_fn)
    assert engine.step(opt)
    engine.poll(opt)
    engine.forward_backward(model, (x, y), lambda m, b: loss_fn(m, b, float("inf")))  # the injected inf
    engine.step(opt)
    engine.poll(opt)
    assert engine.precision.name == "bf16-mixed"
    assert [e.detail for e in engine.events if e.kind == "precision_fallback"] == [
        "fp8 -> bf16-mixed after 1 non-finite steps"
    ]
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.GELU, torch.nn.Linear]
    # the same parameter objects: the optimizer's state still applies
    assert list(model.parameters()) == params
    engine.forward_backward(model, (x, y), loss_fn)
    assert engine.step(opt)


# ----------------------------------------------------------------------------- a plugin of your own


def test_a_new_precision_is_one_class_accepted_by_name_and_as_an_object():
    from turbotrain.core.precision import MixedPrecision

    class HalfMatmuls(MixedPrecision):  # the doc's example (docs/precision.md)
        name = "test-bf16-autocast"
        fallback = "fp32"
        peak = "bf16"

    try:
        assert "test-bf16-autocast" in PRECISION_MODES and precision_key("test-bf16-autocast") == "bf16"
        with_name = Engine({"run": {"device": "cpu"}, "precision": {"mode": "test-bf16-autocast"}})
        assert isinstance(with_name.precision, HalfMatmuls)
        engine = Engine({"run": {"device": "cpu"}}, precision=HalfMatmuls())
        with engine.autocast():
            assert torch.is_autocast_enabled("cpu")
        assert engine.precision.fallback_for(engine.caps) == "fp32"
    finally:
        PRECISIONS.pop("test-bf16-autocast")
        PEAK_KEYS.pop("test-bf16-autocast", None)
        PRECISION_MODES._own.remove("test-bf16-autocast")


def test_the_docs_example_precision_is_one_file_that_imports_registers_and_passes_its_own_test():
    """docs/precision.md's "Adding a precision": the class block, run as the module it says it is
    (its relative imports included), then the doc's own test block."""
    import re
    import sys
    import types
    from pathlib import Path

    section = (
        (Path(__file__).parents[2] / "docs" / "precision.md").read_text().split("## Adding a precision", 1)[1]
    )
    plugin, its_test = re.findall(r"```python\n(.*?)```", section, flags=re.S)[:2]
    name = "turbotrain.core.precision.fp16_unscaled"
    module = types.ModuleType(name)
    module.__package__ = "turbotrain.core.precision"
    sys.modules[name] = module
    try:
        exec(compile(plugin, name, "exec"), module.__dict__)
        namespace = {
            "pytest": pytest,
            "PRECISION_MODES": PRECISION_MODES,
            "precision_key": precision_key,
            "ConfigError": ConfigError,
            "resolve_precision": resolve_precision,
            "DeviceCaps": DeviceCaps,
        }
        exec(its_test, namespace)
        namespace["test_fp16_unscaled"]()
    finally:
        sys.modules.pop(name, None)
        PRECISIONS.pop("fp16-unscaled", None)
        PEAK_KEYS.pop("fp16-unscaled", None)
        if "fp16-unscaled" in PRECISION_MODES._own:
            PRECISION_MODES._own.remove("fp16-unscaled")


# ----------------------------------------------------------------------------- doctor


def test_doctor_reports_fp8_capability():
    from turbotrain.app.doctor import fp8_check

    h100 = {"name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "fp8": True}
    a100 = {"name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0", "fp8": False}
    assert fp8_check([h100], "0.17.0").level == "ok"
    missing = fp8_check([h100], None)
    assert missing.level == "warn" and "turbotrain[fp8]" in missing.fix
    assert fp8_check([a100], "0.17.0").level == "info" and ">= 8.9" in fp8_check([a100], "0.17.0").finding
    cpu = fp8_check([], "0.18.0")
    assert cpu.level == "skip" and "fp8_emulate" in cpu.finding


# ----------------------------------------------------------------------------- bench rows


def test_the_fp8_bench_rows_run_only_on_float8_hardware_with_torchao_and_say_why_not(monkeypatch):
    """The reasons are the fp8 plugin's own (FP8.check), not a second statement of its rule."""
    from turbotrain.app.bench import variants
    from turbotrain.app.bench.workloads import resolve_workload
    from turbotrain.core.precision import fp8

    assert (
        "CUDA GPU with compute capability >= 8.9"
        in {v.name: v for v in variants.precision_variants("cpu")}["fp8"].skip
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    skip = {v.name: v for v in variants.precision_variants("cuda")}["fp8"].skip
    assert "compute capability (8, 0)) has no float8 tensor cores (>= 8.9 needed)" in skip, skip
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(fp8, "torchao_available", lambda: True)
    ablation = {v.name: v for v in variants.ablation_variants(resolve_workload("gpt2-small", "cuda"), "cuda")}
    row = ablation["bf16-compile+fp8"]
    assert (
        not row.skip
        and row.overrides["precision"] == {"mode": "fp8"}
        and row.overrides["compile"]["scope"] == "model"
    )
    monkeypatch.setattr(fp8, "torchao_available", lambda: False)
    assert "turbotrain[fp8]" in {v.name: v for v in variants.precision_variants("cuda")}["fp8"].skip


def test_a_plugin_object_is_checked_by_its_own_fields_and_placed_on_the_engine_device():
    """Engine(precision=obj): FP8(emulate=True) runs on CPU although the config says nothing of
    emulation, and an FP16Mixed built without a device gets a GradScaler for the engine's device."""
    from turbotrain.core.precision.core import DeviceCaps, FP16Mixed, build_precision
    from turbotrain.core.precision.fp8 import FP8

    cpu = torch.device("cpu")
    fp8 = build_precision(FP8(emulate=True), cpu, DeviceCaps.of(cpu))
    assert fp8.emulate and fp8.device == cpu
    scaler_device = FP16Mixed()
    scaler_device.place(torch.device("meta"))  # any device type other than the one it was built for
    assert scaler_device.scaler._device == "meta" and scaler_device.device.type == "meta"
