"""A real training step at a given micro-batch: what the batch finder measures (:class:`StepTrial`)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...base.failure import first_line
from ...base.seeds import rng_state, set_rng_state
from ...core.engine import Engine, default_loss
from ...core.meter.clock import time_call
from ...core.meter.trial import train_step
from ...core.oom import is_oom
from ...parts.models.moe import MoE
from .finder import TrialResult
from .stats import step_meter


class StepTrial:
    """A real training step at a given micro-batch, for :func:`find_batch_size`: the peak memory
    of a step of two micro-steps (the second forward with the first's gradients allocated), then
    ``timed_steps`` steps timed by the kit's clock (sync points: search only). DDP/FSDP buckets are
    not covered (the headroom is for such extras). A compiled model runs eagerly: each size would
    compile again, and eager activations are at least the compiled ones. As a context manager:
    on exit the weights, RNG states and optimizer are as if no search had run.
    """

    def __init__(
        self,
        engine: Engine,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        make_batch: Callable[[int], Any],
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        timed_steps: int = 1,
    ) -> None:
        self.engine, self.model, self.optimizer = engine, model, optimizer
        self.make_batch, self.loss_fn = make_batch, loss_fn or default_loss
        self.timed_steps = max(1, timed_steps)
        self.device = engine.device
        # The state dict, not the live tensors: under expert parallelism it holds every expert (the
        # modules' hooks gather them) and a MoE layer's pending router-bias loads (its extra state),
        # so loading it back (close) goes through the same hooks: each rank's slice, the loads reset.
        self._weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        self._tallies = [
            (m, m.load.clone(), m.dropped.clone())  # the expert monitor's
            for m in model.modules()
            if isinstance(m, MoE)
        ]
        self._optimizer_state = optimizer.state_dict() if optimizer.state else None
        self._rng = rng_state()  # torch's, Python's and numpy's: a trial's model may draw from any
        self._was_training = model.training

    def __enter__(self) -> StepTrial:
        self.model.train()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _step(self, batch: Any, micro_steps: int = 1) -> None:
        train_step(
            self.model,
            self.optimizer,
            batch,
            loss_fn=self.loss_fn,
            autocast=self.engine.autocast,
            eagerly=True,
            micro_steps=micro_steps,
        )

    def _measured_step(self, batch: Any) -> int:
        meter = step_meter(self.device, self.model, self.optimizer, batch)
        with meter:
            self._step(batch, micro_steps=2)
        return int(meter.peak)

    def __call__(self, micro: int) -> TrialResult:
        failure = ""
        try:
            batch = self.make_batch(micro)
            peak = self._measured_step(batch)
            timing = time_call(lambda: self._step(batch), self.engine.device, self.timed_steps, warmup=0)
            return TrialResult(peak, timing.median / 1000)
        except RuntimeError as exc:
            if not is_oom(exc):
                raise
            failure = first_line(exc, type(exc).__name__)
        # Outside the except clause: the traceback, and the activations its frames held, are gone.
        self._free()
        raise torch.OutOfMemoryError(f"micro-batch {micro}: {failure}")

    def _free(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Undo everything the trials changed and free what they allocated."""
        self.optimizer.state.clear()
        if self._optimizer_state is not None:
            self.optimizer.load_state_dict(self._optimizer_state)
        self._free()
        # in place: parameters keep their identity (the optimizer's)
        self.model.load_state_dict(self._weights)
        for layer, load, dropped in self._tallies:  # the trials' routing is not training's
            layer.load, layer.dropped = load, dropped
        set_rng_state(self._rng)
        self.model.train(self._was_training)
        self._free()
