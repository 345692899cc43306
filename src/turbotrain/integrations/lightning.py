"""turbotrain inside a Lightning ``Trainer`` (docs/integrations.md): a callback for its
monitoring, run directory and report, and the ``Trainer`` arguments of turbotrain's recipe. A
record every ``log_every`` optimizer steps reads the step's last loss (the one host-device sync,
once per record); FLOPs are counted by torch's FLOP counter watching the first optimizer step
(nothing extra runs; a compiled module is not counted: give ``flops_per_sample``)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Unpack

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..base.batch import attention_mask
from ..base.version import __version__
from ..loop.monitor.flops import _EXTRA_FLOP_FORMULAS  # the CPU attention kernels' FLOP formulas
from ..parts.hardware import tf32_enabled
from .observer import LoopObserver, ObserverOptions, failed_status, run_name
from .recipe import Recipe, recipe_kwargs

try:
    import lightning
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:  # one line naming the extra, not a chain of tracebacks
    raise ImportError(
        "turbotrain.integrations.lightning needs lightning: pip install 'turbotrain[lightning]'"
    ) from None

log = logging.getLogger("turbotrain.integrations")

__all__ = ["TurbotrainLightningCallback", "trainer_kwargs_recipe", "recipe_to_trainer_kwargs"]

LIGHTNING_PRECISION = {"bf16-mixed": "bf16-mixed", "fp16-mixed": "16-mixed", "fp32": "32-true"}
TURBOTRAIN_PRECISION = {
    "bf16-mixed": "bf16-mixed",
    "16-mixed": "fp16-mixed",
    "bf16-true": "bf16-true",
    "32-true": "fp32",
    "32": "fp32",
}


def recipe_to_trainer_kwargs(recipe: Recipe) -> dict[str, Any]:
    """A :class:`~turbotrain.integrations.recipe.Recipe` as ``Trainer`` keyword arguments."""
    return {"precision": LIGHTNING_PRECISION[recipe.precision], "benchmark": recipe.cudnn_benchmark}


def trainer_kwargs_recipe(device: torch.device | str | None = None, **yours: Any) -> dict[str, Any]:
    """``Trainer`` keyword arguments of turbotrain's recipe for ``device``, ``yours`` winning."""
    return recipe_kwargs(device, recipe_to_trainer_kwargs, yours, where=" (lightning Trainer)")


