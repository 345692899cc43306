"""Out-of-memory recovery mid-run: halve the micro-batch, double accumulation, re-run the step.

``Engine.forward_backward`` hands each loader batch to a :class:`BatchRunner`. Normally that is
one forward and one backward. After an out-of-memory error under ``memory.on_oom = 'halve'``,
each loader batch is split into ``split`` equal parts run as separate micro-steps, and the
engine's accumulation is multiplied by the same factor, so:

- the loader keeps yielding the same full batches: the data order and ``engine.state.batches``
  (the data position used for exact resume) are untouched;
- each part's loss is weighted by its share of the batch x ``split`` (1 for equal parts), so
  with ``backward()`` dividing by the doubled accumulation the summed gradient is the same as
  the whole batch's, and so is the logged loss;
- the failed step is re-run from its first batch: gradients of its earlier micro-batches may
  have been partly accumulated when the error hit backward, so they are dropped and recomputed
  (the step's loader batches are kept by reference until the step ends, which costs nothing).

The event is appended to ``engine.events`` (and so to summary.json). The split is saved in the
engine's state_dict, so a resumed run keeps the smaller micro-batch. Dropout draws differ in a
re-run step; with dropout 0 the loss curve matches a run without the error to rounding.

``memory.on_oom = 'stop'`` raises :class:`OutOfMemoryStop`, a one-line user error that says what
to change. ``memory.inject_oom_at_step = N`` raises a real ``torch.OutOfMemoryError`` once, in
the last micro-step of optimizer step N (after its forward), to test this path end to end.
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..errors import ConfigError, TurbotrainError
from .finder import is_oom

if TYPE_CHECKING:
    from ..engine import Engine

log = logging.getLogger(__name__)

POLICIES = ("halve", "stop")


class OutOfMemoryStop(TurbotrainError, torch.OutOfMemoryError):
    """Training ran out of device memory and the policy (or the batch size) allows no retry.
    Still a ``torch.OutOfMemoryError`` for code that catches that."""


def batch_size(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor."""
    first = batch[0] if isinstance(batch, (tuple, list)) else next(iter(batch.values())) if isinstance(batch, dict) else batch
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.ndim else 1


def split_batch(batch: Any, parts: int) -> list[Any]:
    """``batch`` cut into ``parts`` near-equal pieces along dim 0 (tensors in tuples, lists and
    dicts; tensors whose first dimension is not the batch's, and non-tensors, are repeated)."""
    n = batch_size(batch)

    def cut(x: Any) -> list[Any]:
        if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] == n:
            return list(torch.tensor_split(x, parts))
        if isinstance(x, (tuple, list)):
            return [type(x)(p) for p in zip(*(cut(v) for v in x))]
        if isinstance(x, dict):
            pieces = {k: cut(v) for k, v in x.items()}
            return [{k: pieces[k][i] for k in x} for i in range(parts)]
        return [x] * parts

    return cut(batch)


