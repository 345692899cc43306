"""Memory: the batch-size finder on a simulated device, the global-batch plan, activation
checkpointing, memory estimates and measurements, OOM splitting, and config errors."""

from __future__ import annotations

import copy
import json
import logging
import math

import pytest
import torch
from faults.oom import inject_oom
from torch import nn

from turbotrain import Engine, load_config
from turbotrain.base.batch import split_batch
from turbotrain.base.errors import ConfigError, TurbotrainError
from turbotrain.base.rundir import BATCH_CACHE
from turbotrain.cli import main
from turbotrain.core.assembly import build_trainable
from turbotrain.core.oom import HalveOnOOM
from turbotrain.core.optim import build_optimizer
from turbotrain.core.transforms import apply_activation_checkpointing, checkpointed_blocks
from turbotrain.parts.models.gpt import GPT, GPTConfig
from turbotrain.parts.models.mlp import TinyMLP, synthetic_batches
from turbotrain.tools.memory import (
    BatchSearch,
    StepTrial,
    TrialResult,
    estimate_memory,
    find_batch_size,
    measure_step_memory,
    plan_accumulation,
    resolve_batch_size,
    token_batches,
)
from turbotrain.tools.memory import resolve as resolve_module
from turbotrain.tools.memory.finder import CPU_MAX_STEP_S


class SimulatedDevice:
    """A trial on a pretend device: peak = base + per_sample x micro bytes; raises a real
    torch.OutOfMemoryError above ``limit`` samples. Samples/s follow ``throughput(micro)``."""

    def __init__(self, limit: int, base: int = 1_000_000, per_sample: int = 100_000, throughput=None) -> None:
        self.limit, self.base, self.per_sample = limit, base, per_sample
        self.throughput = throughput or (lambda m: 1000.0 * m / (m + 4))
        self.calls: list[int] = []

    def peak(self, micro: int) -> int:
        return self.base + self.per_sample * micro

    def __call__(self, micro: int) -> TrialResult:
        self.calls.append(micro)
        if micro > self.limit:
            raise torch.OutOfMemoryError(f"simulated: {micro} > {self.limit}")
        return TrialResult(self.peak(micro), micro / self.throughput(micro))


def _no_agree(value: int) -> int:
    return value


# ----------------------------------------------------------------------------- finder


@pytest.mark.parametrize("limit", [5, 37, 100, 1000, 3000])
def test_finder_returns_a_size_within_the_headroom_below_the_limit_in_few_trials(limit):
    device = SimulatedDevice(limit)
    search = find_batch_size(device, max_micro=8192, headroom=0.10)

    assert search.micro <= limit  # never above the limit
    line = device.peak(limit) / 1.10  # the most a size may use and keep 10% headroom
    assert device.peak(search.micro) <= line
    grid = 8 if search.micro >= 8 else 1
    assert device.peak(search.micro + 2 * grid) > line  # and not needlessly far below it
    if search.micro >= 8:
        assert search.micro % 8 == 0
    assert len(device.calls) <= 2 * math.ceil(math.log2(limit)) + 1
    assert [t.micro for t in search.trials] == device.calls


def test_finder_never_exceeds_a_memory_cap_and_keeps_headroom_under_it():
    device = SimulatedDevice(limit=10**9)  # never runs out: only the cap binds
    cap = device.peak(300)
    search = find_batch_size(device, max_micro=8192, headroom=0.10, budget_bytes=cap, agree=_no_agree)
    assert device.peak(search.micro) * 1.10 <= cap
    assert device.peak(search.micro + 16) * 1.10 > cap
    assert all(t.fits == (device.peak(t.micro) <= cap) for t in search.trials)
    assert search.limit_bytes == cap


def test_predicted_sizes_over_the_cap_are_not_run():
    """On CPU running out of memory kills the process, so sizes predicted over the cap are skipped."""
    device = SimulatedDevice(limit=10**9)
    cap = device.peak(300)
    search = find_batch_size(device, max_micro=8192, budget_bytes=cap, predict=True, agree=_no_agree)
    assert max(device.peak(m) for m in device.calls) <= cap
    assert any(t.reason.startswith("over budget (predicted") for t in search.trials)
    assert device.peak(search.micro) * 1.10 <= cap


