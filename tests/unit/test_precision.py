import pytest
import torch

from turbotrain import Engine
from turbotrain.base.errors import ConfigError
from turbotrain.core.precision import DeviceCaps, build_precision, fallback_mode, resolve_precision

V100 = DeviceCaps("cuda", (7, 0), bf16=False)
T4 = DeviceCaps("cuda", (7, 5), bf16=False)
A100 = DeviceCaps("cuda", (8, 0), bf16=True)
H100 = DeviceCaps("cuda", (9, 0), bf16=True)
CPU = DeviceCaps("cpu")


@pytest.mark.parametrize(
    "caps, expected",
    [(V100, "fp16-mixed"), (T4, "fp16-mixed"), (A100, "bf16-mixed"), (H100, "bf16-mixed"), (CPU, "fp32")],
)
def test_auto_picks_by_device_capability(caps, expected):
    assert resolve_precision("auto", caps) == expected


def test_fp16_on_cpu_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="fp32"):
        resolve_precision("fp16-mixed", CPU)


def test_bf16_on_a_gpu_without_it_is_refused():
    with pytest.raises(ConfigError, match="fp16-mixed"):
        resolve_precision("bf16-mixed", V100)


def test_bf16_on_cpu_warns_that_it_is_slow():
    with pytest.warns(UserWarning, match="slower"):
        resolve_precision("bf16-mixed", CPU)


def test_fallback_order():
    assert fallback_mode("fp16-mixed", A100) == "bf16-mixed"
    assert fallback_mode("fp16-mixed", V100) == "fp32"
    assert fallback_mode("bf16-mixed", A100) == "fp32"
    assert fallback_mode("fp32", A100) is None


@pytest.mark.parametrize("mode", ["fp32", "bf16-mixed", "bf16-true"])
def test_no_grad_scaler_outside_fp16(mode):
    with pytest.warns(UserWarning) if mode.startswith("bf16") else _nothing():
        p = build_precision(mode, torch.device("cpu"), CPU)
    assert p.scaler is None
    assert p.scale_loss(torch.tensor(2.0)).item() == 2.0


def test_fp16_has_a_grad_scaler():
    p = build_precision("fp16-mixed", torch.device("cpu"), H100)  # resolution mocked as a GPU
    assert isinstance(p.scaler, torch.amp.GradScaler)


def test_autocast_is_active_in_training_and_evaluation():
    seen = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, y):
            seen.append((self.training, torch.is_autocast_enabled("cpu"), self.lin(x).dtype))
            return self.lin(x).float().pow(2).mean()

    with pytest.warns(UserWarning):
        engine = Engine({"run": {"device": "cpu"}, "precision": {"mode": "bf16-mixed"}})
    model = Probe()
    opt = torch.optim.AdamW(model.parameters())
    model, opt, _ = engine.setup(model, opt)
    batch = (torch.randn(2, 4), torch.zeros(2))
    engine.forward_backward(model, batch)
    engine.evaluate(model, [batch])
    assert seen == [(True, True, torch.bfloat16), (False, True, torch.bfloat16)]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_cpu_engine_flushes_denormals_unless_told_not_to():
    try:
        Engine({"run": {"device": "cpu"}})
        assert torch.tensor(1e-40, dtype=torch.float32).item() == 0.0
        Engine({"run": {"device": "cpu"}, "precision": {"flush_denormal": False}})
        assert torch.tensor(1e-40, dtype=torch.float32).item() != 0.0
    finally:
        torch.set_flush_denormal(False)


def test_bf16_true_casts_float_inputs_to_the_weights_and_leaves_ids_alone():
    seen = []

    class Regressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x, ids, y=None):
            seen.append((x.dtype, ids.dtype, y.dtype))
            return torch.nn.functional.mse_loss(self.lin(x).squeeze(-1) + ids, y)

    with pytest.warns(UserWarning, match="bf16-true"):
        engine = Engine({"run": {"device": "cpu"}, "precision": {"mode": "bf16-true"}})
    model = Regressor()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, _ = engine.setup(model, opt)
    batch = {"x": torch.randn(8, 4), "ids": torch.zeros(8, dtype=torch.long), "y": torch.randn(8)}
    before = model.lin.weight.detach().clone()
    engine.forward_backward(model, batch)
    # a float32 batch trains bf16 weights
    assert engine.step(opt) and not torch.equal(model.lin.weight, before)
    assert isinstance(engine.evaluate(model, [batch]), float)
    assert seen == [(torch.bfloat16, torch.long, torch.bfloat16)] * 2
    engine.switch_precision("fp32", opt)  # a fallback: the weights go back to fp32, and so do the inputs
    engine.forward_backward(model, batch)
    assert seen[-1] == (torch.float32, torch.long, torch.float32)
