"""turbotrain inside a Hugging Face ``Trainer`` (docs/integrations.md): a callback for its
monitoring, run directory and report, and the ``TrainingArguments`` of turbotrain's recipe. The
callback reads the loss the Trainer logged (read already: no host-device sync of its own) and
counts samples and tokens from the shapes a forward pre-hook sees; only the main process writes.
Each checkpoint's counts go into metrics.jsonl, so ``resume_from_checkpoint`` goes on from them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Unpack

import torch

from ..base.version import __version__
from .observer import LoopObserver, ObserverOptions, run_name
from .recipe import Recipe, recipe_kwargs

try:
    import transformers
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError:  # one line naming the extra, not a chain of tracebacks
    raise ImportError("turbotrain.integrations.hf needs transformers: pip install 'turbotrain[hf]'") from None

__all__ = ["TurbotrainCallback", "training_args_recipe", "recipe_to_training_args"]

# Settings that only make sense together: once you give one, the recipe's others step aside.
GROUPS = (
    ("bf16", "fp16"),
    ("dataloader_num_workers", "dataloader_persistent_workers", "dataloader_prefetch_factor"),
    ("torch_compile", "torch_compile_mode", "torch_compile_backend"),
)


def recipe_to_training_args(recipe: Recipe) -> dict[str, Any]:
    """A :class:`~turbotrain.integrations.recipe.Recipe` as ``TrainingArguments`` keyword arguments."""
    out: dict[str, Any] = {
        "bf16": recipe.precision == "bf16-mixed",
        "fp16": recipe.precision == "fp16-mixed",
        "optim": "adamw_torch_fused" if recipe.optimizer == "fused" else "adamw_torch",
        "torch_compile": recipe.compile,
        "dataloader_num_workers": recipe.num_workers,
        "dataloader_pin_memory": recipe.pin_memory,
        "dataloader_persistent_workers": recipe.persistent_workers,
        "dataloader_prefetch_factor": recipe.prefetch_factor,
    }
    if recipe.tf32:  # TrainingArguments refuses tf32=True on a device without TF32
        out["tf32"] = True
    if recipe.compile and recipe.compile_mode != "default":
        out["torch_compile_mode"] = recipe.compile_mode
    return out


def training_args_recipe(device: torch.device | str | None = None, **yours: Any) -> dict[str, Any]:
    """``TrainingArguments`` keyword arguments of the recipe, ``yours`` winning (with :data:`GROUPS`)."""
    return recipe_kwargs(device, recipe_to_training_args, yours, GROUPS, " (TrainingArguments)")


class TurbotrainCallback(TrainerCallback):
    """turbotrain's monitoring, run directory and report for a ``Trainer`` run.

    ``run_dir``: default ``<output_dir>/turbotrain``; ``report``: plots and summary.md at the end;
    ``flops_per_sample``: skip the FLOP count; ``loss_fn(model, batch)``: the loss for the FLOP count
    (default ``model(**batch)``); the rest: :class:`ObserverOptions`."""

    def __init__(
        self,
        run_dir: str | Path | None = None,
        *,
        report: bool = True,
        flops_per_sample: float | None = None,
        loss_fn: Any = None,
        name: str | None = None,
        **options: Unpack[ObserverOptions],
    ) -> None:
        self.run_dir, self.report, self.name, self.options = run_dir, report, name, options
        self.flops_per_sample, self.loss_fn = flops_per_sample, loss_fn
        self.observer: LoopObserver | None = None
        self.summary: dict[str, Any] = {}
        self._hook: Any = None
        self._model: Any = None
        self._first_batch: Any = None
        self._mark = 0.0  # where the Monitor's window stands: the last step's end or record, whichever later
        self._paused = False  # while the FLOP count runs its own forward

    def _count(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook: a training micro-batch's samples and tokens from its shapes (no sync)."""
        if module.training and torch.is_grad_enabled() and self.observer is not None and not self._paused:
            batch = kwargs if kwargs else args
            self.observer.count(batch)
            if self._first_batch is None:
                self._first_batch = batch  # FLOPs are counted on it after the first step

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        model = kwargs.get("model")
        if not state.is_world_process_zero or model is None:
            return  # one process writes the run directory
        assert args.output_dir is not None  # TrainingArguments fills in its default ('trainer_output')
        run_dir = self.run_dir if self.run_dir is not None else Path(args.output_dir) / "turbotrain"
        self.observer = LoopObserver(
            run_dir,
            name=self.name or run_name(run_dir, type(model).__name__),
            device=args.device,
            framework=f"transformers {transformers.__version__} Trainer (turbotrain {__version__} callback)",
            world=max(1, args.world_size),
            precision="bf16-mixed" if args.bf16 else "fp16-mixed" if args.fp16 else "fp32",  # the MFU peak's
            max_steps=state.max_steps or None,
            optimizations={
                "optimizer": str(getattr(args.optim, "value", args.optim)),
                "tf32": bool(args.tf32),
                "compile": "model" if args.torch_compile else "off",
                "gradient_accumulation_steps": args.gradient_accumulation_steps,
                "num_workers": args.dataloader_num_workers,
                "pin_memory": args.dataloader_pin_memory,
            },
            config={"training_args": args.to_dict()},
            resume_step=state.global_step,  # resume_from_checkpoint: the counts go on from its step
            **self.options,
        )
        # outside any compiled graph: traced, the changing counts recompiled a small module once
        self._hook = model.register_forward_pre_hook(torch.compiler.disable(self._count), with_kwargs=True)
        self._model = model
        self.observer.start(state.global_step)
        self._mark = time.perf_counter()
        if self.flops_per_sample is not None:
            self.observer.set_flops(self.flops_per_sample, "given")

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        obs = self.observer
        if obs is None:
            return
        first = state.global_step == obs.step + 1 and obs.monitor.first_step_s is None
        obs.step_end(state.global_step)
        if first and obs.flops_per_sample is None and self._first_batch is not None:
            self._paused = True  # the count's own forward is not training
            obs.count_flops(self._model, self._first_batch, self.loss_fn)
            self._paused = False
        self._first_batch = None if obs.flops_per_sample is not None else self._first_batch
        self._mark = time.perf_counter()

    def _not_training(self) -> None:
        """Time since the step's end (or last record), evaluating or saving, left out of the throughput."""
        now = time.perf_counter()
        if self.observer is not None:
            self.observer.add_side(now - self._mark)
        self._mark = now

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        obs, logs = self.observer, logs or {}
        if obs is None:
            return
        if "loss" in logs:  # the Trainer read the window's mean loss already: no sync here
            obs.record(
                state.global_step, logs["loss"], lr=logs.get("learning_rate"), grad_norm=logs.get("grad_norm")
            )
            self._mark = time.perf_counter()  # the record starts the Monitor's next window
        elif "eval_loss" in logs:
            self._not_training()  # the evaluation that just ran
            skip = ("eval_loss", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second")
            metrics = {
                f"val_{k[5:]}": float(v)
                for k, v in logs.items()
                if k.startswith("eval_") and k not in skip and isinstance(v, (int, float))
            }
            obs.record(state.global_step, None, val_loss=float(logs["eval_loss"]), val_metrics=metrics)
            self._mark = time.perf_counter()

    def on_evaluate(self, *args: Any, **kwargs: Any) -> None:
        self._not_training()  # an evaluation that logged no eval_loss (else ~0: done in on_log)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.observer is not None:
            self._not_training()  # the checkpoint's time (after any evaluation's, not again)
            self.observer.checkpointed(state.global_step)  # its counts, for resume_from_checkpoint

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.observer is None:
            return
        if self._hook is not None:
            self._hook.remove()
        obs = self.observer
        last = obs.monitor.last_loss_record()
        if last.get("step") != state.global_step:  # the steps after the last logging step
            obs.record(state.global_step, None)  # no loss read: the Trainer logged none for them
        self.summary = obs.close("completed", report=self.report)
        self.observer = None
