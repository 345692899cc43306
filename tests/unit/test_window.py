"""The step as one window body (core/window.py), run by the strategy and wrapped once.

Issue 33, item 1: one optimizer step's tensor work is one function of tensors; the Engine's
``train_window`` runs it (through a whole-step wrapper when one is set: where CUDA graphs go), and
trains exactly as the own-loop pieces (``forward_backward`` per batch, then ``step``) that ``fit``
calls. On CPU in fp32 every comparison here is bit-exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from faults.oom import inject_oom
from torch.utils._python_dispatch import TorchDispatchMode

from turbotrain import Engine
from turbotrain.core.distributed import Strategy
from turbotrain.core.precision import NonFiniteGuard
from turbotrain.core.window import LossFn, MicroBatch, Window, WindowFn
from turbotrain.loop.fit import fit
from turbotrain.loop.hooks import Hook
from turbotrain.parts.models.mlp import TinyMLP, synthetic_batches

ACCUMULATION = 2
STEPS = 6


def _engine(**sections: dict[str, Any]) -> Engine:
    base: dict[str, dict[str, Any]] = {
        "run": {"device": "cpu"},
        "batch": {"accumulation": ACCUMULATION},
        "optim": {"grad_clip": 0.5},
        "monitor": {"log_every": 2},
    }
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    return Engine(base)


def _run(
    how: str,
    wrapper: Callable[[WindowFn], WindowFn] | None = None,
    fused: bool = False,
    **sections: dict[str, Any],
) -> tuple[list[float], list[torch.Tensor], Engine]:
    """Train STEPS optimizer steps of a tiny MLP (accumulation 2, clipping on) one way; the
    per-step losses as the engine reports them, the final weights, the engine."""
    torch.manual_seed(0)
    model = TinyMLP(d_in=16, width=32, depth=2)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-2, **({"fused": True} if fused else {"foreach": True})
    )
    engine = _engine(**sections)
    model, optimizer, _ = engine.setup(model, optimizer)
    if wrapper is not None:
        engine.wrap_window(wrapper)
    batches = synthetic_batches(STEPS * ACCUMULATION, batch_size=8, d_in=16)
    losses = []
    for s in range(STEPS):
        window = batches[s * ACCUMULATION : (s + 1) * ACCUMULATION]
        if how == "pieces":  # what fit() and an own loop call
            for batch in window:
                engine.forward_backward(model, batch)
            assert engine.step(optimizer)
        else:
            assert engine.train_window(model, optimizer, window)
        losses.append(float(engine.last_loss))
    return losses, [p.detach().clone() for p in model.parameters()], engine


class CountingWrapper:
    """A stand-in for whole-step capture: wraps the body once, then every step calls through it.
    Like a CUDA graph it feeds the body static input buffers (each step's micro-batches copied
    into the same tensors) and copies the outputs out (a replay overwrites them)."""

    def __init__(self) -> None:
        self.wrapped = 0
        self.calls = 0

    def __call__(self, body: WindowFn) -> WindowFn:
        self.wrapped += 1
        static: list[MicroBatch] = []  # this capture's input buffers

        def captured(
            model: torch.nn.Module,
            optimizer: torch.optim.Optimizer,
            micro_batches: Any,
            loss_fn: LossFn,
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            self.calls += 1
            if not static:
                static.extend((tuple(t.clone() for t in batch), weight) for batch, weight in micro_batches)
            assert len(static) == len(micro_batches)  # a capture's shapes are fixed
            for (buffers, _), (batch, _) in zip(static, micro_batches):
                for buffer, t in zip(buffers, batch):
                    buffer.copy_(t)
            loss_sum, norm = body(model, optimizer, static, loss_fn)
            return loss_sum.clone(), None if norm is None else norm.clone()

        return captured


@pytest.mark.slow
def test_a_window_under_a_whole_step_wrapper_trains_to_the_same_losses_as_without_it():
    pieces, w_pieces, _ = _run("pieces")
    plain, w_plain, _ = _run("window")
    wrapper = CountingWrapper()
    wrapped, w_wrapped, engine = _run("window", wrapper)
    assert pieces == plain == wrapped  # bit-exact, every step
    for a, b, c in zip(w_pieces, w_plain, w_wrapped):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert (wrapper.wrapped, wrapper.calls) == (1, STEPS)  # wrapped once, one call per optimizer step
    assert (engine.state.step, engine.state.micro_step, engine.state.batches) == (
        STEPS,
        STEPS * ACCUMULATION,
        STEPS * ACCUMULATION,
    )
    assert pieces[-1] < pieces[0]  # it trains


def test_train_window_reports_the_same_gradient_norm_as_the_pieces():
    """monitor.grad_norm: the norm over the plan's groups, as the own-loop pieces report it."""
    _, w_pieces, pieces = _run("pieces", monitor={"grad_norm": True})
    _, w_window, window = _run("window", monitor={"grad_norm": True})
    assert torch.equal(pieces.last_grad_norm, window.last_grad_norm)
    for a, b in zip(w_pieces, w_window):
        assert torch.equal(a, b)