class TurbotrainLightningCallback(Callback):
    """turbotrain's monitoring, run directory and report for a Lightning run.

    ``run_dir``: default ``<default_root_dir>/turbotrain``; ``log_every``: default the Trainer's
    ``log_every_n_steps``; ``val_key``: the metric the module logs as its validation loss (one
    warning where validation ran without it); the rest as for the Hugging Face callback."""

    def __init__(
        self,
        run_dir: str | Path | None = None,
        *,
        log_every: int | None = None,
        report: bool = True,
        flops_per_sample: float | None = None,
        val_key: str = "val_loss",
        name: str | None = None,
        **options: Unpack[ObserverOptions],
    ) -> None:
        if log_every is not None and log_every < 1:
            raise ValueError(f"log_every = {log_every!r}: give the optimizer steps between records (>= 1)")
        self.run_dir, self.log_every, self.report = run_dir, log_every, report
        self.name, self.options = name, options
        self.flops_per_sample, self.val_key = flops_per_sample, val_key
        self._val_warned = False
        self.observer: LoopObserver | None = None
        self.summary: dict[str, Any] = {}
        self._every = 1
        self._counter: FlopCounterMode | None = None
        self._counted = (0, 0)  # samples and tokens under the FLOP counter
        self._val_t0 = 0.0
        self._accumulation = 1
        self._to_count = False  # the first optimizer step's FLOPs are still to be counted
        self._last_loss: Any = None  # the last step's loss (a device tensor: not read unless needed)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return  # one process writes the run directory
        precision = TURBOTRAIN_PRECISION.get(str(trainer.precision), str(trainer.precision))
        # Lightning's Trainer sets log_every_n_steps in its logger connector: its type does not declare it
        self._every = self.log_every or trainer.log_every_n_steps or 50  # type: ignore[attr-defined]
        self._accumulation = trainer.accumulate_grad_batches
        module = type(pl_module).__name__
        root = Path(trainer.default_root_dir)
        run_dir = Path(self.run_dir) if self.run_dir is not None else root / "turbotrain"
        # named as the run directory, or as the module's class where no directory was given
        unnamed = self.run_dir is None and root.resolve() == Path.cwd().resolve()
        self.observer = LoopObserver(
            run_dir,
            name=self.name or (module if unnamed else run_name(run_dir, module)),
            device=pl_module.device,
            framework=f"lightning {lightning.__version__} Trainer (turbotrain {__version__} callback)",
            world=max(1, trainer.world_size),
            precision=precision,
            config={
                "max_steps": trainer.max_steps,
                "precision": str(trainer.precision),
                "accumulate_grad_batches": trainer.accumulate_grad_batches,
                "hparams": dict(getattr(pl_module, "hparams", {}) or {}),
            },
            max_steps=trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None,
            optimizations={
                "lightning precision": str(trainer.precision),
                "accumulate_grad_batches": trainer.accumulate_grad_batches,
                "compile": "model" if getattr(pl_module, "_compiler_ctx", None) else "off",
                "tf32": tf32_enabled() and pl_module.device.type == "cuda",
            },
            **self.options,
        )
        self.observer.start(trainer.global_step)
        if self.flops_per_sample is not None:
            self.observer.set_flops(self.flops_per_sample, "given")
        elif getattr(pl_module, "_compiler_ctx", None):
            log.info("FLOPs not counted for a compiled module: pass flops_per_sample for TFLOP/s and MFU")
        else:
            self._to_count = True

    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        obs = self.observer
        if obs is not None and self._to_count and self._counter is None:  # the first step: count it
            self._counter = FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS)
            self._counter.__enter__()
            self._counted = (obs.samples, obs.tokens)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        obs = self.observer
        if obs is None:
            return
        obs.count(batch)
        step = trainer.global_step
        if step == obs.step:
            return  # gradient accumulation: the optimizer step is not done yet
        tensor = outputs if isinstance(outputs, torch.Tensor) else None
        loss = self._last_loss = outputs.get("loss") if isinstance(outputs, dict) else tensor
        counter = self._counter
        if counter is not None:  # the first step's FLOPs per sample (per token position: none with a mask)
            counter.__exit__(None, None, None)
            self._counter, self._to_count = None, False
            samples, tokens = obs.samples - self._counted[0], obs.tokens - self._counted[1]
            if samples and counter.get_total_flops():
                per_sample = 0.0 if attention_mask(batch) is not None else tokens / samples
                obs.set_flops(
                    counter.get_total_flops() / samples, "torch.utils.flop_counter (first step)", per_sample
                )
        obs.step_end(step, loss)
        if step % self._every == 0:
            lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None
            obs.record(step, self._unscaled(loss), lr=lr)

    def _unscaled(self, loss: Any) -> Any:
        """The loss ``training_step`` returned (callbacks get it divided by the accumulation)."""
        return loss * self._accumulation if loss is not None and self._accumulation > 1 else loss

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._val_t0 = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        obs = self.observer
        if obs is None or trainer.sanity_checking:
            return
        obs.add_side(time.perf_counter() - self._val_t0)
        val = trainer.callback_metrics.get(self.val_key)
        if val is not None:  # validation has synced already: one more read of its result
            obs.record(trainer.global_step, None, val_loss=float(val))
        elif not self._val_warned:
            self._val_warned = True
            logged = ", ".join(sorted(trainer.callback_metrics)) or "nothing"
            log.warning(
                "validation ran but logged no %r (it logged: %s): no validation loss is recorded; "
                "pass TurbotrainLightningCallback(val_key=...) to name yours",
                self.val_key,
                logged,
            )

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._finish("completed")

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._finish(failed_status(exception))

    def _finish(self, status: str) -> None:
        obs = self.observer
        if obs is None:
            return
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None
        last = obs.monitor.last_loss_record()
        if status == "completed" and last.get("step") != obs.step and self._last_loss is not None:
            obs.record(obs.step, self._unscaled(self._last_loss))
        self.summary = obs.close(status, report=self.report)
        self.observer = None
