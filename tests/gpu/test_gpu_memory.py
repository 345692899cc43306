"""GPU checks of the memory module (skipped without CUDA): the finder against real out-of-memory
errors and the allocator's counters, checkpointing savings, estimates vs measurements, recovery."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_overrides
from faults.oom import inject_oom

from turbotrain import Engine, fit, load_config
from turbotrain.app.training import train
from turbotrain.base.units import GIB
from turbotrain.core.optim import build_optimizer
from turbotrain.parts.models.gpt import GPT, GPTConfig
from turbotrain.tools.memory import estimate_memory, measure_step_memory, resolve_batch_size, token_batches
from turbotrain.tools.memory.stats import storage_bytes

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def _setup(overrides: dict):
    config = load_config(overrides=overrides)
    engine = Engine(config)
    m = config.model
    model = GPT(
        GPTConfig(
            vocab_size=m.vocab_size,
            n_layer=m.n_layer,
            n_head=m.n_head,
            d_model=m.d_model,
            block_size=m.block_size,
        )
    )
    optimizer = build_optimizer(model, engine.device, lr=1e-4)
    model, optimizer, _ = engine.setup(model, optimizer)
    return config, engine, model, optimizer


def test_finder_under_a_cap_then_trains_without_exceeding_it(tmp_path):
    cap_gib = 4.0
    config, engine, model, optimizer = _setup(
        {
            "model": {"n_layer": 4, "n_head": 8, "d_model": 512, "block_size": 512, "vocab_size": 50304},
            "compile": {"scope": "off"},
            "batch": {"micro": "auto", "max_memory_gib": cap_gib, "global_size": 256},
        }
    )
    # One small forward/backward first: the cuBLAS workspaces (one per stream, autograd's included,
    # tens of MiB on Hopper, held by the caching allocator for the process's life) exist before
    # the baseline is read, so the check sees only what the search itself left behind.
    model(torch.randint(0, 50304, (1, 16), device=engine.device)).float().mean().backward()
    model.zero_grad(set_to_none=True)
    resting = torch.cuda.memory_allocated()
    assert resting >= storage_bytes(list(model.parameters()) + list(model.buffers()))
    config, search = resolve_batch_size(config, engine, model, optimizer, run_dir=tmp_path)
    assert torch.cuda.memory_allocated() <= resting + 16 * 2**20  # the search freed what it allocated
    assert not optimizer.state
    assert config.batch.micro * config.batch.accumulation == 256
    assert search.chosen_peak_bytes * 1.1 <= cap_gib * GIB

    torch.cuda.reset_peak_memory_stats()
    make = token_batches(50304, 512, engine.device)
    batches = [make(config.batch.micro) for _ in range(2)] * config.batch.accumulation  # two optimizer steps
    fit(engine, model, optimizer, batches, max_steps=2)
    assert engine.state.step == 2
    assert torch.cuda.max_memory_allocated() <= cap_gib * GIB


def test_finder_meets_a_real_out_of_memory_error_and_keeps_headroom(tmp_path):
    config, engine, model, optimizer = _setup(
        {
            "model": {"n_layer": 4, "n_head": 12, "d_model": 768, "block_size": 1024, "vocab_size": 50304},
            "compile": {"scope": "off"},
            "batch": {"micro": "auto"},
        }
    )
    config, search = resolve_batch_size(config, engine, model, optimizer, run_dir=tmp_path)
    if not any(t.reason == "out of memory" for t in search.trials):
        pytest.skip(f"this GPU fits the 1024-sequence ceiling ({torch.cuda.get_device_name()})")
    oom_sizes = [t.micro for t in search.trials if t.reason == "out of memory"]
    assert config.batch.micro < min(oom_sizes)
    assert search.chosen_peak_bytes * (1 + search.headroom) <= search.limit_bytes
    # the chosen size trains (the promise: it never runs out of memory later)
    make = token_batches(50304, 1024, engine.device)
    fit(engine, model, optimizer, [make(config.batch.micro)] * 5, max_steps=5)


def test_checkpointing_cuts_measured_activation_memory():
    stats = {}
    for mode in ("off", "selective", "full"):
        _, engine, model, optimizer = _setup(
            {
                "model": {"n_layer": 8, "n_head": 8, "d_model": 512, "block_size": 512, "vocab_size": 256},
                "compile": {"scope": "off"},
                "memory": {"checkpointing": mode},
            }
        )
        batch = token_batches(256, 512, engine.device)(16)
        stats[mode] = measure_step_memory(model, optimizer, batch, autocast=engine.autocast)
        del model, optimizer
    assert (
        stats["full"].activations_bytes
        < stats["selective"].activations_bytes
        < stats["off"].activations_bytes
    )
    assert stats["full"].activations_bytes < 0.3 * stats["off"].activations_bytes


def test_meta_estimate_is_close_to_the_cuda_measurement():
    overrides = {
        "model": {"n_layer": 6, "n_head": 8, "d_model": 512, "block_size": 512, "vocab_size": 50304},
        "compile": {"scope": "off"},
    }
    config, engine, model, optimizer = _setup(overrides)
    measured = measure_step_memory(
        model, optimizer, token_batches(50304, 512, engine.device)(8), autocast=engine.autocast
    )
    estimate = estimate_memory(config, micro=8, precision=engine.precision.name)
    assert estimate.params_bytes == measured.params_bytes
    assert estimate.activations_bytes == pytest.approx(measured.activations_bytes, rel=0.25)
    assert estimate.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.25)


def test_injected_oom_recovers_on_cuda(tmp_path, text_file):
    def config(name, **memory):
        return load_config(
            overrides=tiny_overrides(
                tmp_path,
                data={"path": str(text_file)},
                run={"name": name, "device": "cuda"},
                precision={"mode": "fp32", "tf32": False},
                compile={"scope": "off"},
                train={"max_steps": 24, "eval_every": 0, "checkpoint_every": 0},
                memory=memory,
            )
        )

    plain = train(config("plain"))
    with inject_oom(20):
        hit = train(config("oom"))
    assert [e["kind"] for e in hit["events"]] == ["oom_recovery"]
    assert hit["final_train_loss"] == pytest.approx(plain["final_train_loss"], abs=1e-4)


# ----------------------------------------------------------------------------- memory controls, deterministic mode


def test_memory_cap_refuses_an_allocation_past_it():
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    try:
        Engine({"run": {"device": str(device)}, "memory": {"max_fraction": 0.05}})
        torch.cuda.empty_cache()
        small = torch.empty(int(0.02 * total), dtype=torch.uint8, device=device)  # under the cap: fine
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(0.06 * total), dtype=torch.uint8, device=device)
        del small
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)  # process-wide: lift it for the other tests
        torch.cuda.empty_cache()


def test_memory_warning_fires_once_on_real_counters_and_reset_peak_starts_over():
    from turbotrain.loop.monitor import MemoryProbe

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    probe = MemoryProbe(device, warn_fraction=0.9, limit_bytes=torch.cuda.memory_reserved(device) + GIB)
    probe.reset_peak()
    assert "memory_warning" not in probe({"step": 1})
    x = torch.empty(GIB, dtype=torch.uint8, device=device)
    first = probe({"step": 2})
    assert "memory_warning" in first and first["mem_peak_gib"] >= 1.0
    assert "memory_warning" not in probe({"step": 3})  # once
    del x
    torch.cuda.empty_cache()
    probe.reset_peak()
    assert probe({"step": 4})["mem_peak_gib"] < 0.5


def test_deterministic_mode_trains_twice_to_identical_losses_on_cuda():
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )

    def run() -> list[float]:
        torch.manual_seed(0)
        engine = Engine({"run": {"device": "cuda", "deterministic": True}, "compile": {"scope": "off"}})
        model = GPT(GPTConfig(vocab_size=512, n_layer=2, n_head=4, d_model=128, block_size=64, dropout=0.1))
        optimizer = build_optimizer(model, engine.device, lr=1e-3)
        g = torch.Generator().manual_seed(1)
        batches = [(x[:, :-1], x[:, 1:]) for x in torch.randint(0, 512, (6, 16, 65), generator=g)]
        model, optimizer, loader = engine.setup(model, optimizer, batches)
        losses = []
        for batch in loader:
            engine.forward_backward(model, batch)
            engine.step(optimizer)
            losses.append(engine.last_loss.item())
        return losses

    try:
        first, second = run(), run()
        assert first == second
        assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]