class BatchRunner:
    """One loader batch -> forward and backward (``memory.on_oom = 'stop'``): an out-of-memory
    error becomes :class:`OutOfMemoryStop` with the fixes to try."""

    def __init__(self, inject_at_step: int = 0) -> None:
        self.split = 1  # parts each loader batch is cut into
        self.inject_at_step = inject_at_step

    def run(self, engine: "Engine", model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> torch.Tensor:
        try:
            return self.forward_backward(engine, model, batch, loss_fn)
        except RuntimeError as exc:
            if not is_oom(exc):
                raise
            raise OutOfMemoryStop(
                f"out of memory in step {engine.state.step + 1} with micro-batch {self.micro(batch)} "
                "(memory.on_oom = 'stop'); use --memory.on_oom=halve, --batch.micro=auto, a smaller --batch.micro "
                "or --memory.checkpointing=full"
            ) from exc

    def micro(self, batch: Any) -> int:
        return -(-batch_size(batch) // self.split)

    def forward_backward(self, engine: "Engine", model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> torch.Tensor:
        """Forward under autocast and backward, in ``split`` parts; returns the batch's loss."""
        if self.split == 1:
            with engine.autocast():
                loss = loss_fn(model, batch)
            self._maybe_inject(engine)
            engine.backward(loss)
            return loss
        n = batch_size(batch)
        total: torch.Tensor | None = None
        for part in split_batch(batch, self.split):
            with engine.autocast():
                loss = loss_fn(model, part)
            share = batch_size(part) / n
            weight = share * self.split  # 1.0 for equal parts
            self._maybe_inject(engine)
            engine.backward(loss if weight == 1.0 else loss * weight)
            piece = loss.detach() * share
            total = piece if total is None else total + piece
        assert total is not None
        return total

    def _maybe_inject(self, engine: "Engine") -> None:
        if (
            self.inject_at_step
            and engine.state.step + 1 == self.inject_at_step
            and engine.pending_micro_steps + 1 >= engine.accumulation
        ):
            step, self.inject_at_step = self.inject_at_step, 0  # once
            raise torch.OutOfMemoryError(f"injected out-of-memory error in step {step} (memory.inject_oom_at_step = {step})")

    def state_dict(self) -> dict[str, Any]:
        return {"split": self.split, "inject_at_step": self.inject_at_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.split = int(state.get("split", 1))
        self.inject_at_step = int(state.get("inject_at_step", self.inject_at_step))


class HalvingBatchRunner(BatchRunner):
    """``memory.on_oom = 'halve'``: on an out-of-memory error, drop the partial step, double
    ``split`` and the engine's accumulation, and re-run the step's batches (see the module doc)."""

    def __init__(self, inject_at_step: int = 0) -> None:
        super().__init__(inject_at_step)
        self.window: list[Any] = []  # this optimizer step's loader batches, by reference

    def run(self, engine: "Engine", model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> torch.Tensor:
        if engine.pending_micro_steps == 0:
            self.window.clear()  # a new optimizer step
        self.window.append(batch)
        try:
            return self.forward_backward(engine, model, batch, loss_fn)
        except RuntimeError as exc:
            if not is_oom(exc):
                raise
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        # Outside the except clause: the traceback, and the activations its frames held, are gone.
        return self._recover(engine, model, loss_fn, reason)

    def _discard(self, engine: "Engine", model: nn.Module) -> None:
        """Forget the partial step: gradients, the loss sum, its micro-step count; free memory."""
        model.zero_grad(set_to_none=True)
        engine.state.micro_step -= engine.pending_micro_steps
        engine.pending_micro_steps = 0
        engine._loss_sum = None  # the step's loss is re-accumulated by the re-run
        gc.collect()
        if engine.device.type == "cuda":
            torch.cuda.empty_cache()

    def _recover(self, engine: "Engine", model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], reason: str) -> torch.Tensor:
        from ..engine import Event

        while True:
            self._discard(engine, model)
            smallest = min(batch_size(b) for b in self.window)
            step = engine.state.step + 1
            if self.split * 2 > smallest:
                raise OutOfMemoryStop(
                    f"out of memory in step {step} even with micro-batch {self.micro(self.window[0])} ({reason}); "
                    "use --memory.checkpointing=full, a lower precision, or a smaller model"
                )
            old_micro, old_acc = self.micro(self.window[0]), engine.accumulation
            global_batch = batch_size(self.window[0]) * old_acc // self.split
            self.split *= 2
            engine.accumulation *= 2
            detail = (
                f"out of memory in step {step} ({reason}); micro-batch {old_micro} -> {self.micro(self.window[0])}, "
                f"accumulation {old_acc} -> {engine.accumulation}, global batch {global_batch} unchanged; "
                f"re-ran the step's {len(self.window)} batch(es)"
            )
            log.warning("OOM recovery: %s", detail)
            engine.events.append(Event(step, "oom_recovery", detail))
            try:
                loss: torch.Tensor | None = None
                for b in self.window:
                    loss = self.forward_backward(engine, model, b, loss_fn)
                assert loss is not None
                return loss
            except RuntimeError as exc:
                if not is_oom(exc):
                    raise
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def build_batch_runner(on_oom: str, inject_at_step: int = 0) -> BatchRunner:
    """``memory.on_oom`` -> the runner the engine calls for each loader batch."""
    if on_oom not in POLICIES:
        raise ConfigError(f"memory.on_oom = {on_oom!r} is not valid; choose one of: {', '.join(POLICIES)}")
    if inject_at_step < 0:
        raise ConfigError(f"memory.inject_oom_at_step = {inject_at_step} must be >= 0 (0 = never)")
    return HalvingBatchRunner(inject_at_step) if on_oom == "halve" else BatchRunner(inject_at_step)
