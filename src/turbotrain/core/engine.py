"""Engine: the single-device speed-ups behind five calls a hand-written loop can make.

    engine = Engine(config)
    model, optimizer, loader = engine.setup(model, optimizer, loader)
    for x, y in loader:
        with engine.autocast():
            loss = model(x, y)
        engine.backward(loss)
        engine.step(optimizer)

Configuration is resolved in ``__init__``/``setup`` into objects (Precision, guard, OOM policy,
clip norm); ``backward`` and ``step`` then run the same few calls every step, with no config reads
and no host-device synchronisation except the guard's poll every ``sync_every`` optimizer steps.

A step's tensor work (forward under the precision, backward, unscale, norm, clipping, the guard's
enqueue, the optimizer step) reads top-down in window.py; the strategy runs a window's micro-batches.
This file keeps the policies and the bookkeeping around it: counters, the guard's poll and the
precision fallback, the OOM policy, events, the compile guard and callbacks. The own-loop API
(``backward`` per micro-batch, ``step``) and ``forward_backward`` (one loader batch, what ``fit``
calls) run the window's pieces one at a time; :meth:`Engine.train_window` runs one whole window
through the body, wrapped once when a whole-step wrapper is set (:meth:`Engine.wrap_window`). The
OOM policy (oom.py) is called only after an out-of-memory error, and acts through the small public
methods ``discard_step``, ``set_split``, ``run_batch`` and ``record_event``; no other module writes
the engine's state.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ContextManager

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..base.batch import batch_size, misplaced, move_to, split_batch, token_count
from ..base.config import PrecisionConfig, RunConfig, load_config, setting
from ..base.errors import ConfigError, NonFiniteError, PlacementError
from ..base.launch import Topology
from ..parts.data.loader import LoaderSettings, resolve_loader_settings, tune_loader
from ..parts.data.prefetch import DevicePrefetcher
from ..parts.models.moe.parallel import GradNormFn
from .compile_guard import CompileGuard
from .distributed import ParallelPlan, Strategy, build_strategy, local_device
from .oom import build_oom_policy, is_oom, oom_reason
from .optim import apply_fast_adam_kernel
from .precision import (
    DeviceCaps,
    NonFiniteGuard,
    Precision,
    apply_backend_switches,
    build_guard,
    build_precision,
)
from .transforms import apply_activation_checkpointing, apply_compile, eager, resolve_scope
from .window import LossFn, MicroBatch, Window, WindowFn, as_loss, default_grad_norm, default_loss

log = logging.getLogger(__name__)

SCHEDULER_INTERVALS = ("step", "epoch", "manual")


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; an explicit CUDA device must exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"run.device = {name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"run.device = {name!r} but no CUDA GPU is visible to torch; use {setting('run.device', 'cpu')} or auto"
        )
    return device


def apply_memory_cap(device: torch.device, fraction: float) -> None:
    """``memory.max_fraction``: cap this process's CUDA caching allocator at ``fraction`` of the
    device (process-wide, for the rest of the process); an allocation past it is an
    out-of-memory error, which the OOM policy handles. 0 = no cap. On other devices it does not
    apply: one log line says so."""
    if fraction <= 0:
        return
    if device.type != "cuda":
        log.info(
            "memory.max_fraction = %g does not apply on %s (it caps the CUDA caching allocator); training runs uncapped",
            fraction,
            device.type,
        )
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(float(fraction), index)
    log.info(
        "memory.max_fraction: this process may hold at most %g of cuda:%d's memory; past it allocations fail "
        "as out-of-memory (memory.on_oom applies)",
        fraction,
        index,
    )


@dataclass
class TrainState:
    """Progress counters (host integers, never synced from the device)."""

    step: int = 0  # optimizer steps taken (a skipped non-finite step counts: the schedule moves on)
    micro_step: int = 0  # forward/backward passes
    batches: int = 0  # loader batches consumed by forward_backward: the data position
    samples: int = 0
    tokens: int = 0


@dataclass
class Event:
    """Something that changed how the run trains (precision fallback, OOM recovery)."""

    step: int
    kind: str
    detail: str


@dataclass
class EngineOptions:
    """What the engine needs from a RunConfig, resolved once."""

    device: torch.device
    precision: str
    # the [precision] section, for the plugins' own fields
    precision_settings: PrecisionConfig = PrecisionConfig()
    tf32: bool = True
    cudnn_benchmark: bool = True
    flush_denormal: bool = True
    deterministic: bool = False
    memory_max_fraction: float = 0.0  # CUDA: the caching allocator's cap, a fraction of the device (0 = none)
    compile_scope: str = "off"
    compile_mode: str = "default"
    max_recompiles: int = 2  # after the first sync_every steps, before the compile guard warns
    accumulation: int = 1
    grad_clip: float = 0.0
    nonfinite: str = "fallback"
    max_nonfinite_steps: int = 3
    # optimizer steps between guard reads: the monitor's logging cadence, so both share one sync
    sync_every: int = 10
    track_grad_norm: bool = False
    device_prefetch: bool = True
    checkpointing: str = "off"
    on_oom: str = "halve"
    inject_oom_at_step: int = 0
    tune_user_optimizer: bool = False  # engine.setup switches an Adam/AdamW to the fused kernel in place
    tune_user_loader: LoaderSettings | None = None  # engine.setup rebuilds a DataLoader with these settings

    plan: ParallelPlan = ParallelPlan(Topology())  # how the run spreads over processes (one process: this)

    @classmethod
    def from_config(cls, config: RunConfig, plan: ParallelPlan | None = None) -> EngineOptions:
        """The engine's options from ``config``; ``plan`` is the run's parallel plan when the caller
        resolved it already (once per process), else it is resolved here."""
        plan = plan or ParallelPlan.resolve(config.distributed)
        device = local_device(resolve_device(config.run.device), plan.topology)
        return cls(
            device=device,
            precision=config.precision.mode,
            precision_settings=config.precision,
            tf32=config.precision.tf32,
            cudnn_benchmark=config.precision.cudnn_benchmark,
            flush_denormal=config.precision.flush_denormal,
            deterministic=config.run.deterministic,
            memory_max_fraction=config.memory.max_fraction,
            compile_scope=resolve_scope(config.compile.scope, device),
            compile_mode=config.compile.mode,
            max_recompiles=config.compile.max_recompiles,
            accumulation=config.batch.accumulation,
            grad_clip=config.optim.grad_clip,
            nonfinite=config.precision.nonfinite,
            max_nonfinite_steps=config.precision.max_nonfinite_steps,
            sync_every=config.monitor.log_every,
            track_grad_norm=config.monitor.grad_norm,
            device_prefetch=config.data.device_prefetch,
            checkpointing=config.memory.checkpointing,
            on_oom=config.memory.on_oom,
            inject_oom_at_step=config.memory.inject_oom_at_step,
            tune_user_optimizer=config.optim.tune_user_optimizer,
            tune_user_loader=resolve_loader_settings(
                device, config.data.num_workers, config.data.pin_memory, config.data.prefetch_factor
            )
            if config.data.tune_user_loader
            else None,
            plan=plan,
        )


class Engine:
    """Device placement, precision, compile, accumulation, clipping and the non-finite guard.

    ``config`` may be a :class:`RunConfig`, a mapping of overrides such as
    ``{"precision": {"mode": "bf16-mixed"}, "batch": {"accumulation": 4}}``, or None (defaults).
    ``precision`` (a registered name, or a :class:`~turbotrain.core.precision.Precision` object such as
    your own plugin) replaces ``precision.mode``. ``plan``: the run's
    :class:`~turbotrain.core.distributed.ParallelPlan` when the caller resolved it (``turbotrain
    train`` does, once per process); else ``distributed.*`` is resolved against the launch here.
    """

    def __init__(
        self,
        config: RunConfig | Mapping[str, Mapping[str, Any]] | None = None,
        *,
        precision: str | Precision | None = None,
        plan: ParallelPlan | None = None,
    ) -> None:
        if config is None or isinstance(config, Mapping):
            config = load_config(overrides=config or {})
        self.options = opts = EngineOptions.from_config(config, plan)
        self.device = opts.device
        self.caps = DeviceCaps.of(self.device)
        chosen = opts.precision if precision is None else precision
        plugin = build_precision(chosen, self.device, self.caps, opts.precision_settings)
        # the switches as applied (tf32, cudnn_benchmark, deterministic), for the run's summary
        self.switches = apply_backend_switches(
            self.device,
            tf32=opts.tf32,
            cudnn_benchmark=opts.cudnn_benchmark,
            flush_denormal=opts.flush_denormal,
            deterministic=opts.deterministic,
        )
        apply_memory_cap(self.device, opts.memory_max_fraction)
        self.strategy: Strategy = build_strategy(opts.plan, self.device)
        # world > 1: stop, never halve alone
        self.oom_policy = build_oom_policy(opts.on_oom, self.strategy.rank, self.strategy.world)
        self.base_accumulation = opts.accumulation  # micro-batches per optimizer step as configured
        self.split = 1  # parts each loader batch is cut into (doubled by the OOM policy)
        # = base_accumulation x split: backward passes per optimizer step
        self.accumulation = opts.accumulation
        self.pending_micro_steps = 0  # backward passes since the last optimizer step
        self.state = TrainState()
        self.events: list[Event] = []
        # engine.log: name -> (sum on the device, count)
        self._logged: dict[str, tuple[torch.Tensor, int]] = {}
        self._aux_modules: list[Any] = []  # modules whose auxiliary loss backward adds (see setup)
        # the step's tensor work (window.py); precision, guard and grad norm live there, read through properties
        self.window = Window(
            plugin,
            self.strategy,
            build_guard(self.device),
            self.device,
            grad_clip=opts.grad_clip,
            norm_needed=opts.grad_clip > 0 or opts.track_grad_norm,
            aux_modules=self._aux_modules,
        )
        # the body train_window calls: wrapped once by wrap_window
        self._run_window: WindowFn = self.window.run
        self.scheduler: Any = None
        self.last_loss: torch.Tensor | None = None  # mean loss of the last optimizer step, on device
        self.last_grad_norm: torch.Tensor | None = None  # its global gradient norm, on device (when computed)
        self._scheduler_per_step = False
        self._after_step: list[Callable[[], None]] = []  # see add_step_callback
        self._step_modules: list[Any] = []  # modules told of each optimizer step (see setup)
        self._inject_oom_at_step = opts.inject_oom_at_step
        self._loss_sum: torch.Tensor | None = None
        self._models: list[nn.Module] = []
        self._placement_checked = False
        self._nonfinite_acted = 0  # guard count when the policy last acted
        self._nonfinite_logged = 0  # guard count when skips were last logged
        # torch.compile's recompilations and graph breaks, read at each poll (host counters, no sync)
        self.compile_guard = CompileGuard(opts.max_recompiles, warmup_steps=opts.sync_every)

    @property
    def precision(self) -> Precision:
        """The precision plugin the window runs under (replaced by a fallback)."""
        return self.window.precision

    @precision.setter
    def precision(self, precision: Precision) -> None:
        self.window.precision = precision

    @property
    def guard(self) -> NonFiniteGuard:
        """The non-finite guard the window enqueues each step's check into; the engine polls it."""
        return self.window.guard

    @guard.setter
    def guard(self, guard: NonFiniteGuard) -> None:
        self.window.guard = guard

    @property
    def _norm_needed(self) -> bool:
        return self.window.norm_needed

    # ------------------------------------------------------------------ build time

    def setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        loader: Iterable[Any] | None = None,
        scheduler: Any = None,
        scheduler_interval: str | None = None,
    ) -> tuple[nn.Module, torch.optim.Optimizer | None, Iterable[Any] | None]:
        """Move ``model`` to the device, cast it for 'true' precisions, compile it, and wrap
        ``loader`` so each batch arrives on the device (prefetched on a side stream on CUDA).

        A ``scheduler`` needs ``scheduler_interval``: ``'step'`` (the engine steps it after each
        optimizer step), ``'epoch'`` (``end_epoch()`` steps it) or ``'manual'`` (your loop steps it,
        as before; the engine only saves it with its state).

        Call before the first step. Parameters keep their identity, so an optimizer built
        before ``setup`` stays valid.

        Submodules with ``follow_optimizer_steps()`` (a MoE layer's router bias, which moves once
        per optimizer step) are told here that the engine marks the steps: it then calls their
        ``end_optimizer_step()`` after every optimizer step (taken or skipped) and their
        ``discard_optimizer_step()`` when the out-of-memory policy drops a partial one.

        Submodules with ``take_aux_loss()`` (a :class:`turbotrain.MoE` layer's load-balancing
        loss) are found here too: ``backward`` adds what each returns (a tensor, or None) to the
        loss, so a model with MoE layers trains with their auxiliary loss without adding it.
        """
        if scheduler is not None and scheduler_interval not in SCHEDULER_INTERVALS:
            raise ConfigError(
                f"scheduler_interval = {scheduler_interval!r}: say how the scheduler steps, "
                "engine.setup(..., scheduler=s, scheduler_interval='step' | 'epoch' | 'manual')"
            )
        if not self._models:
            self.compile_guard.start()  # count what this run compiles, not what the process did before
        for module in model.modules():  # once, before any wrapper: the module objects stay the same
            if callable(getattr(module, "follow_optimizer_steps", None)) and module not in self._step_modules:
                module.follow_optimizer_steps()
                self._step_modules.append(module)
            if callable(getattr(module, "take_aux_loss", None)) and module not in self._aux_modules:
                self._aux_modules.append(module)
        model.to(self.device)
        # fp8 prepares its float8 all-gather for FSDP2
        self.precision.convert_module(model, sharded=self.strategy.plan.sharded)
        # optim.tune_user_optimizer: before any wrapper
        if optimizer is not None and self.options.tune_user_optimizer:
            self._log_tuning("optim.tune_user_optimizer", apply_fast_adam_kernel(optimizer, self.device))
        apply_activation_checkpointing(model, self.options.checkpointing)
        apply_compile(model, self.options.compile_scope, self.options.compile_mode)
        model = self.strategy.wrap(
            model, optimizer, self.precision.compute_dtype, self.precision.reduce_dtype
        )
        # experts spread over ranks: clip by the norm over all of them
        if self.strategy.grad_norm is not None:
            self.set_grad_norm(self.strategy.grad_norm)
        self._models.append(model)
        self._sync_grads_for_next()
        self.scheduler = scheduler
        self.scheduler_interval = scheduler_interval if scheduler is not None else "manual"
        self._scheduler_per_step = self.scheduler_interval == "step"
        if (
            loader is not None
            and self.options.tune_user_loader is not None
            and not isinstance(loader, DevicePrefetcher)
        ):
            loader = self._tuned_loader(loader, self.options.tune_user_loader)
        return model, optimizer, self.setup_loader(loader) if loader is not None else None

    def _tuned_loader(self, loader: Iterable[Any], settings: LoaderSettings) -> Iterable[Any]:
        """``data.tune_user_loader``: a torch DataLoader rebuilt with the data section's settings;
        any other iterable is kept (one log line says why)."""
        if not isinstance(loader, DataLoader):
            log.warning(
                "data.tune_user_loader: the loader is a %s, not a torch DataLoader; it is used as it is",
                type(loader).__name__,
            )
            return loader
        tuned = tune_loader(loader, settings)
        self._log_tuning(
            "data.tune_user_loader",
            f"DataLoader: num_workers {loader.num_workers} -> {tuned.num_workers}, "
            f"pin_memory {loader.pin_memory} -> {tuned.pin_memory}, persistent_workers "
            f"{loader.persistent_workers} -> {tuned.persistent_workers}",
        )
        return tuned

    def _log_tuning(self, switch: str, change: str | None) -> None:
        log.info(
            "%s: %s",
            switch,
            change or "left as it is (not a plain torch.optim.Adam/AdamW, or already that kernel)",
        )

    def setup_loader(self, loader: Iterable[Any]) -> DevicePrefetcher:
        """Wrap ``loader`` so each batch arrives on the device (side-stream prefetch on CUDA) and
        is counted (samples, tokens) for throughput as it is handed out."""
        if isinstance(loader, DevicePrefetcher):
            return loader
        return DevicePrefetcher(
            loader, self.device, side_stream=self.options.device_prefetch, on_batch=self.count_batch
        )

    # ------------------------------------------------------------------ hot path

    def autocast(self) -> ContextManager[Any]:
        """Mixed-precision context for forward passes (training and evaluation)."""
        return self.precision.autocast()

    def backward(self, loss: Any) -> None:
        """Backward of ``loss / accumulation`` (scaled for fp16); the loss is kept on the device.
        ``loss`` may be a model's output (see :func:`as_loss`). A rejected loss changes nothing.
        The auxiliary losses of the model's MoE layers from their last training forward are
        added (see ``setup``); the recorded loss includes them, as a MoE GPT's own loss does."""
        loss = self.window.add_aux(as_loss(loss))
        if not self._placement_checked:
            self._check_placement()
        detached = self.window.backward(loss, self.accumulation)
        self._loss_sum = detached if self._loss_sum is None else self._loss_sum + detached
        self.state.micro_step += 1
        self.pending_micro_steps += 1
        self._sync_grads_for_next()

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """On the accumulation boundary: unscale, clip, step (skipped on-device if non-finite),
        update the loss scale, zero gradients (set_to_none), advance the scheduler. Returns
        True when an optimizer step was taken, False between accumulation boundaries."""
        if self.pending_micro_steps < self.accumulation:
            return False
        return self._optimizer_step(optimizer)

    def end_epoch(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Call after the last batch of an epoch: a partial accumulation window (fewer backward
        passes than ``accumulation``) is applied as a step of its own, its gradients renormalised
        to the passes it had (so it is the mean over its batches, like a full window); then an
        ``'epoch'``-interval scheduler steps. Returns True when a partial step was taken."""
        took = False
        if optimizer is not None and self.pending_micro_steps:
            grads = [p.grad for p in self._params_of(optimizer) if p.grad is not None]
            if grads and self.pending_micro_steps != self.accumulation:
                torch._foreach_mul_(grads, self.accumulation / self.pending_micro_steps)
            took = self._optimizer_step(optimizer)
        if self.scheduler is not None and self.scheduler_interval == "epoch":
            self.scheduler.step()
        return took

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        micro_steps, self.pending_micro_steps = self.pending_micro_steps, 0
        loss_sum, self.last_grad_norm = self.window.finish(optimizer, self._loss_sum)
        return self._end_step(optimizer, loss_sum, micro_steps)

    def _end_step(self, optimizer: torch.optim.Optimizer, loss_sum: torch.Tensor, micro_steps: int) -> bool:
        """The bookkeeping after a window's optimizer step: MoE step modules, the scheduler, the
        step's mean loss and counter, the guard's poll and the compile guard every ``sync_every``
        steps, the step callbacks."""
        for module in self._step_modules:
            module.end_optimizer_step()
        if self._scheduler_per_step:
            self.scheduler.step()
        self.last_loss = loss_sum if micro_steps == 1 else loss_sum / micro_steps
        self._loss_sum = None
        self.state.step += 1
        if self.state.step % self.options.sync_every == 0:
            self.poll(optimizer)
            self.compile_guard.check(self.state.step)
        for callback in self._after_step:
            callback()
        return True

    def set_grad_norm(self, fn: GradNormFn | None) -> None:
        """Use ``fn(params) -> norm`` for the global gradient norm that clipping divides by and
        ``last_grad_norm`` reports: ``params`` are the optimizer's parameters (it reads their
        ``.grad``), the result a 0-dim tensor on the device, the same on every rank, computed
        without a host sync. For gradients the engine cannot see whole (``setup`` sets it when
        the parallel plan spreads experts over ranks: each rank holds some experts'). None
        restores the default, :func:`default_grad_norm`."""
        self.window.grad_norm = fn if fn is not None else default_grad_norm

    def add_step_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every optimizer step (monitoring an own loop: see
        ``turbotrain.app.tracking.track``). It must not read device values every step."""
        self._after_step.append(callback)

    def forward_backward(self, model: nn.Module, batch: Any, loss_fn: LossFn = default_loss) -> torch.Tensor:
        """One loader batch of the reference loop: forward under autocast, then backward. After an
        out-of-memory error the OOM policy takes over (``memory.on_oom``: halve and re-run, or stop)."""
        if self.state.batches == 0:
            self._check_batch(batch)
        self.oom_policy.remember(batch, new_step=self.pending_micro_steps == 0)
        reason = ""
        try:
            loss = self.run_batch(model, batch, loss_fn)
        except RuntimeError as exc:
            if not is_oom(exc):
                raise
            reason = oom_reason(exc)
        if reason:  # outside the except clause: the traceback, and the activations its frames held, are gone
            loss = self.oom_policy.recover(self, model, batch, loss_fn, reason)
        self.state.batches += 1
        return loss

    def train_window(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batches: Sequence[Any],
        loss_fn: LossFn = default_loss,
    ) -> bool:
        """One optimizer step over ``batches`` (``accumulation`` loader batches, on the device): the
        step ``forward_backward`` on each and then ``step`` take, run as one window body
        (:meth:`Window.run`, through the wrapper of :meth:`wrap_window`). After an out-of-memory
        error the OOM policy re-runs the window's batches as in ``forward_backward``. Returns True."""
        if self.pending_micro_steps:
            raise RuntimeError(
                f"train_window starts an optimizer step, but {self.pending_micro_steps} backward pass(es) "
                "are pending: call engine.step(optimizer) first"
            )
        if len(batches) != self.base_accumulation:
            raise ValueError(
                f"train_window takes one optimizer step's {self.base_accumulation} loader batch(es) "
                f"(batch.accumulation), got {len(batches)}"
            )
        if self.state.batches == 0:
            self._check_batch(batches[0])
        if not self._placement_checked:
            self._check_placement()
        for i, batch in enumerate(batches):
            self.oom_policy.remember(batch, new_step=i == 0)
        micro = self._micro_batches(batches)
        run_loss = self._oom_after_forward(loss_fn, len(micro)) if self._injecting_oom() else loss_fn
        reason = ""
        try:
            loss_sum, norm = self._run_window(model, optimizer, micro, run_loss, self.accumulation)
        except RuntimeError as exc:
            if not is_oom(exc):
                raise
            reason = oom_reason(exc)
        self.state.batches += len(batches)
        # outside the except clause, as in forward_backward; the policy re-runs the batches one by one
        if reason:
            self.oom_policy.recover(self, model, batches[-1], loss_fn, reason)
            return self._optimizer_step(optimizer)
        self.state.micro_step += len(micro)
        self.last_grad_norm = norm
        self._sync_grads_for_next()  # the own-loop API's flags, as after a window's last backward
        return self._end_step(optimizer, loss_sum, len(micro))

    def wrap_window(self, wrapper: Callable[[WindowFn], WindowFn] | None) -> None:
        """From now on :meth:`train_window` runs ``wrapper(body)``, where ``body`` is
        :meth:`Window.run` (the step's tensor work, no host sync): the one place whole-step capture
        (CUDA graphs) goes. The wrapper returns a function of the same arguments with the same
        effect (capture once, then replay). None: the plain body again."""
        self._run_window = wrapper(self.window.run) if wrapper is not None else self.window.run

    def _micro_batches(self, batches: Sequence[Any]) -> list[MicroBatch]:
        """A window's micro-batches: each loader batch whole, or in ``split`` parts after an OOM,
        each part's loss weighted by its share of the batch x ``split`` (as in :meth:`run_batch`)."""
        if self.split == 1:
            return [(batch, 1.0) for batch in batches]
        micro: list[MicroBatch] = []
        for batch in batches:
            n = batch_size(batch)
            micro.extend((part, batch_size(part) / n * self.split) for part in split_batch(batch, self.split))
        return micro

    def run_batch(self, model: nn.Module, batch: Any, loss_fn: LossFn = default_loss) -> torch.Tensor:
        """Forward under autocast and backward of one loader batch, in ``split`` parts (one
        unless an out-of-memory error halved the micro-batch); returns the batch's loss."""
        if self.split == 1:
            loss = self.window.forward(model, batch, loss_fn)
            self._maybe_inject_oom()
            self.backward(loss)
            return loss
        n = batch_size(batch)
        total: torch.Tensor | None = None
        for part in split_batch(batch, self.split):
            loss = self.window.forward(model, part, loss_fn)
            share = batch_size(part) / n
            weight = share * self.split  # 1.0 for equal parts
            self._maybe_inject_oom()
            self.backward(loss if weight == 1.0 else loss * weight)
            piece = loss.detach() * share
            total = piece if total is None else total + piece
        assert total is not None
        return total

    def count_batch(self, batch: Any) -> None:
        """Add a batch's samples and tokens (from shapes, no sync) to the state; any structure.
        The loader from ``setup`` calls it for each batch; call it yourself only for batches that
        do not come through that loader."""
        self.state.samples += batch_size(batch)
        self.state.tokens += token_count(batch)

    def micro_batch(self, batch: Any) -> int:
        """Samples per forward/backward for ``batch`` at the current split."""
        return -(-batch_size(batch) // self.split)

    # ------------------------------------------------------------------ OOM policy's levers

    def discard_step(self, model: nn.Module) -> None:
        """Forget the partial optimizer step (gradients, loss sum, its micro-steps) and free memory."""
        model.zero_grad(set_to_none=True)
        for module in self._step_modules:
            module.discard_optimizer_step()
        self.state.micro_step -= self.pending_micro_steps
        self.pending_micro_steps = 0
        self._loss_sum = None
        self._sync_grads_for_next()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def set_split(self, split: int) -> None:
        """Cut each loader batch into ``split`` parts; accumulation follows, so the global batch stays."""
        self.split = split
        self.accumulation = self.base_accumulation * split
        self._sync_grads_for_next()

    def set_accumulation(self, accumulation: int) -> None:
        """Micro-batches per optimizer step (the batch finder sets it to keep the global batch)."""
        if accumulation < 1:
            raise ConfigError(f"batch.accumulation = {accumulation} must be >= 1")
        self.base_accumulation = accumulation
        self.accumulation = accumulation * self.split
        self._sync_grads_for_next()

    def _sync_grads_for_next(self) -> None:
        """Data parallel: reduce gradients across ranks only in the backward that completes an
        accumulation window (once per optimizer step); the micro-steps before it accumulate locally."""
        sync = self.pending_micro_steps % self.accumulation + 1 == self.accumulation
        for model in self._models:
            self.strategy.set_grad_sync(model, sync)

    def record_event(self, kind: str, detail: str, step: int | None = None) -> None:
        """Note something that changed how the run trains (goes to summary.json)."""
        self.events.append(Event(self.state.step if step is None else step, kind, detail))

    def _maybe_inject_oom(self) -> None:
        """``memory.inject_oom_at_step = N``: a real OutOfMemoryError once, in the last micro-step
        of optimizer step N (after its forward), to test recovery end to end."""
        if self._injecting_oom() and self.pending_micro_steps + 1 >= self.accumulation:
            self._raise_injected_oom()

    def _injecting_oom(self) -> bool:
        return bool(self._inject_oom_at_step) and self.state.step + 1 == self._inject_oom_at_step

    def _raise_injected_oom(self) -> None:
        step, self._inject_oom_at_step = self._inject_oom_at_step, 0  # once
        raise torch.OutOfMemoryError(
            f"injected out-of-memory error in step {step} (memory.inject_oom_at_step = {step})"
        )

    def _oom_after_forward(self, loss_fn: LossFn, n: int) -> LossFn:
        """``_maybe_inject_oom`` in a whole window: the error after its last (``n``-th) forward."""
        calls = [0]

        def loss_then_oom(model: nn.Module, batch: Any) -> Any:
            out = loss_fn(model, batch)
            calls[0] += 1
            if calls[0] == n:
                self._raise_injected_oom()
            return out

        return loss_then_oom

    def synchronize(self) -> None:
        """Wait for queued device work (host-device sync point; for timing only)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ guard

    def poll(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Read the non-finite counter (host-device sync point) and apply the policy."""
        count = self.guard.poll()
        new = count - self._nonfinite_acted
        if new <= 0:
            return
        opts = self.options
        if count > self._nonfinite_logged:  # once per new skip, not again at every poll
            log.warning(
                "%d non-finite step(s) skipped by step %d (%s)",
                count - self._nonfinite_logged,
                self.state.step,
                self.precision.name,
            )
            self._nonfinite_logged = count
        if opts.nonfinite == "skip" or new < opts.max_nonfinite_steps:
            return
        where = f"{count} non-finite loss/gradient steps by step {self.state.step} in {self.precision.name}"
        if opts.nonfinite == "stop":
            raise NonFiniteError(
                f"{where}; lower optim.lr, check the data, or use {setting('precision.nonfinite', 'fallback')}"
            )
        target = self.precision.fallback_for(self.caps)
        if target is None:
            raise NonFiniteError(
                f"{where}, and there is no safer precision to fall back to; lower optim.lr or check the data"
            )
        self.switch_precision(target, optimizer)
        self._nonfinite_acted = count

    def switch_precision(self, mode: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Change precision mid-run (fallback): new autocast/scaler, weights and state cast back up."""
        old = self.precision
        self.precision = build_precision(mode, self.device, self.caps, self.options.precision_settings)
        # layer swaps (fp8's float8 linears) undone: the parameters stay the same objects
        for model in self._models:
            old.revert_module(model)
        if old.param_dtype != self.precision.param_dtype:
            for model in self._models:
                model.to(self.precision.param_dtype)
            if optimizer is not None:
                for state in optimizer.state.values():
                    for key, value in state.items():
                        if torch.is_tensor(value) and value.is_floating_point() and key != "step":
                            state[key] = value.to(self.precision.param_dtype)
        detail = f"{old.name} -> {mode} after {self.guard.seen} non-finite steps"
        log.warning("precision fallback: %s", detail)
        self.record_event("precision_fallback", detail)

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def log(self, name: str, value: torch.Tensor | float) -> None:
        """Log a scalar of your own (a training accuracy, a loss term) without a host sync: it stays
        on the device, summed until the Monitor's next record (every ``monitor.log_every`` steps),
        which reads the mean since the last one as ``train_<name>`` (metrics.jsonl, the progress
        line, summary.json's ``final_train_<name>``, plots/metrics.png)."""
        t = value.detach().float().mean() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        total, count = self._logged.get(name, (None, 0))
        self._logged[name] = (t if total is None else total + t.to(total.device), count + 1)

    def take_logged(self) -> dict[str, torch.Tensor]:
        """The means of :meth:`log`'s values since the last call, as device tensors (``train_<name>``),
        and start over; the caller reads them (a host-device sync point, at its logging steps)."""
        logged, self._logged = self._logged, {}
        return {f"train_{name}": total / count for name, (total, count) in logged.items()}

    def evaluate(self, model: nn.Module, batches: Iterable[Any], loss_fn: LossFn = default_loss) -> float:
        """Mean loss over ``batches`` under autocast and no_grad (one sync, at the end). A compiled
        model evaluates eagerly (:func:`turbotrain.core.transforms.eager`): its training graph stays
        the only one, and no eval-mode graph is compiled for a few batches."""
        return self.evaluate_metrics(model, batches, loss_fn)["loss"]

    def evaluate_metrics(
        self,
        model: nn.Module,
        batches: Iterable[Any],
        loss_fn: LossFn = default_loss,
        metrics_fn: Callable[[nn.Module, Any], Mapping[str, torch.Tensor]] | None = None,
    ) -> dict[str, float]:
        """:meth:`evaluate`'s mean loss (``"loss"``) and, with ``metrics_fn(model, batch)`` (e.g.
        ``{"accuracy": (logits.argmax(1) == y).float().mean()}``), the mean of each metric over
        ``batches``; summed on the device, averaged over the ranks, read once at the end."""
        was_training = model.training
        model.eval()
        total, n = torch.zeros((), device=self.device), 0
        sums: dict[str, torch.Tensor] = {}
        with self.autocast(), eager():
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

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "state": asdict(self.state),
            "precision_name": self.precision.name,
            "precision": self.precision.state_dict(),
            "guard": self.guard.state_dict(),
            "nonfinite_acted": self._nonfinite_acted,
            "events": [asdict(e) for e in self.events],
            "batch_runner": {"split": self.split, "inject_at_step": self._inject_oom_at_step},
        }

    def load_state_dict(self, sd: Mapping[str, Any], optimizer: torch.optim.Optimizer | None = None) -> None:
        self.state = TrainState(**sd["state"])
        fell_back = any(e.get("kind") == "precision_fallback" for e in sd.get("events", []))
        if fell_back and sd.get("precision_name") and sd["precision_name"] != self.precision.name:
            # A fallback happened before the save: keep training in the safer precision. (A
            # precision the user changed for the resume, with no fallback, is kept.) Call this
            # before loading the weights, so that a cast back up happens before they load.
            self.switch_precision(sd["precision_name"], optimizer)
            self.events.pop()
        self.precision.load_state_dict(sd.get("precision", {}))
        self.guard.load_state_dict(sd.get("guard", {}))
        self._nonfinite_acted = int(sd.get("nonfinite_acted", 0))
        self._nonfinite_logged = self.guard.seen
        self.events = [Event(**e) for e in sd.get("events", [])]
        oom = sd.get("batch_runner", {})
        self._inject_oom_at_step = int(oom.get("inject_at_step", self._inject_oom_at_step))
        self.set_split(int(oom.get("split", 1)))  # a micro-batch halved after an OOM stays halved

    # ------------------------------------------------------------------ checks

    def _params_of(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return self.window.params_of(optimizer)

    def _check_placement(self) -> None:
        """Once, at the first backward: every parameter and buffer on the engine's device."""
        self._placement_checked = True
        wrong = [
            f"{name} ({t.device})"
            for model in self._models
            for name, t in [*model.named_parameters(), *model.named_buffers()]
            if t.device.type != self.device.type
        ]
        if wrong:
            raise PlacementError(
                f"{len(wrong)} tensor(s) not on {self.device}: {', '.join(wrong[:5])}; "
                "create every submodule before engine.setup(model, ...) so it is moved"
            )

    def _check_batch(self, batch: Any) -> None:
        wrong = misplaced(batch, self.device)
        if wrong:
            raise PlacementError(
                f"{', '.join(wrong[:5])} not on {self.device}; pass the loader to engine.setup(...) so batches are moved"
            )