class HostReads(TorchDispatchMode):
    """Counts host reads of tensor values (``.item()``, ``bool()``: a sync on an accelerator)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_the_window_body_reads_nothing_on_the_host():
    """What capture needs: with the device guard (as on CUDA) and a fused optimizer, one
    optimizer step's tensor work (forward, backward, clipping, the guard, the step) makes no
    host read; the Engine's bookkeeping around it reads nothing either between its polls."""
    seen = HostReads()

    def watched(body: WindowFn) -> WindowFn:
        def run(*args: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            with seen:
                return body(*args)

        return run

    torch.manual_seed(0)
    model = TinyMLP(d_in=16, width=32, depth=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    engine = _engine(monitor={"log_every": 100})
    engine.guard = NonFiniteGuard(engine.device)  # the on-device guard a GPU run uses
    model, optimizer, _ = engine.setup(model, optimizer)
    engine.wrap_window(watched)
    batches = synthetic_batches(ACCUMULATION * 3, batch_size=8, d_in=16)
    for s in range(3):
        engine.train_window(model, optimizer, batches[s * ACCUMULATION : (s + 1) * ACCUMULATION])
    assert engine.state.step == 3 and seen.reads == 0


def test_train_window_refuses_a_window_of_the_wrong_size_and_a_pending_step():
    torch.manual_seed(0)
    model = TinyMLP(d_in=16, width=32, depth=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = _engine()
    model, optimizer, _ = engine.setup(model, optimizer)
    batches = synthetic_batches(3, batch_size=8, d_in=16)
    with pytest.raises(ValueError, match="2 loader batch"):
        engine.train_window(model, optimizer, batches[:1])
    engine.forward_backward(model, batches[0])
    with pytest.raises(RuntimeError, match="pending"):
        engine.train_window(model, optimizer, batches[1:3])
    assert engine.step(optimizer) is False and engine.state.step == 0  # nothing was run by the refused calls


@pytest.mark.slow
def test_an_out_of_memory_error_in_a_window_is_recovered_as_in_the_pieces():
    """An out-of-memory error (injected, in step 3) in a whole window: the OOM policy halves the
    micro-batch and re-runs the window's batches; losses, weights and the event match the own-loop pieces."""
    oom = {"memory": {"on_oom": "halve"}}
    with inject_oom(3):
        pieces, w_pieces, e_pieces = _run("pieces", **oom)
        window, w_window, e_window = _run("window", **oom)
    assert pieces == window
    for a, b in zip(w_pieces, w_window):
        assert torch.equal(a, b)
    assert [(e.step, e.kind, e.detail) for e in e_window.events] == [
        (e.step, e.kind, e.detail) for e in e_pieces.events
    ]
    assert e_window.split == 2 and e_window.accumulation == 2 * ACCUMULATION
    # under a whole-step wrapper: the new split's shapes are wrapped anew (a CUDA graph recaptures)
    wrapper = CountingWrapper()
    with inject_oom(3):
        wrapped, w_wrapped, _ = _run("window", wrapper, **oom)
    assert wrapped == pieces and all(torch.equal(a, b) for a, b in zip(w_pieces, w_wrapped))
    assert wrapper.wrapped == 2
    assert (e_window.state.step, e_window.state.micro_step) == (
        e_pieces.state.step,
        e_pieces.state.micro_step,
    )


def test_the_window_runs_its_micro_batches_with_gradient_sync_before_the_last_only():
    """Single/DDP/FSDP: the micro-batches in order, the sync flag set before each one's forward
    (where DDP reads it), on only for the last: the one decision an own loop's backward shares."""
    calls: list[tuple[str, Any]] = []

    class Recording(Strategy):
        sync = None

        def set_grad_sync(self, model: torch.nn.Module, sync: bool) -> None:
            self.sync = sync

    engine, strategy = _engine(), Recording()
    window = Window(engine.precision, strategy, engine.guard, engine.device)
    window.set_accumulation(3)
    model = torch.nn.Linear(1, 1)
    window.add_model(model)
    out: list[int] = []

    def loss_fn(m: torch.nn.Module, mb: int) -> torch.Tensor:
        calls.extend([("sync", strategy.sync), ("run", mb)])  # the flag this forward sees
        out.append(10 * mb)
        return m(torch.ones(1)).sum()

    window.run(model, torch.optim.SGD(model.parameters(), lr=0.1), [(1, 1.0), (2, 1.0), (3, 1.0)], loss_fn)
    assert out == [10, 20, 30]
    assert calls == [("sync", False), ("run", 1), ("sync", False), ("run", 2), ("sync", True), ("run", 3)]


@pytest.mark.slow
def test_fit_iterates_windows_through_the_whole_step_wrapper_and_trains_as_the_pieces():
    """fit hands each optimizer step's loader batches to train_window: under a stand-in wrapper,
    one call per step, the same losses and weights as the own-loop pieces."""

    class Losses(Hook):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_step_end(self, ctx: Any) -> None:
            self.losses.append(float(ctx.engine.last_loss))

    pieces, w_pieces, _ = _run("pieces")
    torch.manual_seed(0)
    model = TinyMLP(d_in=16, width=32, depth=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    engine = _engine()
    model, optimizer, _ = engine.setup(model, optimizer)
    wrapper, seen = CountingWrapper(), Losses()
    engine.wrap_window(wrapper)
    # one batch more than STEPS windows: the last waits, pending, as an own loop's would
    batches = synthetic_batches(STEPS * ACCUMULATION + 1, batch_size=8, d_in=16)
    fit(engine, model, optimizer, batches, max_steps=STEPS + 1, hooks=[seen])
    assert seen.losses == pieces and (wrapper.wrapped, wrapper.calls) == (1, STEPS)
    for a, b in zip(w_pieces, model.parameters()):
        assert torch.equal(a, b)
    assert (engine.state.step, engine.state.batches, engine.pending_micro_steps) == (
        STEPS,
        STEPS * ACCUMULATION + 1,
        1,
    )


@pytest.mark.slow
def test_a_second_fit_carries_on_the_window_the_first_left_open():
    """fit called again (per chunk of data, per epoch) after its batches ran out mid-window: the
    open window carries on with the next call's batches and steps where the pieces would, with the
    same losses and weights as one fit over all the batches (found in review: it raised "backward
    pass(es) are pending" instead)."""

    def run(chunks: list[int]) -> tuple[list[float], list[torch.Tensor]]:
        torch.manual_seed(0)
        model = TinyMLP(d_in=16, width=32, depth=2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        engine = _engine()
        model, optimizer, _ = engine.setup(model, optimizer)
        batches = synthetic_batches(STEPS * ACCUMULATION, batch_size=8, d_in=16)
        losses: list[float] = []

        class Losses(Hook):
            def on_step_end(self, ctx: Any) -> None:
                losses.append(float(ctx.engine.last_loss))

        start = 0
        for size in chunks:
            fit(engine, model, optimizer, batches[start : start + size], max_steps=STEPS, hooks=[Losses()])
            start += size
        assert (engine.state.step, engine.pending_micro_steps) == (STEPS, 0)
        return losses, [p.detach().clone() for p in model.parameters()]

    whole, w_whole = run([STEPS * ACCUMULATION])
    odd = ACCUMULATION + 1  # the first call ends one batch into its second window
    chunked, w_chunked = run([odd, STEPS * ACCUMULATION - odd])
    assert chunked == whole
    for a, b in zip(w_whole, w_chunked):
        assert torch.equal(a, b)


def test_after_an_oom_halving_unequal_parts_are_weighted_by_their_share_so_the_step_is_the_whole_batchs():
    """A loader batch of 5 rows cut in 2 (the OOM policy's split) is parts of 3 and 2: each part's
    loss weighted by its share, the step trains as the whole batch did, through train_window (fit's
    path) and through forward_backward + step (an own loop's)."""

    def train(split: int, how: str) -> tuple[list[float], list[torch.Tensor]]:
        torch.manual_seed(0)
        plain = torch.nn.Linear(4, 1)
        engine = Engine({"run": {"device": "cpu"}})
        model, optimizer, _ = engine.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
        engine.set_split(split)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            batch = (torch.randn(5, 4, generator=g), torch.randn(5, 1, generator=g))

            def loss_fn(m: torch.nn.Module, b: Any) -> torch.Tensor:
                return torch.nn.functional.mse_loss(m(b[0]), b[1])

            if how == "window":
                assert engine.train_window(model, optimizer, [batch], loss_fn)
            else:
                engine.forward_backward(model, batch, loss_fn)
                assert engine.step(optimizer)
            losses.append(float(engine.last_loss))
        return losses, [p.detach().clone() for p in model.parameters()]

    for how in ("window", "pieces"):
        whole, w_whole = train(1, how)
        halved, w_halved = train(2, how)
        assert halved == pytest.approx(whole, rel=1e-6), how
        assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(w_halved, w_whole)), how
