"""One optimizer step's tensor work, top-down: the window body.

A *window* is the micro-batches of one optimizer step. Its tensor work, in order:

    Window.run(model, optimizer, micro_batches, loss_fn, accumulation)    the pure body
      strategy.run_window(...)       the micro-batches: single/DDP/FSDP loop over them, gradients
                                     reduced across ranks in the last one's backward only (a
                                     pipeline strategy would run its schedule here instead)
        micro_step -> forward        the model under the precision's autocast, its scalar loss
                   -> backward       + the MoE layers' auxiliary losses, / accumulation, loss-scaled
      finish(optimizer, loss_sum)    unscale, the loss averaged over ranks, the gradient norm over
                                     the plan's groups, clipping, the non-finite guard's enqueue,
                                     the precision's optimizer step, the scale update, zero grads

Nothing here reads configuration, counts steps, polls the guard or handles errors: the Engine
(engine.py) keeps those policies and the bookkeeping around the body, and its own-loop API calls
the same pieces one at a time (``backward`` per micro-batch, ``finish`` at ``step``). Because the
body is one function of tensors with no host-device sync, whole-step capture (CUDA graphs) is one
wrapper around :meth:`Window.run` (:meth:`turbotrain.core.engine.Engine.wrap_window`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..base.errors import LossError
from ..parts.models.moe.parallel import GradNormFn
from ..parts.models.spec import LossFn  # the one definition of (model, batch) -> loss
from .precision.core import NonFiniteGuard, Precision  # the class's own module: one import level less

if TYPE_CHECKING:  # the window calls the strategy it is given; it builds none
    from .distributed import Strategy

# (a batch or a part of one, the weight of its loss: 1.0 for whole, equal parts)
MicroBatch = tuple[Any, float]
WindowFn = Callable[
    [nn.Module, torch.optim.Optimizer, Sequence[MicroBatch], LossFn, int],
    tuple[torch.Tensor, torch.Tensor | None],
]
"""The signature of :meth:`Window.run` (and of a whole-step wrapper's result): (model, optimizer,
micro-batches, loss_fn, accumulation) -> (the window's loss sum averaged over ranks, its gradient norm)."""


def as_loss(output: Any) -> torch.Tensor:
    """The scalar loss in what a model or loss function returned: a 0-d tensor itself, a tuple's
    or list's first element, a mapping's or a Hugging Face ``ModelOutput``'s ``loss``. Shape checks
    only (no sync); anything else is one error that says what came back and what to pass."""
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
    """``model(**batch)`` for a mapping (Hugging Face style), ``model(*batch)`` for a tuple or list,
    else ``model(batch)``; the output may be the loss, a tuple starting with it or have ``.loss``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(*batch) if isinstance(batch, (tuple, list)) else model(batch)


def default_grad_norm(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm over the gradients of ``params`` as this process holds them (whole, or
    replicated by data parallelism; FSDP2's DTensor shards give a DTensor the strategy makes whole)."""
    return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None], foreach=True)


class Window:
    """The tensor work of one optimizer step, built once by the Engine from resolved objects.

    ``precision`` and ``grad_norm`` are replaced by the Engine (a precision fallback,
    ``set_grad_norm``); ``aux_modules`` is the Engine's list of modules with ``take_aux_loss``.
    """

    def __init__(
        self,
        precision: Precision,
        strategy: Strategy,
        guard: NonFiniteGuard,
        device: torch.device,
        *,
        grad_clip: float = 0.0,
        norm_needed: bool = False,
        aux_modules: list[Any] | None = None,
    ) -> None:
        self.precision = precision
        self.strategy = strategy
        self.guard = guard
        self.device = device
        self.grad_clip = grad_clip
        self.norm_needed = norm_needed  # clipping or monitor.grad_norm: compute the norm each step
        self.grad_norm: GradNormFn = default_grad_norm
        self.aux_modules: list[Any] = aux_modules if aux_modules is not None else []
        self._params: dict[int, list[torch.Tensor]] = {}

    # ------------------------------------------------------------------ the pure body

    def run(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        micro_batches: Sequence[MicroBatch],
        loss_fn: LossFn,
        accumulation: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step over ``micro_batches``: each one's forward and backward (the
        strategy runs them; gradients reduced across ranks in the last one's backward), then
        :meth:`finish`. Returns the loss sum averaged over ranks and the gradient norm, on the
        device; no host-device sync (what whole-step capture needs)."""

        def micro_step(micro_batch: MicroBatch) -> torch.Tensor:
            batch, weight = micro_batch
            loss = self.forward(model, batch, loss_fn)
            return self.backward(self.add_aux(loss if weight == 1.0 else loss * weight), accumulation)

        loss_sum: torch.Tensor | None = None
        for detached in self.strategy.run_window([model], micro_batches, micro_step):
            loss_sum = detached if loss_sum is None else loss_sum + detached
        return self.finish(optimizer, loss_sum)

    # ------------------------------------------------------------------ its pieces (the own-loop API calls them)

    def forward(self, model: nn.Module, batch: Any, loss_fn: LossFn) -> torch.Tensor:
        """The scalar loss of ``batch`` under the precision's autocast."""
        with self.precision.autocast():
            return as_loss(loss_fn(model, batch))

    def add_aux(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` plus the auxiliary losses of the model's MoE layers from their last forward."""
        for module in self.aux_modules:
            aux = module.take_aux_loss()
            if aux is not None:
                loss = loss + aux
        return loss

    def backward(self, loss: torch.Tensor, accumulation: int) -> torch.Tensor:
        """Backward of ``loss / accumulation`` (loss-scaled by the precision); returns ``loss``
        detached, to be summed for the step's mean."""
        scaled = loss / accumulation if accumulation > 1 else loss
        self.precision.scale_loss(scaled).backward()
        return loss.detach()

    def finish(
        self, optimizer: torch.optim.Optimizer, loss_sum: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Unscale, average the loss over ranks, the norm and clipping, the guard's enqueue, the
        precision's optimizer step (skipped on the device when non-finite), the scale update and
        zeroing the gradients. Returns (the loss sum averaged over ranks, the whole gradient norm)."""
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
                # A fused optimizer divides by grad_scale inside its kernel: clipping without a
                # pass that rewrites every gradient (clip_grad_norm_'s factor, with its epsilon).
                # fp32, as the kernel takes it
                grad_scale = torch.clamp((norm.float() + 1e-6) / clip, min=1.0)
            elif clip > 0:  # clip_grad_norm_'s math, with the norm above
                torch.nn.utils.clip_grads_with_norm_(params, clip, norm, foreach=True)
        norm = self.strategy.full(norm) if norm is not None else None
        # Under fp16 an overflow in the scaled gradients is the GradScaler's business (it skips the
        # step and lowers the scale, and does so by design every growth interval): only a
        # non-finite loss counts towards the fallback there.
        finite = self.guard.check(loss_sum, norm if self.precision.scaler is None else None)
        self.precision.optimizer_step(optimizer, finite, grad_scale)
        self.precision.update()
        optimizer.zero_grad(set_to_none=True)
        return loss_sum, norm

    def params_of(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The optimizer's parameters, listed once per optimizer."""
        params = self._params.get(id(optimizer))
        if params is None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self._params[id(optimizer)] = params
        return params
