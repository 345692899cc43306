import os
import signal

import torch

from turbotrain import Engine, fit
from turbotrain.loop.checkpoint import Checkpointer, RunState, list_checkpoints
from turbotrain.loop.hooks import Hook, StopAfter, StopOnSignal
from turbotrain.parts.models.mlp import TinyMLP, synthetic_batches


class SendSignal(Hook):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, ctx) -> None:
        if ctx.engine.state.step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def _setup():
    model = TinyMLP(d_in=8, width=8, depth=1)
    engine = Engine({"run": {"device": "cpu"}})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = engine.setup(model, opt)
    return engine, model, opt


def test_sigterm_ends_after_the_step_and_saves_a_checkpoint(tmp_path):
    engine, model, opt = _setup()
    saver = Checkpointer(tmp_path, interval=0, keep_last=2, state=RunState(model=model))
    before = signal.getsignal(signal.SIGTERM)
    ctx = fit(
        engine,
        model,
        opt,
        synthetic_batches(50, d_in=8),
        max_steps=50,
        hooks=[StopOnSignal(), SendSignal(3), saver],
    )
    assert engine.state.step == 3 and ctx.stop_reason == "signal SIGTERM"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003.pt"]
    assert signal.getsignal(signal.SIGTERM) == before  # handler restored


def test_stop_after_and_max_steps():
    engine, model, opt = _setup()
    fit(engine, model, opt, synthetic_batches(50, d_in=8), max_steps=10, hooks=[StopAfter(4)])
    assert engine.state.step == 4
    fit(engine, model, opt, synthetic_batches(50, d_in=8), max_steps=10)
    assert engine.state.step == 10


def test_stop_after_does_not_end_a_resumed_invocation_that_starts_past_it():
    engine, model, opt = _setup()
    fit(engine, model, opt, synthetic_batches(50, d_in=8), max_steps=10, hooks=[StopAfter(4)])
    ctx = fit(engine, model, opt, synthetic_batches(50, d_in=8), max_steps=10, hooks=[StopAfter(4)])
    assert engine.state.step == 10 and not ctx.should_stop
