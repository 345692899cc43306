"""Monitoring probes: FLOP counting and MFU, NVML sampling, memory, sinks, progress line."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
import time

import pytest
import torch
from torch import nn

from turbotrain import Engine, fit
from turbotrain.base.errors import TurbotrainError
from turbotrain.loop.epochs import EpochLog
from turbotrain.loop.hooks import Evaluate, FitContext
from turbotrain.loop.monitor import (
    HostMemoryProbe,
    JsonlSink,
    MemoryProbe,
    MfuProbe,
    Monitor,
    NvmlSampler,
    TensorBoardSink,
    UtilisationWatch,
    build_probes,
    count_flops_per_sample,
    estimate_flops_per_sample,
    format_record,
)
from turbotrain.parts.hardware import DeviceSpec, lookup_peak
from turbotrain.parts.models.gpt import GPT, GPTConfig
from turbotrain.parts.models.mlp import TinyMLP, synthetic_batches

SPEC = DeviceSpec(
    "test GPU",
    bf16_tflops=100.0,
    fp16_tflops=100.0,
    tf32_tflops=50.0,
    fp32_tflops=10.0,
    fp8_tflops=None,
    mem_bandwidth_gbs=1000.0,
)


@pytest.mark.slow
def test_flop_counter_mfu_agrees_with_the_gpt_formula_within_5_percent():
    model = GPT(GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=128, block_size=128))
    x = torch.randint(0, 256, (2, 128))
    counted = count_flops_per_sample(model, (x, x))
    formula, source = estimate_flops_per_sample(model, (x, x))
    assert "flops_per_token" in source and formula == model.flops_per_token(128) * 128
    record = {"samples_per_s": 500.0, "precision": "bf16-mixed"}
    mfu_counted = MfuProbe(counted, SPEC)(record)["mfu"]
    mfu_formula = MfuProbe(formula, SPEC)(record)["mfu"]
    assert mfu_counted == pytest.approx(mfu_formula, rel=0.05)
    assert mfu_counted != pytest.approx(mfu_formula, rel=1e-6)  # really counted, not the formula again


def test_flop_counter_is_exact_for_an_mlp():
    model = TinyMLP(d_in=256, width=256, depth=3, classes=10)
    batch = synthetic_batches(1, batch_size=8)[0]
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    # 2 FLOPs per multiply-add: forward 2W, backward 4W, minus the input gradient of the first layer
    # (the data needs none).
    assert count_flops_per_sample(model, batch) == 6 * weights - 2 * 256 * 256


def test_counting_flops_leaves_the_model_untouched():
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 2))
    model.train()
    x, y = torch.randn(4, 8) + 3.0, torch.randint(0, 2, (4,))
    stats = model[1].running_mean.clone()
    rng = torch.get_rng_state()
    flops = count_flops_per_sample(
        model, (x, y), loss_fn=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])
    )
    assert flops > 0
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(model[1].running_mean, stats) and torch.equal(torch.get_rng_state(), rng)


def _ctx(rate: float, precision: str = "bf16-mixed") -> dict:
    return {"samples_per_s": rate, "precision": precision}  # the record a probe is given


def test_mfu_uses_the_peak_of_the_precision_in_use_and_is_left_out_without_a_peak():
    probe = MfuProbe(flops_per_sample=1e9, spec=SPEC)
    assert probe(_ctx(25_000)) == pytest.approx({"tflops": 25.0, "mfu": 0.25})  # 25 of 100 TFLOP/s bf16
    assert probe(_ctx(25_000, "fp32"))["mfu"] == pytest.approx(2.5)  # fp32 peak 10 (TF32 off on CPU)
    assert MfuProbe(1e9, spec=None)(_ctx(25_000)) == pytest.approx({"tflops": 25.0})
    assert MfuProbe(1e9, spec=SPEC)(_ctx(0)) == {}  # no timed window yet


def test_tflops_and_mfu_stay_steady_across_token_batches_of_different_row_counts():
    # data.batching=tokens: batches hold about the same tokens but 4 or 16 rows; the compute per
    # second follows tokens/s, not samples/s.
    model = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=2, d_model=32, block_size=64))
    example = (torch.randint(0, 64, (4, 64)), torch.randint(0, 64, (4, 64)))
    probe = build_probes(torch.device("cpu"), model=model, example_batch=example)[-1]
    probe.spec = SPEC
    # 4 x 64
    long_rows = probe({"samples_per_s": 4_000.0, "tokens_per_s": 256_000.0, "precision": "bf16-mixed"})
    # 16 x 16
    short_rows = probe({"samples_per_s": 16_000.0, "tokens_per_s": 256_000.0, "precision": "bf16-mixed"})
    assert short_rows["tflops"] == pytest.approx(long_rows["tflops"])
    assert short_rows["mfu"] == pytest.approx(long_rows["mfu"])
    # fixed windows (every sample 64 tokens): the same figure as samples/s x FLOPs per sample
    assert long_rows["tflops"] == pytest.approx(4_000.0 * probe.flops_per_sample / 1e12)


@pytest.mark.slow
def test_monitor_in_a_fit_records_achieved_tflops_from_the_same_window(tmp_path):
    torch.manual_seed(0)
    engine = Engine({"run": {"device": "cpu"}, "monitor": {"log_every": 5}})
    model = TinyMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = synthetic_batches(20, batch_size=16)
    model, optimizer, loader = engine.setup(model, optimizer, batches)
    probes = build_probes(
        engine.device, model=model, example_batch=batches[0], precision=engine.precision.name
    )
    assert [type(p) for p in probes] == [HostMemoryProbe, MfuProbe]  # CPU: no GPU memory or NVML probe
    monitor = Monitor(5, probes=probes)
    fit(engine, model, optimizer, loader, max_steps=20, hooks=[monitor])
    assert [r["step"] for r in monitor.records] == [5, 10, 15, 20]
    for r in monitor.records:
        assert "mfu" not in r  # a CPU has no datasheet peak
        assert r["tflops"] == pytest.approx(r["samples_per_s"] * probes[1].flops_per_sample / 1e12)


@pytest.mark.slow
def test_monitor_in_your_own_loop(tmp_path):
    engine = Engine({"run": {"device": "cpu"}})
    model = TinyMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # counts samples as it yields
    model, optimizer, loader = engine.setup(model, optimizer, synthetic_batches(12))
    monitor = Monitor(4, sinks=[JsonlSink(tmp_path / "metrics.jsonl")])
    monitor.start()
    for x, y in loader:
        with engine.autocast():
            loss = model(x, y)
        engine.backward(loss)
        if engine.step(optimizer):
            s = engine.state
            monitor.observe(s.step, engine.last_loss, lr=0.1, samples=s.samples, tokens=s.tokens)
    monitor.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [4, 8, 12]
    assert all(json.loads(line)["samples_per_s"] > 0 for line in lines)


def test_a_validation_result_between_logging_steps_gets_its_own_record():
    monitor = Monitor(10)
    monitor.start()
    assert monitor.observe(3, torch.tensor(2.0)) is None  # not a logging step: nothing read
    record = monitor.observe(6, torch.tensor(1.5), val_loss=1.75, val_metrics={"val_accuracy": 0.5})
    assert record is not None and (
        record["step"],
        record["loss"],
        record["val_loss"],
        record["val_accuracy"],
    ) == (6, 1.5, 1.75, 0.5)
    assert "val 1.7500 | accuracy 0.5" in format_record(record)  # the progress line shows it


def test_fit_records_every_evaluation_whatever_log_every():
    engine = Engine({"run": {"device": "cpu"}})
    model = TinyMLP(d_in=8, width=8, depth=1)
    model, optimizer, loader = engine.setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), synthetic_batches(12, 4, d_in=8)
    )
    monitor = Monitor(5)
    fit(
        engine,
        model,
        optimizer,
        loader,
        max_steps=12,
        hooks=[Evaluate(synthetic_batches(2, 4, d_in=8), 4), monitor],
    )
    assert [(r["step"], "val_loss" in r) for r in monitor.records] == [
        (4, True),
        (5, False),
        (8, True),
        (10, False),
        (12, True),
    ]


@pytest.mark.slow
def test_a_crashed_fit_keeps_its_metrics_even_between_flushes(tmp_path):
    from turbotrain.loop.hooks import Hook

    class Crash(Hook):
        def on_step_end(self, ctx: FitContext) -> None:
            if ctx.engine.state.step == 9:
                raise RuntimeError("boom")

    engine = Engine({"run": {"device": "cpu"}})
    model = TinyMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = engine.setup(model, optimizer, synthetic_batches(20))
    sink = JsonlSink(tmp_path / "metrics.jsonl", flush_every_s=3600)  # buffered: only close flushes
    with pytest.raises(RuntimeError, match="boom"):
        fit(engine, model, optimizer, loader, max_steps=20, hooks=[Monitor(4, sinks=[sink]), Crash()])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [4, 8]


def test_a_hook_failing_at_the_end_still_lets_the_monitor_close_its_metrics(tmp_path):
    from turbotrain.loop.hooks import Hook

    class FailAtEnd(Hook):  # e.g. a final evaluation that runs out of memory
        def on_fit_end(self, ctx: FitContext) -> None:
            raise RuntimeError("final eval failed")

        def on_exception(self, ctx: FitContext, exc: BaseException) -> None:
            raise ValueError("and so did its cleanup")  # must not keep the Monitor from closing

    engine = Engine({"run": {"device": "cpu"}})
    model = TinyMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = engine.setup(model, optimizer, synthetic_batches(20))
    sink = JsonlSink(tmp_path / "metrics.jsonl", flush_every_s=3600)
    with pytest.raises(RuntimeError, match="final eval failed"):
        fit(engine, model, optimizer, loader, max_steps=8, hooks=[FailAtEnd(), Monitor(4, sinks=[sink])])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [4, 8]


class _FakeNvml(NvmlSampler):
    def __init__(self) -> None:
        super().__init__(period_s=0.01)
        self.available = True
        self.readings = iter(
            [
                {"gpu_util_pct": 90, "gpu_temp_c": 60, "gpu_power_w": 300.0},
                {"gpu_util_pct": 100, "gpu_temp_c": 65, "gpu_power_w": 500.0},
            ]
        )

    def sample(self):
        return next(self.readings, {})


def test_nvml_sampler_averages_the_window_on_a_background_thread():
    sampler = _FakeNvml()
    sampler.start()
    deadline = time.time() + 2
    while time.time() < deadline and len(sampler._samples) < 2:
        time.sleep(0.01)
    sampler.close()
    assert sampler._thread is None
    assert sampler() == {"gpu_util_pct": 95, "gpu_power_w": 400.0, "gpu_temp_c": 65}  # temperature: max


def test_monitor_starts_and_closes_probe_threads():
    sampler = _FakeNvml()
    engine = Engine({"run": {"device": "cpu"}})
    model = TinyMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = engine.setup(model, optimizer, synthetic_batches(4))
    fit(engine, model, optimizer, loader, max_steps=4, hooks=[Monitor(2, probes=[sampler])])
    assert sampler._thread is None and sampler._stop.is_set()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_without_a_gpu_nvml_and_memory_are_simply_absent():
    assert NvmlSampler().available is False and NvmlSampler()() == {}
    assert [type(p) for p in build_probes(torch.device("cpu"))] == [HostMemoryProbe]  # host RSS only
    assert lookup_peak("cpu") is None


def test_tensorboard_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    with pytest.raises(TurbotrainError, match="pip install tensorboard"):
        TensorBoardSink(tmp_path / "tb")


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_sink_writes_event_files(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    sink.write({"step": 1, "loss": 2.0, "tokens_per_s": 10.0, "note": "x"})
    sink.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_progress_line_shows_loss_throughput_mfu_memory_and_gpu():
    line = format_record(
        {
            "step": 10,
            "loss": 2.5,
            "tokens_per_s": 123456.0,
            "mfu": 0.4123,
            "mem_peak_gib": 12.345,
            "gpu_util_pct": 97.0,
        }
    )
    assert line == "loss 2.5000 | 123,456 tok/s | MFU 41.2% | peak 12.35 GiB | GPU 97%"
    assert "TFLOP/s" in format_record({"step": 1, "loss": 1.0, "tflops": 0.002})  # CPU: no MFU, show compute


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_probe_keys():
    assert set(MemoryProbe(torch.device("cuda"))()) == {
        "mem_allocated_gib",
        "mem_reserved_gib",
        "mem_peak_gib",
    }


# ----------------------------------------------------------------------------- memory interval and warning

GIB = 2**30


class _FakeAllocator:
    """Allocator counters a test sets (bytes): what a CUDA device would report, without one."""

    def __init__(self, reserved: float = 1 * GIB) -> None:
        self.reserved = reserved

    def __call__(self) -> dict[str, int]:
        r = int(self.reserved)
        return {"allocated": r // 2, "reserved": r, "peak": r // 2, "peak_reserved": r}


class _CountedLoss:
    """A loss whose reads (host-device syncs on a GPU) are counted."""

    def __init__(self) -> None:
        self.reads = 0

    def __float__(self) -> float:
        self.reads += 1
        return 1.0


def _records_with_memory_every(every, tmp_path):
    path = tmp_path / f"metrics_{every}.jsonl"
    probe = MemoryProbe(torch.device("cuda", 0), every=every, limit_bytes=80 * GIB, read=_FakeAllocator())
    monitor, loss = Monitor(4, [JsonlSink(path)], [probe]), _CountedLoss()
    monitor.start()
    for step in range(1, 13):
        monitor.observe(step, loss, samples=step)
    monitor.close()
    return [json.loads(line) for line in path.read_text().splitlines()], loss.reads


def test_memory_every_is_its_own_interval_and_zero_logs_no_memory(tmp_path):
    records, reads = _records_with_memory_every(3, tmp_path)
    assert [(r["step"], "loss" in r, "mem_peak_gib" in r) for r in records] == [
        (3, False, True),
        (4, True, False),
        (6, False, True),
        (8, True, False),
        (9, False, True),
        (12, True, True),
    ]
    assert reads == 3  # memory-only records read no loss: no host-device sync
    records, _ = _records_with_memory_every(0, tmp_path)
    assert [r["step"] for r in records] == [4, 8, 12] and not any(
        k.startswith("mem_") for r in records for k in r
    )
    # monitor.memory_every = -1: in each record, as before
    records, _ = _records_with_memory_every(None, tmp_path)
    assert [r["step"] for r in records] == [4, 8, 12] and all(r["mem_peak_gib"] == 0.5 for r in records)


def test_memory_warning_fires_once_when_the_peak_crosses_the_fraction(tmp_path, caplog):
    fake = _FakeAllocator()
    probe = MemoryProbe(torch.device("cuda", 0), every=0, warn_fraction=0.9, limit_bytes=10 * GIB, read=fake)
    engine = Engine({"run": {"device": "cpu"}})
    monitor = Monitor(1, [JsonlSink(tmp_path / "metrics.jsonl")], [probe])
    ctx = FitContext(engine, nn.Linear(1, 1), None, max_steps=6)
    monitor.on_fit_start(ctx)
    with caplog.at_level(logging.WARNING, logger="turbotrain.loop.monitor"):
        for step, gib_used in enumerate([5, 8.9, 9.0, 9.6, 3, 9.9], 1):
            engine.state.step, fake.reserved = step, gib_used * GIB
            monitor.on_step_end(ctx)
    monitor.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    warned = [r["step"] for r in records if "memory_warning" in r]
    logged = [r.getMessage() for r in caplog.records if "GPU memory is high" in r.getMessage()]
    assert warned == [3] and len(logged) == 1 and "9.00 GiB is 90% of the device's 10.00 GiB" in logged[0]
    assert [(e.step, e.kind) for e in engine.events] == [(3, "memory_warning")]  # summary.json's events
    assert not any("mem_peak_gib" in r for r in records)  # memory_every 0: the warning still watches


def test_memory_warning_is_against_the_cap_when_one_is_set(monkeypatch):
    monkeypatch.setattr("turbotrain.loop.monitor.memory.device_total_bytes", lambda device: 80 * GIB)
    fake = _FakeAllocator(reserved=36 * GIB)  # 45% of the device, 90% of a 0.5 cap
    probe = MemoryProbe(torch.device("cuda", 0), warn_fraction=0.9, cap_fraction=0.5, read=fake)
    assert "of the cap (0.5 of the device) 40.00 GiB" in probe({"step": 1})["memory_warning"]
    assert (
        MemoryProbe(torch.device("cuda", 0), warn_fraction=0.9, read=fake)({"step": 1}).get("memory_warning")
        is None
    )


def test_memory_probe_reset_peak_restarts_the_device_peaks(monkeypatch):
    reset = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset.append)
    MemoryProbe(torch.device("cuda", 1), limit_bytes=GIB, read=_FakeAllocator()).reset_peak()
    assert reset == [torch.device("cuda", 1)]


def test_fit_with_memory_records_between_ends_on_a_loss_record():
    probe = MemoryProbe(torch.device("cuda", 0), every=3, limit_bytes=80 * GIB, read=_FakeAllocator())
    engine = Engine({"run": {"device": "cpu"}})
    model = TinyMLP(d_in=8, width=8, depth=1)
    model, optimizer, loader = engine.setup(
        model, torch.optim.SGD(model.parameters(), lr=0.1), synthetic_batches(12, 4, d_in=8)
    )
    monitor = Monitor(5, probes=[probe])
    fit(engine, model, optimizer, loader, max_steps=12, hooks=[monitor])
    assert [(r["step"], "loss" in r, "mem_peak_gib" in r) for r in monitor.records] == [
        (3, False, True),
        (5, True, False),
        (6, False, True),
        (9, False, True),
        (10, True, False),
        (12, True, True),
    ]


class _Steps:
    """Just what EpochLog reads of a fit: the step and its loss."""

    def __init__(self) -> None:
        self.engine = type("E", (), {})()
        self.engine.state = type("S", (), {"step": 0})()
        self.metrics: dict = {}

    def step(self, loss: float) -> None:
        self.engine.state.step += 1
        self.engine.last_loss = torch.tensor(loss)


def test_epoch_train_loss_is_the_mean_of_its_finite_steps():
    monitor = Monitor(10)
    log, ctx = EpochLog(monitor, steps_per_epoch=3, epochs=2), _Steps()
    for loss in (1.0, 2.0, 6.0, 4.0, float("nan"), 2.0):  # a non-finite (skipped) step is not averaged in
        ctx.step(loss)
        log.on_step_end(ctx)
    assert [(r["epoch"], r["epoch_train_loss"]) for r in monitor.records] == [(1, 3.0), (2, 3.0)]


def _fit_cpu(monitor: Monitor, steps: int = 6) -> Engine:
    engine = Engine({"run": {"device": "cpu"}})
    model = TinyMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = engine.setup(model, optimizer, synthetic_batches(steps))
    fit(engine, model, optimizer, loader, max_steps=steps, hooks=[monitor])
    return engine


def test_a_run_says_its_device_precision_and_compile_when_it_starts(caplog):
    with caplog.at_level(logging.INFO, logger="turbotrain.loop.monitor"):
        _fit_cpu(Monitor(2), steps=2)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training ")]
    # one opening line: parameters, device, precision, compile, steps (#47 item 1)
    assert line.startswith("training 199,946 params: device cpu (") and "cores" in line and "GiB RAM" in line
    assert line.endswith("; precision fp32; compile off; 2 steps")


def test_each_record_has_the_host_memory_beside_the_gpu_memory():
    monitor = Monitor(2, probes=build_probes(torch.device("cpu")))
    _fit_cpu(monitor, steps=4)
    rss = [r["host_rss_gib"] for r in monitor.records]
    assert len(rss) == 2 and all(0.05 < x < 1024 for x in rss)  # this Python process: tens of MiB to GiB
    assert HostMemoryProbe(read=lambda: 3 * 2**30)() == {"host_rss_gib": 3.0}
    assert HostMemoryProbe(read=lambda: None)() == {}  # an OS without /proc: nothing


class _StandInNvml:
    """An NVML probe on CPU: the utilisation of each logging window, from a list."""

    def __init__(self, utils: list[float]) -> None:
        self.utils = iter(utils)

    def __call__(self, record: dict) -> dict:
        return {"gpu_util_pct": next(self.utils)}


@pytest.mark.slow
def test_gpu_utilisation_low_for_a_while_warns_once_naming_profile(monkeypatch, caplog):
    clock = iter(range(0, 10_000, 60))  # every clock read is 60 s later: one read per 2-step window
    monkeypatch.setattr(
        "turbotrain.loop.monitor.hook.time",
        type("T", (), {"perf_counter": staticmethod(lambda: next(clock))}),
    )
    # windows: warm-up (skipped), low, high (starts over), then low x3: 2 x 60 s under 80 % reach 120 s
    nvml = _StandInNvml([10, 30, 95, 40, 50, 20, 10])
    monitor = Monitor(2, probes=[nvml, UtilisationWatch(80, after_s=120)])
    with caplog.at_level(logging.WARNING, logger="turbotrain.loop.monitor"):
        engine = _fit_cpu(monitor, steps=14)
    warned = [r["step"] for r in monitor.records if "gpu_util_warning" in r]
    assert warned == [10]  # the second low window after the high one: 120 s under the threshold
    (text,) = [r.getMessage() for r in caplog.records if "GPU utilisation" in r.getMessage()]
    assert "under 80 % for 120 s (median 45 %" in text and "`turbotrain profile`" in text
    assert [(e.step, e.kind) for e in engine.events] == [(10, "gpu_util_warning")]  # summary.json's events
