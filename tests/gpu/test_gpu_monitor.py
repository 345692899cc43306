"""GPU checks of monitoring and doctor (skipped without CUDA)."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import tiny_overrides

from turbotrain import load_config
from turbotrain.app.doctor import run_probes
from turbotrain.app.training import build_training
from turbotrain.base.rundir import new_run_dir
from turbotrain.loop.hooks import Hook
from turbotrain.loop.monitor import MemoryProbe, NvmlSampler, count_flops_per_sample
from turbotrain.parts.hardware import lookup_peak
from turbotrain.parts.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

LOG_EVERY, MAX_STEPS = 4, 12


class SyncDebug(Hook):
    """Placed last: after each step, turn CUDA's sync debug mode to "error" when the next step
    neither logs nor is the first one (whose time is measured once, with a synchronize), so any
    host-device sync in the loop, the engine or the hooks on those steps raises."""

    def __init__(self, log_every: int) -> None:
        self.log_every = log_every

    def _arm_for_next(self, done: int, max_steps: int) -> None:
        nxt = done + 1
        # After the last step the fit ends: the final evaluation and checkpoint read the device by
        # design (once), so nothing is armed past max_steps.
        quiet = nxt % self.log_every != 0 and nxt != 1 and nxt <= max_steps
        torch.cuda.set_sync_debug_mode("error" if quiet else "default")

    def on_fit_start(self, ctx) -> None:
        self._arm_for_next(ctx.engine.state.step, ctx.max_steps)

    def on_step_end(self, ctx) -> None:
        self._arm_for_next(ctx.engine.state.step, ctx.max_steps)

    def on_fit_end(self, ctx) -> None:
        torch.cuda.set_sync_debug_mode("default")

    def on_exception(self, ctx, exc) -> None:
        torch.cuda.set_sync_debug_mode("default")


def _gpu_config(tmp_path, text_file, **sections):
    base = {
        "run": {"device": "cuda"},
        "data": {"path": str(text_file)},
        "compile": {"scope": "off"},
        "train": {"max_steps": MAX_STEPS, "eval_every": 0, "checkpoint_every": 0},
        "monitor": {"log_every": LOG_EVERY, "nvml": True},
    }
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    return load_config(overrides=tiny_overrides(tmp_path, **base))


def test_default_loop_makes_no_host_sync_on_non_logging_steps(tmp_path, text_file):
    config = _gpu_config(tmp_path, text_file)
    training = build_training(config, new_run_dir(config), progress=False)
    training.hooks.append(SyncDebug(LOG_EVERY))
    try:
        training.run()  # raises "called a synchronizing CUDA operation" on a sync between logs
    finally:
        torch.cuda.set_sync_debug_mode("default")
    records = training.monitor.records
    assert [r["step"] for r in records] == list(range(LOG_EVERY, MAX_STEPS + 1, LOG_EVERY))
    assert all(r["mem_peak_gib"] >= r["mem_allocated_gib"] > 0 for r in records)
    assert all(r["tflops"] > 0 for r in records)
    if lookup_peak(torch.cuda.get_device_name()) is not None:
        assert all(0 < r["mfu"] < 1 for r in records)
    else:
        assert all("mfu" not in r for r in records)  # unknown GPU: left out, not an error


def test_memory_probe_tracks_allocations():
    probe = MemoryProbe(torch.device("cuda"))
    before = probe()
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 0.25 GiB
    after = probe()
    assert after["mem_allocated_gib"] - before["mem_allocated_gib"] == pytest.approx(0.25, abs=0.01)
    assert (
        after["mem_peak_gib"] >= after["mem_allocated_gib"]
        and after["mem_reserved_gib"] >= after["mem_allocated_gib"]
    )
    del x


def test_nvml_sampler_reads_utilisation_on_a_background_thread():
    sampler = NvmlSampler(torch.cuda.current_device(), period_s=0.05)
    if not sampler.available:
        pytest.skip("NVML not available on this GPU machine")
    sampler.start()
    a = torch.randn(4096, 4096, device="cuda")
    end = time.time() + 0.5
    while time.time() < end:
        a = a @ a
        a = a / a.norm()
    torch.cuda.synchronize()
    sampler.close()
    record = sampler()
    assert 0 <= record["gpu_util_pct"] <= 100 and record["gpu_temp_c"] > 0
    assert sampler._thread is None  # stopped


def test_flop_counter_matches_the_gpt_formula_on_cuda_kernels():
    model = GPT(GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=128, block_size=128)).cuda()
    x = torch.randint(0, 256, (2, 128), device="cuda")
    counted = count_flops_per_sample(
        model, (x, x), autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    )
    formula = model.flops_per_token(128) * 128
    assert counted == pytest.approx(formula, rel=0.05)


def test_doctor_probes_report_beside_the_datasheet():
    results = {r.name: r for r in run_probes("cuda", quick=True)}
    assert results["matmul fp32"].value > 0 and results["device copy"].value > 0
    spec = lookup_peak(torch.cuda.get_device_name())
    if spec is not None:
        assert results["device copy"].datasheet == spec.mem_bandwidth_gbs


def test_start_line_host_memory_and_the_low_utilisation_warning_on_a_real_gpu(caplog):
    """Issue 37 item 5 on a GPU: the start line names the GPU and its sm_XY; records carry
    host_rss_gib beside the GPU memory; a loop that mostly sleeps (the GPU idle) warns once,
    naming `turbotrain profile`, once its low windows add up to util_warn_s."""
    import logging

    from turbotrain import Engine, fit
    from turbotrain.loop.monitor import Monitor, UtilisationWatch, build_probes

    engine = Engine({"run": {"device": "cuda"}, "compile": {"scope": "off"}})
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [torch.randn(8, 64) for _ in range(40)]
    model, optimizer, loader = engine.setup(model, optimizer, batches)

    def slow(batches):  # the GPU waits on the host: ~0 % utilisation
        for b in batches:
            time.sleep(0.05)
            yield b

    probes = [
        p for p in build_probes(engine.device, nvml_enabled=True) if not isinstance(p, UtilisationWatch)
    ]
    if not any(isinstance(p, NvmlSampler) for p in probes):
        pytest.skip("NVML not available on this GPU machine")
    monitor = Monitor(4, probes=[*probes, UtilisationWatch(80, after_s=0.5)])
    with caplog.at_level(logging.INFO, logger="turbotrain.loop.monitor"):
        fit(
            engine,
            model,
            optimizer,
            slow(loader),
            max_steps=40,
            loss_fn=lambda m, b: m(b).square().mean(),
            hooks=[monitor],
        )
    lines = [r.getMessage() for r in caplog.records]
    start = next(line for line in lines if line.startswith("device "))
    assert torch.cuda.get_device_name() in start and ", sm_" in start and "compile off" in start
    assert all(r["host_rss_gib"] > 0.1 and "mem_allocated_gib" in r for r in monitor.records if "loss" in r)
    assert sum("gpu_util_warning" in r for r in monitor.records) == 1
    assert any("`turbotrain profile`" in line for line in lines)


def test_hfu_counts_the_recomputation_of_a_checkpointed_gpt_on_cuda():
    """Issue 35 item 5 on CUDA kernels: with full activation checkpointing the recomputed forward
    is counted apart (the model FLOPs stay the formula's; recompute ~ a third of them)."""
    from turbotrain.core.transforms import apply_activation_checkpointing
    from turbotrain.loop.monitor import estimate_flops

    model = GPT(GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=128, block_size=128)).cuda()
    apply_activation_checkpointing(model, "full")
    x = torch.randint(0, 256, (2, 128), device="cuda")
    found = estimate_flops(model, (x, x), autocast=lambda: torch.autocast("cuda", dtype=torch.bfloat16))
    assert found.model == model.flops_per_token(128) * 128
    assert 0.15 * found.model < found.recompute < 0.40 * found.model
