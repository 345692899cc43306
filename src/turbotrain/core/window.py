"""One optimizer step, top-down: the window, the one orchestration ``fit`` and an own loop share
(docs/architecture.md "The window"). Nothing here reads configuration, counts steps, polls the guard
or handles errors: the Engine keeps those. :meth:`Window.run` is one function of tensors with no
host-device sync, so whole-step capture (CUDA graphs) or a pipeline schedule is one wrapper around it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..base.batch import batch_size, misplaced, move_to, split_batch
from ..base.errors import LossError, PlacementError
from ..parts.models.moe.parallel import GradNormFn
from ..parts.models.spec import LossFn, MetricsFn  # the one definition of (model, batch) -> loss
from .precision.core import NonFiniteGuard, Precision  # the class's own module: one import level less
from .transforms import eager

if TYPE_CHECKING:  # the window calls the strategy it is given; it builds none
    from .distributed import Strategy

# (a batch or a part of one, the weight of its loss: 1.0 for whole, equal parts)
MicroBatch = tuple[Any, float]
WindowFn = Callable[
    [nn.Module, torch.optim.Optimizer, Sequence[MicroBatch], LossFn], tuple[torch.Tensor, torch.Tensor | None]
]
"""The signature of :meth:`Window.run` (and of a whole-step wrapper's result): (model, optimizer,
micro-batches, loss_fn) -> (the window's mean loss averaged over ranks, its gradient norm)."""


def micro_batches(batches: Sequence[Any], split: int) -> list[MicroBatch]:
    """A window's micro-batches: each loader batch whole, or in ``split`` weighted parts."""
    if split == 1:
        return [(batch, 1.0) for batch in batches]
    micro: list[MicroBatch] = []
    for batch in batches:
        n = batch_size(batch)
        micro.extend((part, batch_size(part) / n * split) for part in split_batch(batch, split))
    return micro


def as_loss(output: Any) -> torch.Tensor:
    """The scalar loss in what a model returned: a 0-d tensor, a tuple's first element, a mapping's
    or a ``ModelOutput``'s ``loss``; anything else is one error (shape checks only: no sync)."""
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, (tuple, list)) and output:
        loss = output[0]
    elif isinstance(output, Mapping) and "loss" in output:
        loss = output["loss"]
    else:
        loss = getattr(output, "loss", output)
    if isinstance(loss, torch.Tensor) and loss.ndim == 0:
        return loss
    what = (
        f"a tensor of shape {tuple(loss.shape)}"
        if isinstance(loss, torch.Tensor)
        else f"a {type(output).__name__}"
    )
    raise LossError(
        f"the loss must be a scalar tensor (or a tuple starting with one, or an output with .loss), got {what}; "
        "reduce it (loss.mean()) or pass loss_fn=lambda model, batch: ... that returns the scalar"
    )


def default_loss(model: nn.Module, batch: Any) -> Any:
    """``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple or list, else ``model(batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(*batch) if isinstance(batch, (tuple, list)) else model(batch)


def check_models_placed(models: Iterable[nn.Module], device: torch.device) -> None:
    """Every parameter and buffer of ``models`` on ``device``'s type, else one PlacementError (checked
    once, never per step: a tensor left on the host names itself instead of failing in a kernel)."""
    wrong = [
        f"{name} ({t.device})"
        for model in models
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if t.device.type != device.type
    ]
    if wrong:
        raise PlacementError(
            f"{len(wrong)} tensor(s) not on {device}: {', '.join(wrong[:5])}; "
            "create every submodule before engine.setup(model, ...) so it is moved"
        )


def check_batch_placed(batch: Any, device: torch.device) -> None:
    """Every tensor of ``batch`` on ``device``, else one PlacementError."""
    wrong = misplaced(batch, device)
    if wrong:
        raise PlacementError(
            f"{', '.join(wrong[:5])} not on {device}; pass the loader to engine.setup(...) so batches are moved"
        )


def default_grad_norm(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm over the gradients of ``params`` as this process holds them."""
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)