def test_pick_fastest_returns_the_best_measured_throughput():
    def throughput(m: int) -> float:  # rises to 16, then falls (e.g. cache effects)
        return 1000.0 * m if m <= 16 else 16000.0 - 50.0 * (m - 16)

    device = SimulatedDevice(limit=200, throughput=throughput)
    search = find_batch_size(device, max_micro=8192, pick="fastest", agree=_no_agree)
    tried = [t for t in search.trials if t.fits]
    assert search.micro == 16
    assert search.micro == max(tried, key=lambda t: t.samples_per_s).micro


def test_pick_fastest_only_considers_sizes_within_the_headroom():
    device = SimulatedDevice(limit=200, throughput=lambda m: 10.0 * m)  # bigger is always faster
    search = find_batch_size(device, max_micro=8192, pick="fastest", agree=_no_agree)
    fastest_tried = max((t for t in search.trials if t.fits), key=lambda t: t.samples_per_s)
    assert device.peak(search.micro) * 1.10 <= device.peak(fastest_tried.micro)
    assert search.micro < fastest_tried.micro


def test_on_cpu_growth_stops_once_samples_per_s_collapse():
    def throughput(m: int) -> float:  # CPU-like: flat, then caches thrash past 128
        return 100.0 if m <= 128 else 30.0

    device = SimulatedDevice(limit=10**9, throughput=throughput)
    search = find_batch_size(device, max_micro=4096, slowdown_stop=0.5, agree=_no_agree)
    assert max(device.calls) == 256 and search.micro == 128


def test_finder_stops_at_max_micro_when_everything_fits():
    device = SimulatedDevice(limit=10**9)
    search = find_batch_size(device, max_micro=64, agree=_no_agree)
    assert search.micro == 64 and max(device.calls) == 64


def test_finder_says_what_to_do_when_nothing_fits():
    with pytest.raises(TurbotrainError, match="checkpointing"):
        find_batch_size(SimulatedDevice(limit=0), agree=_no_agree)


def test_finder_does_not_hide_errors_that_are_not_out_of_memory():
    def broken(micro: int) -> TrialResult:
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        find_batch_size(broken, agree=_no_agree)


def test_bad_search_settings_name_the_field_and_the_valid_values():
    with pytest.raises(ConfigError, match=r"batch.pick = 'biggest'.*largest, fastest"):
        find_batch_size(SimulatedDevice(10), pick="biggest")
    with pytest.raises(ConfigError, match="batch.headroom"):
        find_batch_size(SimulatedDevice(10), headroom=1.5)


@pytest.mark.parametrize(
    "found, global_size, accumulation, world, expected",
    [
        (120, 256, 1, 1, (64, 4, 256)),  # 120 does not divide 256: 4 x 64 keeps it exactly
        (48, 256, 1, 1, (32, 8, 256)),
        (512, 256, 1, 1, (256, 1, 256)),  # fits in one micro-batch
        (40, 256, 1, 2, (32, 4, 256)),  # 128 per rank
        (40, 0, 3, 2, (40, 3, 240)),  # no global batch set: accumulation is kept
    ],
)
def test_plan_keeps_the_global_batch(found, global_size, accumulation, world, expected):
    micro, acc, total, note = plan_accumulation(found, global_size, accumulation, world)
    assert (micro, acc, total) == expected
    assert micro <= found and note == ""


def test_plan_says_so_when_the_global_batch_cannot_be_kept():
    micro, acc, total, note = plan_accumulation(100, 257, 1, 1)  # 257 is prime
    assert micro <= 100 and total == micro * acc >= 257
    assert "257" in note and str(total) in note
    micro, acc, total, note = plan_accumulation(64, 100, 1, 3)
    assert "not divisible by 3" in note


# ----------------------------------------------------------------------------- real trials


def _tiny_gpt(n_layer: int = 2, d_model: int = 32, block_size: int = 16) -> GPT:
    return GPT(GPTConfig(vocab_size=64, n_layer=n_layer, n_head=2, d_model=d_model, block_size=block_size))


