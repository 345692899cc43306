import copy
import logging

import pytest
import torch

from turbotrain import Engine
from turbotrain.base.errors import NonFiniteError, PlacementError
from turbotrain.core.precision import FP16Mixed, HostNonFiniteGuard, NonFiniteGuard
from turbotrain.parts.models.mlp import TinyMLP, synthetic_batches


def _engine(**sections) -> Engine:
    base = {"run": {"device": "cpu"}, "optim": {"grad_clip": 0.0}, "monitor": {"log_every": 1}}
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    return Engine(base)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_k_accumulated_micro_batches_equal_one_k_times_batch():
    torch.manual_seed(0)
    ref = TinyMLP(d_in=16, width=32, depth=2)
    acc = copy.deepcopy(ref)
    ((x, y),) = synthetic_batches(1, batch_size=32, d_in=16)

    ref(x, y).backward()  # one batch of 32

    k = 4
    engine = _engine(batch={"accumulation": k})
    opt = torch.optim.SGD(acc.parameters(), lr=0.0)
    acc, opt, _ = engine.setup(acc, opt)
    seen = []
    for xs, ys in zip(x.chunk(k), y.chunk(k)):
        with engine.autocast():
            loss = acc(xs, ys)
        engine.backward(loss)
        if engine.state.micro_step < k:
            assert engine.step(opt) is False  # not on the boundary: gradients keep accumulating
        seen = _grads(acc)
    for g_ref, g_acc in zip(_grads(ref), seen):
        torch.testing.assert_close(g_acc, g_ref, atol=1e-5, rtol=1e-5)
    assert engine.step(opt) is True
    assert all(p.grad is None for p in acc.parameters())  # zero_grad(set_to_none=True)
    assert (engine.state.step, engine.state.micro_step) == (1, k)


def test_clipping_sees_unscaled_gradients(monkeypatch):
    torch.manual_seed(0)
    model = TinyMLP(d_in=8, width=8, depth=1)
    ((x, y),) = synthetic_batches(1, batch_size=8, d_in=8)
    model(x, y).backward()
    true_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    model.zero_grad()

    engine = _engine(optim={"grad_clip": 1e9})
    engine.precision = FP16Mixed(torch.device("cpu"))  # loss scaling, as on a GPU
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt, _ = engine.setup(model, opt)
    seen = []
    real = torch.nn.utils.clip_grads_with_norm_

    def spy(params, max_norm, total_norm, **kw):
        params = list(params)
        seen.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
        return real(params, max_norm, total_norm, **kw)

    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", spy)
    engine.backward(model(x, y))
    assert engine.precision.scaler.get_scale() > 1000  # gradients really were scaled
    engine.step(opt)
    torch.testing.assert_close(seen[0], true_norm, rtol=1e-3, atol=1e-6)


