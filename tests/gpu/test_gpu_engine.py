"""GPU checks of the core engine (skipped without CUDA)."""

import pytest
import torch

from turbotrain import Engine
from turbotrain.core.optim import build_optimizer
from turbotrain.parts.data import DevicePrefetcher
from turbotrain.parts.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def _gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=128, block_size=128))


def test_auto_resolves_bf16_fused_and_tf32_on_ampere_or_newer():
    engine = Engine({"compile": {"scope": "off"}})
    cap = torch.cuda.get_device_capability()
    assert engine.precision.name == ("bf16-mixed" if cap >= (8, 0) else "fp16-mixed")
    assert (engine.precision.scaler is None) == (cap >= (8, 0))
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.benchmark
    model = _gpt()
    opt = build_optimizer(model, engine.device, lr=1e-3)
    assert opt.defaults["fused"] is True


def test_training_steps_make_no_host_sync_between_polls():
    engine = Engine({"compile": {"scope": "off"}, "monitor": {"log_every": 1000}})
    model = _gpt()
    opt = build_optimizer(model, engine.device, lr=1e-3)
    model, opt, _ = engine.setup(model, opt)
    x = torch.randint(256, (4, 128), device="cuda")
    engine.forward_backward(model, (x, x))
    engine.step(opt)  # first step: placement check, lazy state init
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            engine.forward_backward(model, (x, x))
            engine.step(opt)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_non_finite_step_is_skipped_on_device_with_fused_adamw():
    engine = Engine(
        {"compile": {"scope": "off"}, "precision": {"mode": "bf16-mixed"}, "monitor": {"log_every": 1000}}
    )
    model = _gpt()
    opt = build_optimizer(model, engine.device, lr=1e-2)
    model, opt, _ = engine.setup(model, opt)
    x = torch.randint(256, (4, 128), device="cuda")
    engine.forward_backward(model, (x, x))
    engine.step(opt)
    before = [p.detach().clone() for p in model.parameters()]
    with engine.autocast():
        loss = model(x, x) * float("nan")
    engine.backward(loss)
    engine.step(opt)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert engine.guard.poll() == 1


def test_prefetcher_delivers_device_batches_in_order():
    host = [(torch.full((2, 3), i).pin_memory(),) for i in range(5)]
    out = [b[0] for b in DevicePrefetcher(host, torch.device("cuda"))]
    assert all(t.is_cuda for t in out)
    assert [int(t[0, 0]) for t in out] == list(range(5))


def test_compiled_model_trains():
    engine = Engine({"compile": {"scope": "model"}})
    model = _gpt()
    opt = build_optimizer(model, engine.device, lr=3e-3)
    model, opt, _ = engine.setup(model, opt)
    x = torch.randint(256, (8, 128), device="cuda")
    first = None
    for _ in range(20):
        engine.forward_backward(model, (x, x))
        engine.step(opt)
        first = first if first is not None else engine.last_loss.item()
    assert engine.last_loss.item() < first