@pytest.mark.slow
def test_step_trial_restores_everything_it_changed():
    engine = Engine({"run": {"device": "cpu"}})
    model = _tiny_gpt()
    optimizer = build_optimizer(model, engine.device, lr=1e-2)
    model, optimizer, _ = engine.setup(model, optimizer)
    before = copy.deepcopy(model.state_dict())
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    with StepTrial(engine, model, optimizer, token_batches(64, 16, engine.device)) as trial:
        small, large = trial(2), trial(8)
    assert 0 < small.peak_bytes < large.peak_bytes and small.step_s > 0
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert not optimizer.state and all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.rand(3), expected_next)  # RNG state restored


@pytest.mark.slow
def test_resolve_batch_size_on_cpu_keeps_the_global_batch_and_caches(tmp_path, monkeypatch):
    # memory decides here: the CPU step-time rule is lifted (on a loaded machine a size-8 step of
    # this model took over CPU_MAX_STEP_S and the search stopped below 8: a flaky test)
    monkeypatch.setattr(resolve_module, "CPU_MAX_STEP_S", 0.0)  # 0: the rule is off
    overrides = {
        "run": {"device": "cpu"},
        "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 32, "vocab_size": 64},
        "batch": {"micro": "auto", "global_size": 48},
    }
    probe = load_config(overrides=overrides)
    cap_gib = estimate_memory(probe, micro=20).peak_bytes / 2**30
    overrides["batch"]["max_memory_gib"] = cap_gib
    config = load_config(overrides=overrides)
    engine = Engine(config)
    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, block_size=32))
    optimizer = build_optimizer(model, engine.device, lr=1e-2)
    model, optimizer, _ = engine.setup(model, optimizer)

    # memory decides, not timing
    resolved, search = resolve_batch_size(config, engine, model, optimizer, run_dir=tmp_path)
    assert isinstance(search, BatchSearch) and not search.cached
    assert resolved.batch.micro * resolved.batch.accumulation == 48 == search.global_batch
    assert engine.accumulation == resolved.batch.accumulation
    assert search.chosen_peak_bytes * 1.10 <= cap_gib * 2**30
    assert 8 <= search.found < 48
    assert all(t.peak_bytes is None or t.peak_bytes <= cap_gib * 2**30 for t in search.trials)

    cache = json.loads((tmp_path / BATCH_CACHE).read_text())
    assert len(cache) == 1
    again, cached = resolve_batch_size(config, engine, model, optimizer, run_dir=tmp_path)
    assert cached.cached and again.batch == resolved.batch


def _steps_taking(monkeypatch, step_s) -> None:
    """The finder's trials (real steps) measure their peaks but report ``step_s(micro)`` seconds:
    a loaded CPU's real times would move the answer (the CPU's 1 s step budget)."""
    measure = StepTrial.__call__
    monkeypatch.setattr(
        StepTrial, "__call__", lambda self, micro: TrialResult(measure(self, micro).peak_bytes, step_s(micro))
    )


def _timed_cpu_search(monkeypatch, global_size: int, step_s):
    """A tiny GPT on the CPU with ``batch.micro = auto``, whose trials measure peaks but report
    ``step_s(micro)`` seconds (:func:`_steps_taking`)."""
    _steps_taking(monkeypatch, step_s)
    config = load_config(
        overrides={
            "run": {"device": "cpu"},
            "batch": {"micro": "auto", "global_size": global_size},
            "model": {"n_layer": 1, "n_head": 2, "d_model": 16, "block_size": 8, "vocab_size": 64},
        }
    )
    return config, build_trainable(config, _tiny_gpt(n_layer=1, d_model=16, block_size=8))