class Window:
    """The window of one optimizer step, built once by the Engine from resolved objects.
    :attr:`body` is what a whole window runs: :meth:`run`, or the wrapper's (:meth:`wrap`) result."""

    def __init__(
        self,
        precision: Precision,
        strategy: Strategy,
        guard: NonFiniteGuard,
        device: torch.device,
        *,
        grad_clip: float = 0.0,
        norm_needed: bool = False,
        accumulation: int = 1,
    ) -> None:
        self.precision = precision
        self.strategy = strategy
        self.guard = guard
        self.device = device
        self.grad_clip = grad_clip
        self.norm_needed = norm_needed  # clipping or monitor.grad_norm: compute the norm each step
        self.grad_norm: GradNormFn = default_grad_norm
        self.aux_modules: list[Any] = []
        self.step_modules: list[Any] = []
        self.models: list[nn.Module] = []  # the wrapped models whose gradient sync backward sets
        self.accumulation = accumulation  # backward passes per optimizer step
        self.pending = 0  # backward passes of the open window
        self.loss_sum: torch.Tensor | None = None  # their detached losses, summed on the device
        self._checked = {"models": False, "batch": False}  # placement, checked once each
        self._params: dict[int, list[torch.Tensor]] = {}
        self.wrapper: Callable[[WindowFn], WindowFn] | None = None  # see wrap
        self.body: WindowFn = self.run

    def wrap(self, wrapper: Callable[[WindowFn], WindowFn] | None) -> None:
        """Run a whole window as ``wrapper(run)`` (None: :meth:`run`), anew when what it computes changes."""
        self.wrapper = wrapper
        self.body = wrapper(self.run) if wrapper is not None else self.run

    def set_precision(self, precision: Precision) -> None:
        """Run in ``precision`` from now on (a fallback)."""
        self.precision = precision
        self.wrap(self.wrapper)

    def set_grad_norm(self, fn: GradNormFn | None) -> None:
        """``fn(params) -> norm`` for the global gradient norm; None: :func:`default_grad_norm`."""
        self.grad_norm = fn if fn is not None else default_grad_norm
        self.wrap(self.wrapper)

    def run(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batches: Sequence[MicroBatch],
        loss_fn: LossFn,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step over ``micro_batches``: (mean loss over ranks, gradient norm), no host sync."""
        self.discard()  # a re-run after a failed capture starts the window afresh
        for batch, weight in micro_batches:
            loss = self.forward(model, batch, loss_fn)
            self.backward(loss if weight == 1.0 else loss * weight)
        return self.close(optimizer)

    def run_batch(
        self,
        model: nn.Module,
        batch: Any,
        loss_fn: LossFn,
        split: int,
        backward: Callable[[torch.Tensor], None],
    ) -> torch.Tensor:
        """An own loop's loader ``batch`` in ``split`` parts; the batch's loss (the parts' weighted mean)."""
        total: torch.Tensor | None = None
        for part, weight in micro_batches([batch], split):
            loss = self.forward(model, part, loss_fn)
            backward(loss if weight == 1.0 else loss * weight)
            if split == 1:
                return loss
            piece = loss.detach() * (weight / split)  # its share of the batch (split: a power of 2)
            total = piece if total is None else total + piece
        assert total is not None
        return total

    def adopt(self, model: nn.Module) -> None:
        """Find ``model``'s MoE layers (aux losses, router-bias steps), before any wrapper."""
        for module in model.modules():
            follow = getattr(module, "follow_optimizer_steps", None)
            if callable(follow) and module not in self.step_modules:
                follow()
                self.step_modules.append(module)
            if callable(getattr(module, "take_aux_loss", None)) and module not in self.aux_modules:
                self.aux_modules.append(module)

    def add_model(self, model: nn.Module) -> None:
        """A wrapped model whose gradients this window reduces across ranks."""
        self.models.append(model)
        self.sync_next()

    def place(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        """``model`` wrapped by the strategy in the precision's dtypes, its norm the strategy's, added."""
        precision = self.precision
        model = self.strategy.wrap(model, optimizer, precision.compute_dtype, precision.reduce_dtype)
        if self.strategy.grad_norm is not None:  # experts spread over ranks: the norm over all of them
            self.set_grad_norm(self.strategy.grad_norm)
        self.add_model(model)
        return model

    def expect(self, batches: int, per_step: int) -> None:
        """A whole window starts: none pending, and ``per_step`` batches, else the mistake in one line."""
        if self.pending:
            raise RuntimeError(
                f"train_window starts an optimizer step, but {self.pending} backward pass(es) "
                "are pending: call engine.step(optimizer) first"
            )
        if batches != per_step:
            raise ValueError(
                f"train_window takes one optimizer step's {per_step} loader batch(es) "
                f"(batch.accumulation), got {batches}"
            )

    def end_step(self) -> None:
        """An optimizer step ended: the MoE layers that follow optimizer steps move their router bias."""
        for module in self.step_modules:
            module.end_optimizer_step()

    def drop(self, model: nn.Module) -> int:
        """Forget the open window (gradients, loss sum, MoE step) and free memory; its backward passes."""
        model.zero_grad(set_to_none=True)
        for module in self.step_modules:
            module.discard_optimizer_step()
        pending = self.pending
        self.discard()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return pending

    def check_placed(self, batch: Any = None) -> None:
        """Once each: the models' tensors and the first ``batch`` on the device, else a PlacementError."""
        if batch is not None and not self._checked["batch"]:
            self._checked["batch"] = True
            check_batch_placed(batch, self.device)
        if not self._checked["models"]:
            self._checked["models"] = True
            check_models_placed(self.models, self.device)

    def forward(self, model: nn.Module, batch: Any, loss_fn: LossFn) -> torch.Tensor:
        """The scalar loss of ``batch`` under the precision's autocast."""
        self.check_placed(batch)
        with self.precision.autocast():
            return as_loss(loss_fn(model, batch))

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward of ``loss`` plus the MoE auxiliary losses, / accumulation, loss-scaled; adds it,
        detached, to the window's loss sum (returned) and sets the next backward's gradient sync."""
        self.check_placed()
        for module in self.aux_modules:  # the auxiliary losses of the model's MoE layers' last forward
            aux = module.take_aux_loss()
            if aux is not None:
                loss = loss + aux
        scaled = loss / self.accumulation if self.accumulation > 1 else loss
        self.precision.scale_loss(scaled).backward()
        detached = loss.detach()
        self.loss_sum = detached if self.loss_sum is None else self.loss_sum + detached
        self.pending += 1
        self.sync_next()
        return detached

    def sync_next(self) -> None:
        """The one gradient-sync decision: the coming backward reduces across ranks only when it
        completes the window. Set after each backward, before the next forward (DDP reads it there)."""
        sync = self.pending % self.accumulation + 1 == self.accumulation
        for model in self.models:
            self.strategy.set_grad_sync(model, sync)

    def set_accumulation(self, accumulation: int) -> None:
        """Backward passes per optimizer step."""
        changed, self.accumulation = accumulation != self.accumulation, accumulation
        self.sync_next()
        if changed:
            self.wrap(self.wrapper)  # new shapes, a new scale: a capturing wrapper captures anew

    def discard(self) -> None:
        """Forget the open window's backward passes and loss sum (not its gradients)."""
        self.pending, self.loss_sum = 0, None
        self.sync_next()

    def close(
        self, optimizer: torch.optim.Optimizer, partial: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`finish` the window's step and open a new one: (mean loss over ranks, norm). ``partial``:
        fewer passes than ``accumulation`` (an epoch's last), renormalised to the passes it had."""
        micro_steps = self.pending
        if partial and 0 < micro_steps != self.accumulation:
            grads = [p.grad for p in self.params_of(optimizer) if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, self.accumulation / micro_steps)
        loss_sum, norm = self.finish(optimizer, self.loss_sum)
        self.discard()
        return (loss_sum if micro_steps <= 1 else loss_sum / micro_steps), norm

    def finish(
        self, optimizer: torch.optim.Optimizer, loss_sum: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Unscale, mean loss, norm, clipping, guard, optimizer step, scale, zero grads: (loss, norm)."""
        self.precision.unscale_(optimizer)
        loss_sum = loss_sum if loss_sum is not None else torch.zeros((), device=self.device)
        # data parallel: the same value, and guard decision, on every rank
        loss_sum = self.strategy.mean_(loss_sum)
        norm = grad_scale = None
        if self.norm_needed:
            params, clip = self.params_of(optimizer), self.grad_clip
            norm = self.grad_norm(params)  # the global norm (see Engine.set_grad_norm), on the device
            if (
                clip > 0
                and self.precision.scaler is None
                and getattr(optimizer, "_step_supports_amp_scaling", False)
            ):
                # a fused optimizer divides by grad_scale (fp32) inside its kernel: clipping without
                # a pass over the gradients (clip_grad_norm_'s factor, with its epsilon)
                grad_scale = torch.clamp((norm.float() + 1e-6) / clip, min=1.0)
            elif clip > 0:  # clip_grad_norm_'s math, with the norm above
                torch.nn.utils.clip_grads_with_norm_(params, clip, norm, foreach=True)
        norm = self.strategy.full(norm) if norm is not None else None
        # under fp16 an overflow in the scaled gradients is the GradScaler's business (it skips by
        # design every growth interval): only a non-finite loss counts towards the fallback
        finite = self.guard.check(loss_sum, norm if self.precision.scaler is None else None)
        self.precision.optimizer_step(optimizer, finite, grad_scale)
        self.precision.update()
        optimizer.zero_grad(set_to_none=True)
        return loss_sum, norm

    def evaluate(
        self, model: nn.Module, batches: Iterable[Any], loss_fn: LossFn, metrics_fn: MetricsFn | None
    ) -> dict[str, float]:
        """The mean loss and each metric over ``batches`` under autocast, no_grad and eagerly (no
        eval-mode graph is compiled for a few batches), averaged over the ranks; the mode restored."""
        was_training = model.training
        model.eval()
        total, n = torch.zeros((), device=self.device), 0
        sums: dict[str, torch.Tensor] = {}
        with torch.no_grad(), self.precision.autocast(), eager():
            for batch in batches:
                batch = move_to(batch, self.device, non_blocking=True)
                total += as_loss(loss_fn(model, batch)).float()
                for name, value in (metrics_fn(model, batch) if metrics_fn is not None else {}).items():
                    value = torch.as_tensor(value, device=self.device).float().mean()
                    sums[name] = sums[name] + value if name in sums else value
                n += 1
        model.train(was_training)
        names = ["loss", *sums]
        # every rank evaluated its own batches
        means = self.strategy.mean_(torch.stack([total, *sums.values()]) / max(n, 1))
        return dict(zip(names, means.tolist()))  # host-device sync point (once per evaluation)

    def params_of(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The optimizer's parameters, listed once per optimizer."""
        params = self._params.get(id(optimizer))
        if params is None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self._params[id(optimizer)] = params
        return params