def test_non_finite_loss_is_skipped_then_falls_back(caplog):
    torch.manual_seed(0)
    model = TinyMLP(d_in=8, width=8, depth=1)
    with pytest.warns(UserWarning):
        engine = _engine(
            precision={"mode": "bf16-mixed", "max_nonfinite_steps": 2, "nonfinite": "fallback"},
            optim={"grad_clip": 1.0},
        )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    model, opt, _ = engine.setup(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    ((x, y),) = synthetic_batches(1, batch_size=8, d_in=8)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            with engine.autocast():
                loss = model(x, y) * float("nan")
            engine.backward(loss)
            engine.step(opt)
            for b, p in zip(before, model.parameters()):
                assert torch.equal(b, p), "a non-finite step must not change the weights"
    assert engine.precision.name == "fp32"
    assert [e.kind for e in engine.events] == ["precision_fallback"]
    assert "bf16-mixed -> fp32" in engine.events[0].detail
    # training goes on in the new precision
    engine.backward(model(x, y))
    engine.step(opt)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_fp16_gradient_overflow_is_left_to_the_grad_scaler():
    """A scaled-gradient overflow is routine under fp16 (the scaler skips and lowers the scale):
    it must not count as a non-finite step, or fp16 runs fall back after a few growth intervals."""
    torch.manual_seed(0)
    model = TinyMLP(d_in=8, width=8, depth=1)
    engine = _engine(precision={"max_nonfinite_steps": 1}, optim={"grad_clip": 1.0}, monitor={"log_every": 1})
    engine.precision = FP16Mixed(torch.device("cpu"))
    engine.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # scaled gradients overflow
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = engine.setup(model, opt)
    ((x, y),) = synthetic_batches(1, batch_size=8, d_in=8)
    engine.backward(model(x, y) * 1e4)  # a finite loss, gradients beyond fp32 once scaled
    engine.step(opt)
    assert engine.precision.scaler.get_scale() < 2.0**127  # the scaler saw the overflow and backed off
    assert engine.guard.poll() == 0 and engine.precision.name == "fp16-mixed" and not engine.events


def test_stop_policy_raises_a_clear_error():
    model = TinyMLP(d_in=8, width=8, depth=1)
    engine = _engine(precision={"nonfinite": "stop", "max_nonfinite_steps": 1})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = engine.setup(model, opt)
    ((x, y),) = synthetic_batches(1, batch_size=8, d_in=8)
    engine.backward(model(x, y) * float("inf"))
    with pytest.raises(NonFiniteError, match="non-finite"):
        engine.step(opt)


def test_placement_check_names_the_stray_tensor():
    model = TinyMLP(d_in=8, width=8, depth=1)
    engine = _engine()
    model, opt, _ = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.device = torch.device("meta")  # pretend the engine runs elsewhere
    ((x, y),) = synthetic_batches(1, batch_size=8, d_in=8)
    with pytest.raises(PlacementError, match=r"body\.0\.weight"):
        engine.backward(model(x, y))


def test_loader_batches_arrive_and_state_counts_samples():
    model = TinyMLP(d_in=8, width=8, depth=1)
    engine = _engine(batch={"accumulation": 2})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = engine.setup(model, opt, synthetic_batches(4, batch_size=8, d_in=8))
    steps = 0
    for batch in loader:
        engine.forward_backward(model, batch)
        steps += engine.step(opt)
    assert steps == 2
    assert (engine.state.step, engine.state.micro_step, engine.state.batches, engine.state.samples) == (
        2,
        4,
        4,
        32,
    )


@pytest.mark.parametrize("guard", [HostNonFiniteGuard, NonFiniteGuard])
@pytest.mark.parametrize("fused", [False, True])
def test_skip_works_with_host_and_device_guards(guard, fused):
    """CPU uses the host guard; the device guard (CUDA's) skips fused steps inside the kernel."""
    torch.manual_seed(0)
    model = TinyMLP(d_in=8, width=8, depth=1)
    engine = _engine(precision={"nonfinite": "skip"}, optim={"grad_clip": 1.0})
    engine.guard = guard(engine.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    model, opt, _ = engine.setup(model, opt)
    ((x, y),) = synthetic_batches(1, batch_size=8, d_in=8)
    engine.backward(model(x, y))
    engine.step(opt)
    before = [p.detach().clone() for p in model.parameters()]
    state_step = opt.state[next(model.parameters())]["step"].clone()
    engine.backward(model(x, y) * float("nan"))
    engine.step(opt)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    # Adam's bias correction untouched
    assert torch.equal(opt.state[next(model.parameters())]["step"], state_step)
    assert engine.guard.poll() == 1 and engine.state.step == 2
    engine.backward(model(x, y))
    engine.step(opt)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert engine.guard.state_dict() == {"nonfinite_steps": 1}


def test_skip_policy_logs_each_skipped_step_once(caplog):
    model = TinyMLP(d_in=8, width=8, depth=1)
    engine = _engine(precision={"nonfinite": "skip"}, monitor={"log_every": 1})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = engine.setup(model, opt)
    ((x, y),) = synthetic_batches(1, batch_size=8, d_in=8)
    with caplog.at_level(logging.WARNING, logger="turbotrain.core.nonfinite"):
        engine.backward(model(x, y) * float("nan"))
        engine.step(opt)
        for _ in range(3):  # finite steps: polled, nothing new to say
            engine.backward(model(x, y))
            engine.step(opt)
    assert len([r for r in caplog.records if "non-finite" in r.getMessage()]) == 1


def test_resume_keeps_a_fallback_precision_but_not_a_stale_one():
    saved = _engine().state_dict()
    saved["precision_name"] = "bf16-true"  # saved by a run that trained in bf16-true
    engine = _engine()
    engine.load_state_dict(saved)
    assert engine.precision.name == "fp32"  # no fallback happened: the resumed config's own choice stands
    saved["events"] = [{"step": 3, "kind": "precision_fallback", "detail": "fp16-mixed -> bf16-true"}]
    model = TinyMLP(d_in=8, width=8, depth=1)
    engine = _engine()
    engine.setup(model, None)
    with pytest.warns(UserWarning, match="bf16-true"):  # slow on CPU: said once, as for any bf16 choice
        engine.load_state_dict(saved)
    assert engine.precision.name == "bf16-true" and next(model.parameters()).dtype == torch.bfloat16
    assert [e.kind for e in engine.events] == ["precision_fallback"]


def test_clipping_folded_into_a_fused_step_equals_clip_grad_norm():
    """With a fused optimizer the clip factor is applied inside the optimizer kernel (grad_scale)
    instead of a pass over every gradient: the training is the same as clip_grad_norm_ + step."""
    batches = [torch.randn(16, 8, generator=torch.Generator().manual_seed(i)) for i in range(8)]

    def model_and_optimizer():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

    model, optimizer = model_and_optimizer()
    reference = []
    for x in batches:
        loss = model(x).pow(2).mean() * 50  # large gradients: clipping acts on every step
        loss.backward()
        reference.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    engine = _engine(optim={"grad_clip": 0.5})
    folded, fused_opt = model_and_optimizer()
    folded, fused_opt, _ = engine.setup(folded, fused_opt)
    calls = []
    real = torch.nn.utils.clip_grads_with_norm_
    torch.nn.utils.clip_grads_with_norm_ = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        norms = []
        for x in batches:
            engine.backward(folded(x).pow(2).mean() * 50)
            engine.step(fused_opt)
            norms.append(float(engine.last_grad_norm))
    finally:
        torch.nn.utils.clip_grads_with_norm_ = real
    assert not calls  # no separate clipping pass
    assert min(reference) > 0.5 and norms == pytest.approx(reference, rel=1e-6)
    for a, b in zip(model.parameters(), folded.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_clipping_divides_by_the_norm_set_grad_norm_gives():
    """A norm function (expert parallelism's spans every rank's experts) replaces the engine's
    own: clipping divides by it and last_grad_norm reports it; None restores the default."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    x = torch.randn(16, 8)
    model(x).pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    true_norm = torch.nn.utils.get_total_norm(grads)
    model.zero_grad()
    engine = _engine(optim={"grad_clip": 0.1})
    model, optimizer, _ = engine.setup(model, torch.optim.SGD(model.parameters(), lr=0.0))
    seen, stepped = [], []
    engine.set_grad_norm(
        lambda params: seen.append(len(params)) or 2 * torch.nn.utils.get_total_norm([p.grad for p in params])
    )
    optimizer.register_step_pre_hook(
        lambda opt, *_: stepped.append([p.grad.clone() for p in model.parameters()])
    )
    engine.backward(model(x).pow(2).mean())
    engine.step(optimizer)
    assert seen == [2] and true_norm > 0.2  # the function saw the optimizer's parameters; clipping acts
    torch.testing.assert_close(engine.last_grad_norm, 2 * true_norm)
    for got, g in zip(stepped[0], grads):  # divided by the given norm, not the true one
        torch.testing.assert_close(got, g * 0.1 / (2 * true_norm + 1e-6))
    engine.set_grad_norm(None)
    engine.backward(model(x).pow(2).mean())
    engine.step(optimizer)
    torch.testing.assert_close(engine.last_grad_norm, true_norm)


def test_folded_clipping_works_with_bf16_parameters():
    """bf16-true keeps bf16 gradients; the fused kernel takes its grad_scale in fp32."""
    engine = _engine(precision={"mode": "bf16-true"}, optim={"grad_clip": 0.5})
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    model, optimizer, _ = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    before = model.weight.detach().clone()
    engine.backward(model(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).mean() * 100)
    assert engine.step(optimizer) and not torch.equal(model.weight, before)


# ----------------------------------------------------------------------------- memory cap, deterministic mode


def test_memory_cap_is_set_on_cuda_with_the_fraction_given(monkeypatch):
    from turbotrain.core.device import apply_memory_cap

    calls = []
    monkeypatch.setattr(
        torch.cuda,
        "set_per_process_memory_fraction",
        lambda fraction, device=None: calls.append((fraction, device)),
    )
    apply_memory_cap(torch.device("cuda", 1), 0.6)
    apply_memory_cap(torch.device("cuda", 0), 0.0)  # 0 = no cap: nothing set
    assert calls == [(0.6, 1)]


def test_memory_cap_on_cpu_is_one_log_line_and_a_bad_value_names_the_field(monkeypatch, caplog):
    from turbotrain.base.errors import ConfigError

    calls = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda *a, **k: calls.append(a))
    with caplog.at_level(logging.INFO, logger="turbotrain.core.device"):
        _engine(memory={"max_fraction": 0.5})
    said = [r.getMessage() for r in caplog.records if "memory.max_fraction" in r.getMessage()]
    assert calls == [] and len(said) == 1 and "does not apply on cpu" in said[0]
    with pytest.raises(ConfigError) as bad:
        _engine(memory={"max_fraction": 1.5})
    assert (
        "\n" not in str(bad.value)
        and "memory.max_fraction = 1.5" in str(bad.value)
        and "[0, 1]" in str(bad.value)
    )


@pytest.fixture
def restore_determinism(monkeypatch):
    """run.deterministic sets process-wide switches: put them back for the other tests."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")  # absent now, and absent again afterwards
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2:]


def _train_tiny_gpt(device: str = "cpu", steps: int = 4) -> tuple[Engine, list[float]]:
    from turbotrain.parts.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    engine = _engine(run={"device": device, "deterministic": True}, compile={"scope": "off"})
    model = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=2, d_model=32, block_size=16, dropout=0.1))
    g = torch.Generator().manual_seed(1)
    batches = [(x[:, :-1], x[:, 1:]) for x in torch.randint(0, 64, (steps, 4, 17), generator=g)]
    model, optimizer, loader = engine.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches)
    losses = []
    for batch in loader:
        engine.forward_backward(model, batch)
        engine.step(optimizer)
        losses.append(engine.last_loss.item())
    return engine, losses


@pytest.mark.slow
def test_deterministic_mode_sets_the_switches_and_trains_twice_to_identical_losses(
    restore_determinism, caplog
):
    with caplog.at_level(logging.INFO, logger="turbotrain.core.precision"):
        engine, first = _train_tiny_gpt()
    _, second = _train_tiny_gpt()
    assert first == second and len(set(first)) == len(first)  # bit-identical, and it trained (dropout on)
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert not torch.backends.cudnn.benchmark
    import os

    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    # what the summary records
    assert engine.switches == {
        "tf32": False,
        "cudnn_benchmark": False,
        "deterministic": True,
    }
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run.deterministic")]
    assert len(said) == 1 and "CUBLAS_WORKSPACE_CONFIG=:4096:8 (set before CUDA initialised)" in said[0]
    assert "no cuDNN autotuning" in said[0] and "raises an error" in said[0]