@pytest.mark.slow
def test_the_cpu_search_stops_at_the_step_time_budget(monkeypatch, caplog):
    """On CPU RAM is no useful limit: the doubling stops at the first size whose measured step takes
    over CPU_MAX_STEP_S (here 0.1 s per sequence: 16 takes 1.6 s), which fails, and every
    size tried is a progress line (issue 32 item 7: 1024 sequences at a minute a step before)."""
    config, t = _timed_cpu_search(monkeypatch, 64, lambda micro: 0.1 * micro)
    with caplog.at_level(logging.INFO):
        resolved, search = resolve_batch_size(config, t.engine, t.model, t.optimizer)
    assert CPU_MAX_STEP_S == 1.0
    # global batch 64 kept
    assert search.found == resolved.batch.micro == 8 and resolved.batch.accumulation == 8
    assert [r.micro for r in search.trials] == [1, 2, 4, 8, 16]
    assert search.trials[-1].reason == "over the step-time budget (1.60 s > 1 s)"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("batch finder: micro-batch")]
    assert lines[0].startswith("batch finder: micro-batch 1 fits, 0.10 s a step, peak ") and len(lines) == 6
    assert lines[4].startswith(
        "batch finder: micro-batch 16 over the step-time budget (1.60 s > 1 s), 1.60 s a step"
    )


# ----------------------------------------------------------------------------- checkpointing


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_checkpointing_gives_the_same_gradients_and_recomputes_in_backward():
    torch.manual_seed(0)
    reference = _tiny_gpt(n_layer=4)
    x = torch.randint(64, (4, 16))
    y = torch.randint(64, (4, 16))
    reference(x, y).backward()
    expected = _grads(reference)

    for mode, blocks in [("full", [0, 1, 2, 3]), ("selective", [0, 2])]:
        model = copy.deepcopy(reference)
        model.zero_grad(set_to_none=True)
        apply_activation_checkpointing(model, mode)
        assert checkpointed_blocks(model) == blocks
        assert model.state_dict().keys() == reference.state_dict().keys()
        calls = []
        model.blocks[0].attn.register_forward_hook(lambda *a: calls.append(1))
        model(x, y).backward()
        assert len(calls) == 2  # forward, then the recompute in backward
        for name, grad in _grads(model).items():
            torch.testing.assert_close(grad, expected[name], rtol=0, atol=1e-6, msg=f"{mode}: {name}")


def test_engine_setup_applies_the_configured_checkpointing():
    engine = Engine({"run": {"device": "cpu"}, "memory": {"checkpointing": "selective"}})
    model, _, _ = engine.setup(_tiny_gpt(n_layer=4))
    assert checkpointed_blocks(model) == [0, 2]
    with torch.no_grad():  # evaluation runs the blocks plainly
        assert model(torch.randint(64, (2, 16))).shape == (2, 16, 64)


def test_checkpointing_errors_name_the_field_and_the_valid_values():
    with pytest.raises(ConfigError, match=r"memory.checkpointing = 'some'.*off, full, selective"):
        apply_activation_checkpointing(_tiny_gpt(), "some")
    with pytest.raises(ConfigError, match="memory.checkpointing needs a model with a ModuleList"):
        apply_activation_checkpointing(nn.Linear(2, 2), "full")


# ----------------------------------------------------------------------------- memory report


@pytest.mark.slow
def test_memory_report_shows_the_activation_drop_with_checkpointing():
    config = load_config(
        overrides={"model": {"n_layer": 8, "n_head": 4, "d_model": 256, "block_size": 256, "vocab_size": 256}}
    )
    off, selective, full = (
        estimate_memory(config, micro=8, checkpointing=m, precision="fp32")
        for m in ("off", "selective", "full")
    )
    n_params = sum(
        p.numel()
        for p in GPT(GPTConfig(vocab_size=256, n_layer=8, n_head=4, d_model=256, block_size=256)).parameters()
    )

    assert off.params_bytes == selective.params_bytes == full.params_bytes == 4 * n_params
    assert off.grads_bytes == off.params_bytes
    assert 8 * n_params <= off.optimizer_bytes <= 8 * n_params + 4096  # AdamW: two moments (+ step counters)
    assert full.activations_bytes < selective.activations_bytes < off.activations_bytes
    assert full.activations_bytes < 0.25 * off.activations_bytes
    assert full.peak_bytes < off.peak_bytes


