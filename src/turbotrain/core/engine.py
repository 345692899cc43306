"""Engine: the speed-ups behind the few calls a hand-written loop makes (docs/own-loop.md), and the
policies around a step. Configuration is resolved once into objects (precision, strategy, guard, OOM
policy). One optimizer step is one window (window.py), run whole by :meth:`Engine.train_window` or a
piece at a time by the own-loop API; no host-device sync per step except the guard's poll every
``sync_every`` optimizer steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ContextManager

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..base.batch import batch_size, real_tokens
from ..base.config import RunConfig
from ..base.errors import ConfigError
from ..parts.data.loader import LoaderSettings, tune_loader
from ..parts.data.prefetch import DevicePrefetcher
from ..parts.models.moe.parallel import GradNormFn
from .compile_guard import CompileGuard
from .distributed import Strategy, build_strategy
from .graphs import StepGraph
from .meter.clock import sync
from .nonfinite import NonFinitePolicy
from .oom import build_oom_policy, run_guarded, run_guarded_batch
from .optim import apply_fast_adam_kernel
from .options import EngineOptions, scheduler_interval_of
from .plan import ParallelPlan
from .precision.core import (  # the classes' own module: one import level less
    DeviceCaps,
    NonFiniteGuard,
    Precision,
    build_guard,
    build_precision,
)
from .transforms import apply_activation_checkpointing, apply_compile
from .window import LossFn, MetricsFn, Window, WindowFn, as_loss, default_loss, micro_batches

log = logging.getLogger(__name__)


def tune_user_loader(loader: Iterable[Any], settings: LoaderSettings | None) -> Iterable[Any]:
    """``data.tune_user_loader``: a torch DataLoader rebuilt with ``settings`` (None: off; off by default:
    an own loop's objects are its own), in one log line; else the loader as it is."""
    if settings is None or isinstance(loader, DevicePrefetcher):
        return loader
    if not isinstance(loader, DataLoader):
        log.warning(
            "data.tune_user_loader: the loader is a %s, not a torch DataLoader; it is used as it is",
            type(loader).__name__,
        )
        return loader
    tuned = tune_loader(loader, settings)
    change = (
        f"num_workers {loader.num_workers} -> {tuned.num_workers}, pin_memory {loader.pin_memory} -> "
        f"{tuned.pin_memory}, persistent_workers {loader.persistent_workers} -> {tuned.persistent_workers}"
    )
    log.info("data.tune_user_loader: DataLoader: %s", change)
    return tuned


@dataclass
class TrainState:
    """Progress counters (host integers, never synced from the device), saved with the engine's state."""

    step: int = 0  # optimizer steps taken (a skipped non-finite step counts: the schedule moves on)
    micro_step: int = 0  # forward/backward passes
    batches: int = 0  # loader batches consumed by forward_backward / train_window: the data position
    samples: int = 0
    tokens: int = 0

    def count(self, batch: Any) -> None:
        """Add a batch's samples and real tokens (padding left out); no sync for a batch on the host."""
        self.samples += batch_size(batch)
        self.tokens += int(real_tokens(batch))  # host-device sync point only for a mask on a device


@dataclass
class Event:
    """Something that changed how the run trains (precision fallback, OOM recovery)."""

    step: int
    kind: str
    detail: str


class LoggedValues:
    """What a user's loop logs through ``engine.log``: ``name -> (sum on the device, count)`` since the
    last :meth:`take` (no sync per step; read at the monitor's cadence)."""

    def __init__(self) -> None:
        self._sums: dict[str, tuple[torch.Tensor, int]] = {}

    @torch.no_grad()
    def add(self, name: str, value: torch.Tensor | float) -> None:
        """Add ``value`` (a tensor's mean, or a number) to ``name``'s sum; no host sync."""
        t = value.detach().float().mean() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
        total, count = self._sums.get(name, (None, 0))
        self._sums[name] = (t if total is None else total + t.to(total.device), count + 1)

    def take(self) -> dict[str, torch.Tensor]:
        """The means since the last call, as device tensors named ``train_<name>``, and start over."""
        sums, self._sums = self._sums, {}
        return {f"train_{name}": total / count for name, (total, count) in sums.items()}


class Engine:
    """Device placement, precision, compile, accumulation, clipping and the non-finite guard.

    ``config`` may be a :class:`RunConfig`, a mapping of overrides such as
    ``{"precision": {"mode": "bf16-mixed"}, "batch": {"accumulation": 4}}``, or None (defaults).
    ``precision`` (a registered name, or a :class:`~turbotrain.core.precision.Precision` object such as
    your own plugin) replaces ``precision.mode``. ``plan``: the run's
    :class:`~turbotrain.core.plan.ParallelPlan` when the caller resolved it (``turbotrain
    train`` does, once per process); else ``distributed.*`` is resolved against the launch here.
    """

    def __init__(
        self,
        config: RunConfig | Mapping[str, Mapping[str, Any]] | None = None,
        *,
        precision: str | Precision | None = None,
        plan: ParallelPlan | None = None,
    ) -> None:
        self.options = opts = EngineOptions.from_config(config, plan)
        device = opts.device
        self.caps = DeviceCaps.of(device)
        chosen = opts.precision if precision is None else precision
        plugin = build_precision(chosen, device, self.caps, opts.precision_settings)
        self.switches = opts.apply_switches()  # as applied (tf32, cudnn_benchmark, ...), for the summary
        self.strategy: Strategy = build_strategy(opts.plan, device)
        self.oom_policy = build_oom_policy(opts.on_oom, self.strategy.rank, self.strategy.world)
        self.base_accumulation = opts.accumulation  # micro-batches per optimizer step as configured
        self.split = 1  # parts each loader batch is cut into (doubled by the OOM policy)
        self.state = TrainState()
        self.events: list[Event] = []
        self._logged = LoggedValues()  # engine.log's values, summed on the device
        # one optimizer step (window.py): precision, guard, grad norm, the open window live there
        self.window = Window(plugin, self.strategy, build_guard(device), device, **opts.window_args())

        def fallback(mode: str) -> Precision:  # the precision a fallback switches to
            return build_precision(mode, self.device, self.caps, opts.precision_settings)

        self.nonfinite = NonFinitePolicy(
            opts.nonfinite, opts.max_nonfinite_steps, self.window, self.caps, fallback
        )
        self.scheduler: Any = None
        self.scheduler_interval = "manual"
        self.last_loss: torch.Tensor | None = None  # mean loss of the last optimizer step, on device
        self.last_grad_norm: torch.Tensor | None = None  # its global gradient norm, on device (when computed)
        self._after_step: list[Callable[[], None]] = []  # see add_step_callback
        self._step_batches: list[Any] = []  # forward_backward's batches of this step (an OOM re-runs them)
        # torch.compile's recompilations and graph breaks, read at each poll (host counters, no sync)
        self.compile_guard = CompileGuard(opts.max_recompiles, warmup_steps=opts.sync_every)

    @property
    def precision(self) -> Precision:
        """The precision plugin the window runs under (replaced by a fallback)."""
        return self.window.precision

    @precision.setter
    def precision(self, precision: Precision) -> None:
        self.window.set_precision(precision)

    @property
    def guard(self) -> NonFiniteGuard:
        """The non-finite guard the window enqueues each step's check into; the engine polls it."""
        return self.window.guard

    @guard.setter
    def guard(self, guard: NonFiniteGuard) -> None:
        self.window.guard = guard

    @property
    def device(self) -> torch.device:
        """The device the run trains on (the window's)."""
        return self.window.device

    @device.setter
    def device(self, device: torch.device) -> None:
        self.window.device = device

    @property
    def accumulation(self) -> int:
        """Backward passes per optimizer step: ``batch.accumulation`` x ``split``."""
        return self.window.accumulation

    @property
    def pending_micro_steps(self) -> int:
        """Backward passes since the last optimizer step (the open window's)."""
        return self.window.pending

    @property
    def batches_per_step(self) -> int:
        """Loader batches per optimizer step (``batch.accumulation``): what :meth:`train_window` takes."""
        return self.base_accumulation

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
        optimizer step), ``'epoch'`` (``end_epoch()`` steps it) or ``'manual'`` (your loop steps it;
        the engine only saves it). Call before the first step; parameters keep their identity, so
        an optimizer built before ``setup`` stays valid. The model's MoE layers are found here.
        """
        interval = scheduler_interval_of(scheduler, scheduler_interval)
        if not self.window.models:
            self.compile_guard.start()  # count what this run compiles, not what the process did before
        self.window.adopt(model)
        model.to(self.device)
        self.precision.convert_module(model, sharded=self.strategy.plan.sharded)
        if optimizer is not None and self.options.tune_user_optimizer:  # in place, in one log line
            change = apply_fast_adam_kernel(optimizer, self.device)
            log.info(
                "optim.tune_user_optimizer: %s",
                change or "left as it is (not a plain torch.optim.Adam/AdamW, or already that kernel)",
            )
        apply_activation_checkpointing(model, self.options.checkpointing)
        apply_compile(model, self.options.compile_scope, self.options.compile_mode)
        if self.options.cuda_graphs and self.window.wrapper is None:  # whole-step capture (core/graphs.py)
            self.wrap_window(StepGraph(self.device))
        model = self.window.place(model, optimizer)  # DDP / FSDP2 / experts placed, in the precision's dtypes
        self.scheduler, self.scheduler_interval = scheduler, interval
        if loader is None:
            return model, optimizer, None
        return model, optimizer, self.setup_loader(tune_user_loader(loader, self.options.tune_user_loader))

    def setup_loader(self, loader: Iterable[Any]) -> DevicePrefetcher:
        """Wrap ``loader`` so each batch arrives on the device and is counted for throughput."""
        if isinstance(loader, DevicePrefetcher):
            return loader
        return DevicePrefetcher(
            loader, self.device, side_stream=self.options.device_prefetch, on_batch=self.count_batch
        )

    def autocast(self) -> ContextManager[Any]:
        """Mixed-precision context for forward passes (training and evaluation)."""
        return self.precision.autocast()

    def backward(self, loss: Any) -> None:
        """Backward of ``loss / accumulation`` (scaled for fp16), kept on the device; ``loss`` may be a
        model's output (:func:`as_loss`); MoE auxiliary losses are added. A rejected loss changes nothing."""
        self.window.backward(as_loss(loss))
        self.state.micro_step += 1

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """On the accumulation boundary: unscale, clip, step (skipped on-device if non-finite), update the
        loss scale, zero gradients, advance the scheduler; True when an optimizer step was taken."""
        if self.window.pending < self.accumulation:
            return False
        return self._end_step(optimizer, *self.window.close(optimizer))

    def end_epoch(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """After an epoch's last batch: a partial accumulation window is a step of its own, renormalised
        to the passes it had; then an ``'epoch'`` scheduler steps. True when a partial step was taken."""
        took = False
        if optimizer is not None and self.window.pending:
            took = self._end_step(optimizer, *self.window.close(optimizer, partial=True))
        if self.scheduler is not None and self.scheduler_interval == "epoch":
            self.scheduler.step()
        return took

    def _end_step(
        self, optimizer: torch.optim.Optimizer, loss: torch.Tensor, norm: torch.Tensor | None
    ) -> bool:
        """The bookkeeping after a window's optimizer step (the guard's poll every ``sync_every``)."""
        self.window.end_step()
        if self.scheduler is not None and self.scheduler_interval == "step":
            self.scheduler.step()
        self.last_loss, self.last_grad_norm = loss, norm
        self.state.step += 1
        if self.state.step % self.options.sync_every == 0:
            self.poll(optimizer)
            self.compile_guard.check(self.state.step)
        for callback in self._after_step:
            callback()
        return True

    def set_grad_norm(self, fn: GradNormFn | None) -> None:
        """Use ``fn(params) -> norm`` (a 0-dim device tensor, the same on every rank, no host sync) for
        the global gradient norm, for gradients the engine cannot see whole. None: the default."""
        self.window.set_grad_norm(fn)

    def add_step_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every optimizer step (monitoring an own loop: see
        ``turbotrain.app.tracking.track``). It must not read device values every step."""
        self._after_step.append(callback)

    def forward_backward(self, model: nn.Module, batch: Any, loss_fn: LossFn = default_loss) -> torch.Tensor:
        """One loader batch of an own loop: forward under autocast, then backward; returns the batch's
        loss. After an out-of-memory error ``memory.on_oom`` acts: halve and re-run, or stop."""
        if self.window.pending == 0:  # a new step: its batches are kept (by reference) for a re-run
            self._step_batches.clear()
        run_one = lambda b: self.window.run_batch(model, b, loss_fn, self.split, self.backward)  # noqa: E731
        loss = run_guarded_batch(self, model, self._step_batches, batch, run_one)
        self.state.batches += 1
        return loss

    def train_window(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        batches: Sequence[Any],
        loss_fn: LossFn = default_loss,
    ) -> bool:
        """One optimizer step over ``batches`` (:attr:`batches_per_step`) as one window body: what ``fit``
        calls, the same to the bit as ``forward_backward`` on each then ``step``. Returns True."""
        self.window.expect(len(batches), self.base_accumulation)

        def run() -> tuple[int, torch.Tensor, torch.Tensor | None]:
            micro = micro_batches(batches, self.split)  # at the split of the moment: a re-run's is finer
            return len(micro), *self.window.body(model, optimizer, micro, loss_fn)

        start = self.state.micro_step  # an OOM's discard_step takes the failed body's passes off
        micro_steps, loss, norm = run_guarded(self, model, batches, run, run)
        self.state.batches += len(batches)
        self.state.micro_step = start + micro_steps
        return self._end_step(optimizer, loss, norm)

    def wrap_window(self, wrapper: Callable[[WindowFn], WindowFn] | None) -> None:
        """Whole-step capture's one seam: :meth:`train_window` runs ``wrapper(body)`` from now on
        (e.g. a CUDA graph's capture and replay). None: the plain body."""
        self.window.wrap(wrapper)

    def count_batch(self, batch: Any) -> None:
        """Add a batch's samples and tokens to the state; ``setup``'s loader does it for its own."""
        self.state.count(batch)

    def micro_batch(self, batch: Any) -> int:
        """Samples per forward/backward for ``batch`` at the current split."""
        return -(-batch_size(batch) // self.split)

    def discard_step(self, model: nn.Module) -> None:  # the OOM policy's levers: this, set_split
        """Forget the partial optimizer step (gradients, loss sum, its micro-steps) and free memory."""
        self.state.micro_step -= self.window.drop(model)

    def set_split(self, split: int) -> None:
        """Cut each loader batch into ``split`` parts; accumulation follows, so the global batch stays."""
        self.split = split
        self.window.set_accumulation(self.base_accumulation * split)

    def set_accumulation(self, accumulation: int) -> None:
        """Micro-batches per optimizer step (the batch finder sets it to keep the global batch)."""
        if accumulation < 1:
            raise ConfigError(f"batch.accumulation = {accumulation} must be >= 1")
        self.base_accumulation = accumulation
        self.window.set_accumulation(accumulation * self.split)

    def seek(self, batches: int) -> None:
        """Start from data position ``batches`` (loader batches consumed): where a resume's data goes on."""
        self.state.batches = batches

    def record_event(self, kind: str, detail: str, step: int | None = None) -> None:
        """Note something that changed how the run trains (goes to summary.json)."""
        self.events.append(Event(self.state.step if step is None else step, kind, detail))

    def synchronize(self) -> None:
        """Wait for queued device work (host-device sync point; for timing only): the kit's one sync."""
        sync(self.device)

    def poll(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Read the non-finite counter (host-device sync point) and apply the policy (nonfinite.py)."""
        detail = self.nonfinite.poll(self.state.step, optimizer)
        if detail:
            self.record_event("precision_fallback", detail)

    def switch_precision(self, mode: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Change precision mid-run (fallback): new autocast/scaler, weights and state cast back up."""
        self.record_event("precision_fallback", self.nonfinite.switch(mode, optimizer))

    def log(self, name: str, value: torch.Tensor | float) -> None:
        """Log a scalar of your own without a host sync: summed on the device until the Monitor's next
        record (every ``monitor.log_every`` steps), which reads the mean as ``train_<name>``."""
        self._logged.add(name, value)

    def take_logged(self) -> dict[str, torch.Tensor]:
        """The means of :meth:`log`'s values since the last call, as device tensors; starts over."""
        return self._logged.take()

    def evaluate(self, model: nn.Module, batches: Iterable[Any], loss_fn: LossFn = default_loss) -> float:
        """Mean loss over ``batches`` under autocast and no_grad (one sync, at the end)."""
        return self.evaluate_metrics(model, batches, loss_fn)["loss"]

    def evaluate_metrics(
        self,
        model: nn.Module,
        batches: Iterable[Any],
        loss_fn: LossFn = default_loss,
        metrics_fn: MetricsFn | None = None,
    ) -> dict[str, float]:
        """:meth:`evaluate`'s ``"loss"`` and the mean of each metric of ``metrics_fn(model, batch)``
        (e.g. ``{"accuracy": ...}``), averaged over the ranks, read once at the end."""
        return self.window.evaluate(model, batches, loss_fn, metrics_fn)

    def state_dict(self) -> dict[str, Any]:
        return {
            "state": asdict(self.state),
            **self.nonfinite.state_dict(),
            "events": [asdict(e) for e in self.events],
            "batch_runner": {"split": self.split},
        }

    def load_state_dict(self, sd: Mapping[str, Any], optimizer: torch.optim.Optimizer | None = None) -> None:
        self.state = TrainState(**sd["state"])
        fell_back = any(e.get("kind") == "precision_fallback" for e in sd.get("events", []))
        self.nonfinite.load_state_dict(sd, fell_back, optimizer)  # call before loading the weights
        self.events = [Event(**e) for e in sd.get("events", [])]
        # a micro-batch halved after an OOM stays halved
        self.set_split(int(sd.get("batch_runner", {}).get("split", 1)))
