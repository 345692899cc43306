"""turbotrain in a Hugging Face Accelerate loop: the ``Accelerator`` arguments of turbotrain's
recipe and its monitoring, run directory and report (docs/integrations.md). Nothing it does
touches your loader or the RNG (FLOPs are counted side-effect free, after the first optimizer
step), so the training is the one your loop runs without it, bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Unpack

import torch
from torch import nn

from ..base.version import __version__
from .observer import LoopObserver, ObserverOptions, failed_status, run_name
from .recipe import Recipe, recipe_kwargs

try:
    import accelerate
except ImportError:  # one line naming the package, not a chain of tracebacks
    raise ImportError("turbotrain.integrations.accelerate needs accelerate: pip install accelerate") from None

__all__ = ["AccelerateRun", "accelerator_kwargs_recipe", "recipe_to_accelerator_kwargs", "track_accelerate"]

MIXED_PRECISION = {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp32": "no"}
TURBOTRAIN_PRECISION = {"bf16": "bf16-mixed", "fp16": "fp16-mixed", "no": "fp32", "fp8": "fp8"}


def recipe_to_accelerator_kwargs(recipe: Recipe) -> dict[str, Any]:
    """A :class:`~turbotrain.integrations.recipe.Recipe` as ``Accelerator`` keyword arguments."""
    return {
        "mixed_precision": MIXED_PRECISION[recipe.precision],
        "dynamo_backend": "inductor" if recipe.compile else "no",
    }


def accelerator_kwargs_recipe(device: torch.device | str | None = None, **yours: Any) -> dict[str, Any]:
    """``Accelerator`` keyword arguments of turbotrain's recipe for ``device``, ``yours`` winning."""
    return recipe_kwargs(device, recipe_to_accelerator_kwargs, yours, where=" (Accelerator)")


class AccelerateRun:
    """The run directory of an Accelerate loop: :meth:`batch` per micro-batch, :meth:`step` per
    optimizer step, :meth:`close`. Only the main process writes; elsewhere every call does nothing."""

    def __init__(
        self,
        accelerator: Any,
        model: nn.Module,
        run_dir: str | Path,
        *,
        example_batch: Any = None,
        loss_fn: Callable[[nn.Module, Any], Any] | None = None,
        log_every: int = 10,
        max_steps: int | None = None,
        report: bool = True,
        name: str | None = None,
        **options: Unpack[ObserverOptions],
    ) -> None:
        if log_every < 1:
            raise ValueError(f"log_every = {log_every!r}: give the optimizer steps between records (>= 1)")
        self.log_every, self.report = log_every, report
        self.steps = 0
        self._recorded = 0  # the last step with a record
        self._last_loss: Any = None  # the last step's loss (a device tensor: read only for a record)
        self.summary: dict[str, Any] = {}
        self.observer: LoopObserver | None = None
        self._model = accelerator.unwrap_model(model)  # the FLOP count's, outside DDP and autocast
        self._loss_fn = loss_fn
        self._first_batch: Any = None  # FLOPs are counted on it after the first step
        if not accelerator.is_main_process:
            return
        mixed = str(accelerator.mixed_precision)
        self.observer = LoopObserver(
            run_dir,
            name=name or run_name(run_dir, type(self._model).__name__),
            device=accelerator.device,
            framework=f"accelerate {accelerate.__version__} loop (turbotrain {__version__})",
            world=max(1, accelerator.num_processes),
            precision=TURBOTRAIN_PRECISION.get(mixed, mixed),
            max_steps=max_steps,
            optimizations={
                "mixed_precision": mixed,
                "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
                "compile": "model" if accelerator.state.dynamo_plugin.backend.value != "NO" else "off",
            },
            **options,
        )
        if example_batch is not None:  # FLOPs counted once, before the clock starts
            self.observer.count_flops(self._model, example_batch, loss_fn)
        self.observer.start(0)

    def batch(self, batch: Any) -> None:
        """One training micro-batch (no sync); the first is kept for the FLOP count."""
        obs = self.observer
        if obs is not None:
            obs.count(batch)
            if self._first_batch is None and obs.flops_per_sample is None:
                self._first_batch = batch

    def step(self, loss: Any = None, lr: float | None = None) -> None:
        """An optimizer step is done; every ``log_every`` a record reads ``loss`` (host-device sync point)."""
        self.steps += 1
        obs = self.observer
        if obs is None:
            return
        loss = loss.detach() if isinstance(loss, torch.Tensor) else loss  # no sync
        obs.step_end(self.steps, loss)
        if self._first_batch is not None:  # once: after the first step, so not in its time
            obs.count_flops(self._model, self._first_batch, self._loss_fn)
            self._first_batch = None
        if self.steps % self.log_every == 0:
            obs.record(self.steps, loss, lr=lr)
            self._recorded = self.steps
        self._last_loss = loss

    def close(self, exc: BaseException | None = None) -> dict[str, Any]:
        """The last record, summary.json and (with ``report``, when no error) plots and summary.md."""
        obs = self.observer
        if obs is None:
            return {}
        self.observer = None
        if exc is None and self._last_loss is not None and self._recorded != self.steps:
            obs.record(self.steps, self._last_loss)  # the last step's record
        status = "completed" if exc is None else failed_status(exc)
        self.summary = obs.close(status, report=self.report)
        return self.summary

    def __enter__(self) -> AccelerateRun:
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close(exc)


def track_accelerate(
    accelerator: Any, model: nn.Module, run_dir: str | Path, **options: Any
) -> AccelerateRun:
    """An :class:`AccelerateRun` for this Accelerate loop in ``run_dir``. ``example_batch``: count
    FLOPs on it before the clock starts (not one drawn from your loader: that changes what the loop
    trains on); ``loss_fn(model, batch)`` for the count (default ``model(**batch)``); options:
    ``log_every``, ``max_steps``, ``report`` and :class:`ObserverOptions`."""
    return AccelerateRun(accelerator, model, run_dir, **options)