@pytest.mark.slow
def test_meta_estimate_matches_a_real_cpu_step():
    config = load_config(
        overrides={"model": {"n_layer": 2, "n_head": 2, "d_model": 64, "block_size": 64, "vocab_size": 128}}
    )
    estimate = estimate_memory(config, micro=4, precision="fp32")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=128, n_layer=2, n_head=2, d_model=64, block_size=64))
    optimizer = build_optimizer(model, torch.device("cpu"), lr=1e-3)
    measured = measure_step_memory(model, optimizer, token_batches(128, 64, torch.device("cpu"))(4))
    assert measured.method == "tensor-tracking" and estimate.method == "meta-estimate"
    assert (
        measured.params_bytes == estimate.params_bytes
        and measured.optimizer_bytes == estimate.optimizer_bytes
    )
    assert measured.activations_bytes == pytest.approx(estimate.activations_bytes, rel=0.05)
    assert measured.forward_peak_bytes == pytest.approx(estimate.forward_peak_bytes, rel=0.05)


@pytest.mark.slow
def test_measured_activation_memory_drops_with_checkpointing_on_cpu():
    stats = {}
    for mode in ("off", "full"):
        torch.manual_seed(0)
        model = apply_activation_checkpointing(_tiny_gpt(n_layer=4, d_model=64, block_size=64), mode)
        optimizer = build_optimizer(model, torch.device("cpu"), lr=1e-3)
        stats[mode] = measure_step_memory(model, optimizer, token_batches(64, 64, torch.device("cpu"))(8))
    assert stats["full"].activations_bytes < 0.5 * stats["off"].activations_bytes


def test_memory_cli_prints_the_report_and_rejects_bad_values(capsys):
    assert (
        main(["memory", "--micro", "2", "--model.n_layer=2", "--model.d_model=32", "--model.block_size=32"])
        == 0
    )
    out = capsys.readouterr().out
    assert "activations" in out and "ckpt full" in out and "peak: backward" in out
    assert main(["memory", "--memory.checkpointing=some"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "memory.checkpointing" in err and "off, full, selective" in err
    assert main(["memory", "--micro", "0"]) == 2  # not silently the config's micro-batch
    assert "--micro = 0" in capsys.readouterr().err


EXAMPLES = __import__("pathlib").Path(__file__).parents[2] / "examples"


@pytest.mark.slow
def test_memory_of_your_own_model_is_estimated_on_its_batch_and_matches_a_measured_step(capsys):
    """`turbotrain memory --model FILE.py:FUNC`: the workload's model and loss on one batch of its
    loader. A CNN without repeated blocks gets the checkpointing-off estimate (the other modes say
    why they are missing) and it matches one real step; a transformers GPT-2 (tied embeddings kept
    tied on the meta device) gets all three, full checkpointing holding the fewest activations."""
    assert (
        main(
            ["memory", "--model", f"{EXAMPLES}/workload_cnn.py:make", "--micro", "16", "--measure", "--json"]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert (
        doc["micro_batch"] == 16
        and list(doc["estimate"]) == ["off"]
        and doc["model"].endswith("workload_cnn.py:make")
    )
    estimate, measured = doc["estimate"]["off"], doc["measured"]
    assert estimate["params_bytes"] == measured["params_bytes"]
    assert estimate["peak_bytes"] == pytest.approx(measured["peak_bytes"], rel=0.05)
    assert main(["memory", "--model", f"{EXAMPLES}/workload_cnn.py:make", "--micro", "16"]) == 0
    assert (
        "checkpointing not estimated: memory.checkpointing needs a model with a ModuleList"
        in capsys.readouterr().out
    )

    # a dropless mixture of experts sizes its work from its routing: no meta estimate, a real step says it
    assert main(["memory", "--model", f"{EXAMPLES}/moe_classifier.py:make", "--micro", "16"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1 and "cannot be estimated on the meta device" in err and "--measure" in err
    ), err
    assert (
        main(
            [
                "memory",
                "--model",
                f"{EXAMPLES}/moe_classifier.py:make",
                "--micro",
                "16",
                "--measure",
                "--json",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert (
        doc["estimate"] == {} and "tokens per expert" in doc["notes"][0] and doc["measured"]["peak_bytes"] > 0
    )

    pytest.importorskip("transformers")
    assert main(["memory", "--model", f"{EXAMPLES}/hf_causal_lm.py:make", "--measure", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    off, full, measured = doc["estimate"]["off"], doc["estimate"]["full"], doc["measured"]
    assert off["params_bytes"] == measured["params_bytes"]  # the tied lm_head counted once
    assert (
        full["activations_bytes"]
        < doc["estimate"]["selective"]["activations_bytes"]
        < off["activations_bytes"]
    )
    assert off["activations_bytes"] == pytest.approx(measured["activations_bytes"], rel=0.2)


@pytest.mark.parametrize(
    "section, values, words",
    [
        ("batch", {"pick": "biggest"}, ["batch.pick", "largest, fastest"]),
        ("batch", {"micro": "big"}, ["batch.micro", "'auto'"]),
        ("batch", {"headroom": "1.5"}, ["batch.headroom", "[0, 1)"]),
        ("memory", {"on_oom": "retry"}, ["memory.on_oom", "halve, stop"]),
    ],
)
def test_config_errors_name_the_field_and_valid_values(section, values, words):
    with pytest.raises(ConfigError) as info:
        load_config(overrides={section: values})
    for word in words:
        assert word in str(info.value)


# ----------------------------------------------------------------------------- OOM splitting


def _engine_with_runner(accumulation: int) -> tuple[Engine, TinyMLP, torch.optim.Optimizer]:
    engine = Engine(
        {"run": {"device": "cpu"}, "optim": {"grad_clip": 0.0}, "batch": {"accumulation": accumulation}}
    )
    torch.manual_seed(0)
    model = TinyMLP(d_in=8, width=16, depth=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    return engine, *engine.setup(model, optimizer)[:2]


def test_uneven_split_weights_each_part_by_its_share():
    batch = synthetic_batches(1, batch_size=5, d_in=8)[0]
    assert [p[0].shape[0] for p in split_batch(batch, 2)] == [3, 2]
    grads = []
    for split in (1, 2, 4):
        engine, model, _ = _engine_with_runner(1)
        engine.set_split(split)
        loss = engine.forward_backward(model, batch)
        grads.append((_grads(model), float(loss.detach())))
    for g, loss in grads[1:]:
        assert loss == pytest.approx(grads[0][1], abs=1e-6)
        for name in g:
            torch.testing.assert_close(g[name], grads[0][0][name], rtol=0, atol=1e-6)


def test_injected_oom_mid_accumulation_re_runs_the_step_with_identical_gradients():
    batches = synthetic_batches(2, batch_size=8, d_in=8)
    engine, model, optimizer = _engine_with_runner(2)
    for b in batches:
        engine.forward_backward(model, b)
    expected = _grads(model)

    with inject_oom(1):
        engine = Engine({"run": {"device": "cpu"}, "optim": {"grad_clip": 0.0}, "batch": {"accumulation": 2}})
    torch.manual_seed(0)
    model = TinyMLP(d_in=8, width=16, depth=2)
    model, optimizer, _ = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
    for b in batches:
        engine.forward_backward(model, b)
    assert isinstance(engine.oom_policy, HalveOnOOM) and engine.split == 2
    assert engine.accumulation == 4 and engine.pending_micro_steps == 4
    assert engine.state.batches == 2 and engine.state.micro_step == 4
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=1e-6)
    assert engine.step(optimizer) is True
    assert [e.kind for e in engine.events] == ["oom_recovery"]
    assert (
        "micro-batch 8 -> 4" in engine.events[0].detail
        and "global batch 16 unchanged" in engine.events[0].detail
    )


@pytest.mark.slow
def test_memory_of_an_emulated_fp8_run_on_cpu_is_estimated_not_refused(capsys):
    """The precision is checked with the whole [precision] section: fp8_emulate runs on a CPU."""
    pytest.importorskip("torchao")
    args = [
        "memory",
        "--preset",
        "gpt-tiny",
        "--micro",
        "2",
        "--json",
        "--run.device=cpu",
        "--precision.mode=fp8",
    ]
    assert main([*args, "--precision.fp8_emulate=true"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["precision"] == "fp8" and out["estimate"]["off"]["activations_bytes"] > 0
    assert main(args) == 2  # without emulation: refused in one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fp8_emulate" in err[0]


@pytest.mark.slow
def test_get_optimal_batch_size_in_one_call_on_a_model_and_a_batch_or_a_loader(monkeypatch):
    """The finder for Python users: a size that fits the memory cap with its headroom, the sizes
    tried with their measured peaks; the same from a loader; your model untouched. Step times are
    fixed at 10 ms (on a loaded CPU a real step could pass the 1 s budget and move the answer,
    which is memory's here); peaks are measured."""
    from torch.utils.data import DataLoader, TensorDataset

    from turbotrain.tools.memory import get_optimal_batch_size

    _steps_taking(monkeypatch, lambda micro: 0.01)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(4, 64), torch.randint(4, (4,))

    def loss(m, batch):
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    cap_gib = 2 / 1024  # 2 MiB: weights + AdamW state are ~0.3 MiB, each row a few KiB more
    search = get_optimal_batch_size(
        model, (x, y), loss_fn=loss, config={"run": {"device": "cpu"}}, max_memory_gib=cap_gib, max_micro=4096
    )
    fitting = [t for t in search.trials if t.fits]
    assert fitting and all(t.peak_bytes is not None for t in search.trials if t.fits)
    # on CPU the budget is the cap plus the weights already in RAM; the choice keeps 10 % under it
    assert search.budget_bytes > cap_gib * 2**30 and search.limit_bytes <= search.budget_bytes
    assert 8 <= search.found < 4096 and search.chosen_peak_bytes <= search.limit_bytes / 1.1
    assert any(not t.fits for t in search.trials)  # it met the cap
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    loader = DataLoader(TensorDataset(torch.randn(16, 64), torch.randint(4, (16,))), batch_size=4)
    from_loader = get_optimal_batch_size(
        model, loader, loss_fn=loss, config={"run": {"device": "cpu"}}, max_micro=16
    )
    assert from_loader.found == 16 and [t.micro for t in from_loader.trials][:2] == [1, 2]


def test_a_batch_cache_of_another_shape_is_one_line_and_searched_again(tmp_path, caplog, monkeypatch):
    """Issue 44 item 5: the batch finder's cache holding valid JSON of another shape ([], null, an
    entry missing its size, an entry as a string) is one line naming the file, and the search runs
    again (before: silently, or a KeyError). Step times are fixed (a loaded CPU's would move the
    answer); peaks are measured."""
    config, t = _timed_cpu_search(monkeypatch, 4, lambda micro: 0.01)
    first, search = resolve_batch_size(config, t.engine, t.model, t.optimizer, run_dir=tmp_path)
    path = tmp_path / BATCH_CACHE
    (key,) = data = json.loads(path.read_text())
    for damaged in ([], None, {key: {**data[key], "value": {"pick": "largest"}}}, {key: "micro 4"}):
        path.write_text(json.dumps(damaged))
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            again, fresh = resolve_batch_size(config, t.engine, t.model, t.optimizer, run_dir=tmp_path)
        assert not fresh.cached and fresh.trials and again.batch == first.batch, damaged
        lines = [r.getMessage() for r in caplog.records if "ignoring the cached" in r.getMessage()]
        assert len(lines) == 1 and str(path) in lines[0] and "\n" not in lines[0], damaged
        assert json.loads(path.read_text())[key]["value"]["found"] == search.found  # written again


def test_a_small_models_table_reads_in_mib_or_kib_not_zero_gib(capsys):
    """#47 item 8: below 1 GiB the table's unit is MiB (or KiB), so its cells are not 0.000."""
    assert main(["memory", "--model", f"{EXAMPLES}/workload_cnn.py:make", "--micro", "16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (head,) = [x for x in lines if x.split()[:1] in (["GiB"], ["MiB"], ["KiB"])]
    (peak,) = [x for x in lines if x.startswith("peak ")]
    assert head.split()[0] in ("MiB", "KiB") and all(float(v) > 0.01 for v in peak.split()[1:]), (head, peak)
