"""Monitoring: windowed throughput and the latest loss every ``log_every`` steps, to sinks.

The Monitor receives values (:meth:`Monitor.observe`: step, loss tensor, lr, sample and token
counts), from its hook side in ``fit()`` or from your own loop. The only host-device
synchronisation is the loss read on logging steps; every other step the monitor does an integer
modulo and returns. A step with a validation result is a logging step too (its evaluation has
synced already), so every evaluation reaches the records, whatever ``log_every``. Probes add to each record, also only on logging
steps: memory (allocator counters, no sync), MFU (FLOPs per sample counted once, before training),
and GPU utilisation/power/temperature/clocks from NVML, sampled on a background thread so the
training thread never waits for the driver. Sinks: ``metrics.jsonl``, a rich progress bar and,
optionally, TensorBoard.

Record keys carry their units: ``step_ms``, ``samples_per_s``, ``tokens_per_s``, ``tflops``
(achieved model TFLOP/s: FLOPs per token x tokens/s, per sample x samples/s without tokens), ``mfu`` (fraction of the datasheet peak), ``mem_*_gib``,
``gpu_util_pct``, ``gpu_power_w``, ``gpu_temp_c``, ``gpu_sm_clock_mhz``; ``grad_norm`` when the
engine computes it, and the ``precision`` in use. Data parallel (``world`` processes): rates are
the whole run's (this rank's counts x world, every rank training an equal share),
``rank_tokens_per_s`` is one rank's, and MFU is over all devices (world x the datasheet peak).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from ..base.atomic import DiskFullError, reporting_disk_full
from ..base.batch import batch_size, move_to, token_count
from ..base.errors import TurbotrainError
from ..base.units import gib
from ..core.engine import as_loss, default_loss
from ..core.transforms import eager
from ..parts.hardware import (
    DeviceSpec,
    collect_nvml_device,
    device_total_bytes,
    estimate_mfu,
    lookup_peak,
    nvml,
    nvml_handle,
    precision_key,
    tf32_enabled,
)
from .hooks import FitContext, Hook, every

if TYPE_CHECKING:
    from rich.console import Console

log = logging.getLogger(__name__)

# A probe is called on logging steps only, with the record so far (loss, lr, ``precision`` when
# known, and this window's ``step_ms``, ``samples_per_s``, ``tokens_per_s``); it returns keys to
# merge into the record. A probe may also define ``start()`` and ``close()``: the Monitor calls
# them when it starts and closes (NvmlSampler runs its thread between them). A probe with
# ``due(step)`` also has steps of its own (MemoryProbe's ``monitor.memory_every``): on those that
# are not logging steps the Monitor writes a record of just the step and the probes' keys (no loss
# read, no sync).
Probe = Callable[[dict[str, Any]], dict[str, Any]]


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per logged step, appended to ``path``.

    The file is flushed at most every ``flush_every_s`` seconds (and on close, which an exception
    in ``fit`` also reaches): a write syscall per record cost ~80 us on the tiny-MLP benchmark,
    while a killed process loses at most that many seconds of records.
    """

    def __init__(self, path: Path, flush_every_s: float = 1.0) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file = open(path, "a", encoding="utf-8")
        self.flush_every_s = flush_every_s
        self._flushed_at = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        with reporting_disk_full(self.path):  # a full disk: one DiskFullError naming the file
            self.file.write(json.dumps(record, allow_nan=False, default=str) + "\n")
            now = time.monotonic()
            if now - self._flushed_at >= self.flush_every_s:
                self.file.flush()
                self._flushed_at = now

    def flush(self) -> None:
        """The records buffered so far onto the disk (e.g. before a checkpoint: a process killed
        later resumes after it, so records up to it would otherwise be lost). Closed: nothing."""
        if not self.file.closed:
            with reporting_disk_full(self.path):
                self.file.flush()
            self._flushed_at = time.monotonic()

    def close(self) -> None:
        with reporting_disk_full(self.path):
            self.file.close()


class ProgressSink:
    """A rich progress bar with loss, tokens/s and ETA on a terminal; plain lines otherwise."""

    def __init__(self, total_steps: int, start_step: int = 0, console: Console | None = None) -> None:
        # rich.progress costs ~0.1 s to import: a run without a progress bar (or an own loop) skips it
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.console = console or Console(stderr=True)
        self.live = self.console.is_terminal
        self.progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.live,
            refresh_per_second=2,  # redraws run on rich's thread and take the GIL: keep them rare
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, stats="")
        self.progress.start()

    def write(self, record: dict[str, Any]) -> None:
        # a probe's own record (memory between logging steps): the line keeps the last loss
        if "loss" not in record:
            return
        stats = format_record(record)
        if self.live:
            self.progress.update(self.task, completed=record["step"], stats=stats)
        else:  # plain lines for logs and pipes; rich's renderer costs ~200 us per line
            print(f"step {record['step']:>6} | {stats}", file=self.console.file, flush=True)

    def close(self) -> None:
        self.progress.stop()


def format_record(record: dict[str, Any]) -> str:
    """The short human line for one metrics record."""
    parts = []
    if record.get("loss") is not None:
        parts.append(f"loss {record['loss']:.4f}")
    if record.get("val_loss") is not None:
        parts.append(f"val {record['val_loss']:.4f}")
        parts.extend(
            f"{k[4:]} {v:.4g}"
            for k, v in record.items()
            if k.startswith("val_") and k not in ("val_loss", "val_step")
        )
    parts.extend(
        f"{k[6:]} {v:.4g}" for k, v in record.items() if k.startswith("train_") and isinstance(v, float)
    )
    if record.get("tokens_per_s"):
        parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    elif record.get("samples_per_s"):
        parts.append(f"{record['samples_per_s']:,.1f} samples/s")
    if record.get("mfu") is not None:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    elif record.get("tflops") is not None:
        parts.append(f"{record['tflops']:.3g} TFLOP/s")
    if record.get("mem_peak_gib") is not None:
        parts.append(f"peak {record['mem_peak_gib']:.2f} GiB")
    if record.get("gpu_util_pct") is not None:
        parts.append(f"GPU {record['gpu_util_pct']:.0f}%")
    return " | ".join(parts)


def _read(value: Any) -> float | None:
    """A device scalar as a float (a host-device sync point); None for None or a non-finite value."""
    x = math.nan if value is None else float(value)
    return x if math.isfinite(x) else None


class Monitor(Hook):
    """Every ``interval`` steps: loss (a host-device sync), lr, throughput over the window since
    the last record, plus whatever the ``probes`` add (memory, MFU, GPU utilisation).

    Also measures the time to the first step (one extra sync, once) so warm-up and compilation
    are reported apart from steady-state throughput.

    In ``fit()`` it is a hook. In your own loop, hand it the values after each optimizer step::

        monitor = Monitor(10, [JsonlSink(Path("metrics.jsonl")), ProgressSink(max_steps)])
        monitor.start()
        for batch in loader:
            engine.forward_backward(model, batch)  # or backward() + count_batch(batch)
            if engine.step(optimizer):
                s = engine.state
                monitor.observe(s.step, engine.last_loss, lr=optimizer.param_groups[0]["lr"],
                                samples=s.samples, tokens=s.tokens)
        monitor.close()
    """

    def __init__(
        self, interval: int, sinks: Iterable[Sink] = (), probes: Iterable[Probe] = (), world: int = 1
    ) -> None:
        self.interval = interval
        self.world = world  # data-parallel processes: rates are this rank's counts x world
        self.sinks = list(sinks)
        self.probes = list(probes)
        self.records: list[dict[str, Any]] = []
        self.first_step_s: float | None = None
        self._t0: float | None = None
        self._first = -1  # the step whose time to first step is measured
        self._last: tuple[float, int, int, int] = (0.0, 0, 0, 0)  # time, step, samples, tokens
        self._side_s = 0.0  # side_s at the last record
        # probes with steps of their own
        self._own_steps = [p for p in self.probes if callable(getattr(p, "due", None))]

    # ------------------------------------------------------------------ values

    def start(self, step: int = 0, samples: int = 0, tokens: int = 0) -> None:
        """Start the clock (and the probes' threads) at this progress; the next step's time is
        the time to first step. Without it the first :meth:`observe` starts the clock."""
        for probe in self.probes:
            getattr(probe, "start", lambda: None)()
        self._t0 = time.perf_counter()
        self._last = (self._t0, step, samples, tokens)
        self._first = step + 1

    def observe(
        self,
        step: int,
        loss: Any = None,
        *,
        lr: float | None = None,
        samples: int = 0,
        tokens: int = 0,
        val_loss: float | None = None,
        val_metrics: dict[str, float] | None = None,
        logged: dict[str, Any] | None = None,
        grad_norm: Any = None,
        precision: str | None = None,
        peak: str | None = None,
        side_s: float = 0.0,
        force: bool = False,
    ) -> dict[str, Any] | None:
        """The values after optimizer step ``step``: its loss (a device tensor or a number), the
        samples and tokens this process trained on so far (x ``world`` for the run's rates), and what else is known; ``side_s``: seconds spent so
        far on work that is not training (evaluation, checkpoints), left out of the throughput;
        ``peak``: the datasheet peak MFU is measured against (``Precision.mfu_peak()``; default:
        ``precision``'s).
        On logging steps (every ``interval``, with a ``val_loss``, or ``force``) it reads ``loss`` and
        ``grad_norm`` (host-device sync points) and writes and returns a record; otherwise it reads
        nothing. A ``val_loss`` is never dropped: its step gets a whole record (the schema of any
        other), where the evaluation has already synced the host."""
        if self._t0 is None:
            self.start(step, samples, tokens)
            self._first = -1  # the clock starts now: no time to first step
        elif step == self._first and self.first_step_s is None:
            if isinstance(loss, torch.Tensor) and loss.is_cuda:
                torch.cuda.synchronize(loss.device)  # host-device sync point, once: time to first step
            now = time.perf_counter()
            self.first_step_s = now - self._t0
            self._last, self._side_s = (now, step, samples, tokens), side_s
        if not (force or val_loss is not None or every(step, self.interval)):
            due = [p for p in self._own_steps if p.due(step)]
            return self._emit({"step": step}, due) if due else None  # allocator counters only: no sync
        record: dict[str, Any] = {"step": step, "loss": _read(loss)}  # host-device sync point
        now = time.perf_counter()
        t, last_step, last_samples, last_tokens = self._last
        dt = now - t - (side_s - self._side_s)  # evaluation and checkpoint time are not training
        if dt > 0 and step > last_step:
            record["step_ms"] = 1000 * dt / (step - last_step)
            # The whole run's rates: every rank trains an equal share (the same micro-batch).
            record["samples_per_s"] = self.world * (samples - last_samples) / dt
            record["tokens_per_s"] = self.world * (tokens - last_tokens) / dt
            if self.world > 1:
                record["rank_tokens_per_s"] = (tokens - last_tokens) / dt
        self._last, self._side_s = (now, step, samples, tokens), side_s
        known = {
            "lr": lr,
            "grad_norm": _read(grad_norm),
            "precision": precision,
            "mfu_peak": peak,
            "val_loss": val_loss,
        }
        record.update(
            elapsed_s=now - self._t0,
            samples=samples,
            tokens=tokens,
            **{k: v for k, v in known.items() if v is not None},
        )
        if val_loss is not None:
            record.update(val_metrics or {})  # val_accuracy, ...: evaluated with the loss
        # engine.log's means: host-device sync point
        record.update({k: _read(v) for k, v in (logged or {}).items()})
        return self._emit(record, self.probes)

    def _emit(self, record: dict[str, Any], probes: Iterable[Probe]) -> dict[str, Any]:
        for probe in probes:
            record.update(probe(record))
        self.write_event(record)
        return record

    def write_event(self, record: dict[str, Any]) -> None:
        """A record into the run's records and every sink: a step's measurement, or an event
        (``{"event": "epoch", ...}``) that the report keeps apart from the step records."""
        self.records.append(record)
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        """Stop the probes' threads and close the sinks (idempotent)."""
        for probe in self.probes:
            getattr(probe, "close", lambda: None)()
        for sink in self.sinks:
            sink.close()

    # ------------------------------------------------------------------ hook side: public engine values only

    def on_fit_start(self, ctx: FitContext) -> None:
        s = ctx.engine.state
        # the first step compiles: minutes, say so
        self._compiling = ctx.engine.options.compile_scope != "off"
        if self._compiling:
            log.info("compiling (first step; torch.compile, %s)...", ctx.engine.options.compile_scope)
        self.start(s.step, s.samples, s.tokens)

    def on_step_end(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        # the last step's record comes at the end
        own = step < ctx.max_steps and any(p.due(step) for p in self._own_steps)
        # Evaluate (before this hook) has just validated: record it
        evaluated = ctx.metrics.get("val_step") == step
        if step == self._first or every(step, self.interval) or own or evaluated:
            self._observe(ctx)
        if step == self._first and self._compiling and self.first_step_s is not None:
            log.info("compiled: first step %.1f s", self.first_step_s)

    def on_fit_end(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        last = next((r for r in reversed(self.records) if "loss" in r), {})  # the last record of the loss's
        if last.get("step") != step or (ctx.metrics.get("val_step") == step and "val_loss" not in last):
            self._observe(ctx, force=True)
        self.close()

    def on_exception(self, ctx: FitContext, exc: BaseException) -> None:
        with contextlib.suppress(DiskFullError):  # the error on its way is the one to report
            self.close()

    def _observe(self, ctx: FitContext, force: bool = False) -> None:
        engine, s, m = ctx.engine, ctx.engine.state, ctx.metrics
        record = self.observe(
            s.step,
            engine.last_loss,
            lr=ctx.optimizer.param_groups[0]["lr"] if ctx.optimizer is not None else None,
            samples=s.samples,
            tokens=s.tokens,
            val_loss=m.get("val_loss") if m.get("val_step") == s.step else None,
            val_metrics=m.get("val_metrics"),
            logged=engine.take_logged(),
            grad_norm=engine.last_grad_norm,
            precision=engine.precision.name,
            peak=engine.precision.mfu_peak(),
            side_s=ctx.side_s,
            force=force,
        )
        if record and record.get(MEMORY_WARNING):
            engine.record_event(MEMORY_WARNING, record[MEMORY_WARNING])  # into summary.json's events
        m.update(record or {}, first_step_s=self.first_step_s)


# ----------------------------------------------------------------------------- memory


MEMORY_WARNING = "memory_warning"  # the record key and engine event kind of the high-memory warning


def collect_cuda_memory(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocator's counters in bytes: allocated, reserved, and their peaks since
    the start or the last reset. Host-side counters: no sync."""
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "peak": torch.cuda.max_memory_allocated(device),
        "peak_reserved": torch.cuda.max_memory_reserved(device),
    }


class MemoryProbe:
    """GPU memory in GiB: allocated now, reserved now, peak allocated since the start (or the
    last :meth:`reset_peak`), and a warning once when memory runs high. Host-side counters: no sync.

    ``every`` (``monitor.memory_every``): None = these keys in each metrics record; N = on every
    N-th step instead, between the loss's records too (see :meth:`due`); 0 = never. Whatever
    ``every``, each call compares the peak reserved memory with ``warn_fraction`` of the limit
    (the device's total, or ``cap_fraction`` of it: ``memory.max_fraction``'s allocator cap); the
    first time it is reached, one log warning and a ``memory_warning`` key in that record (which
    the Monitor, in ``fit()``, also records as an engine event for summary.json). Not again in
    this process: a resumed run warns again.

    ``read`` (a function returning :func:`collect_cuda_memory`'s keys) and ``limit_bytes`` default
    to the CUDA device's; pass your own to test it without a GPU.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        every: int | None = None,
        warn_fraction: float = 0.9,
        cap_fraction: float = 0.0,
        limit_bytes: int | None = None,
        read: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.device = device
        self.every = every
        self.warn_fraction = warn_fraction
        self.limit_what = f"the cap ({cap_fraction:g} of the device)" if cap_fraction > 0 else "the device's"
        if limit_bytes is None and warn_fraction > 0:
            total = device_total_bytes(device)
            limit_bytes = int(total * cap_fraction) if total and cap_fraction > 0 else total
        self.limit_bytes = limit_bytes
        self.read = read or (lambda: collect_cuda_memory(device))
        self.warned = False

    def due(self, step: int) -> bool:
        """Whether ``step`` is one of this probe's own steps (``every`` N; never for None or 0)."""
        return self.every is not None and every(step, self.every)

    def reset_peak(self) -> None:
        """Start the peaks over (at each epoch, say): later records' ``mem_peak_gib`` is the peak since this call."""
        torch.cuda.reset_peak_memory_stats(self.device)

    def __call__(self, record: dict[str, Any] | None = None) -> dict[str, Any]:
        counters = self.read()
        out: dict[str, Any] = {}
        if self.every is None or self.due((record or {}).get("step", 0)):
            out.update(
                mem_allocated_gib=gib(counters["allocated"]),
                mem_reserved_gib=gib(counters["reserved"]),
                mem_peak_gib=gib(counters["peak"]),
            )
        warning = self.check(counters["peak_reserved"])
        if warning:
            out[MEMORY_WARNING] = warning
        return out

    def check(self, used_bytes: int) -> str | None:
        """The warning's text the first time ``used_bytes`` reaches ``warn_fraction`` of the limit (also logged); else None."""
        limit = self.limit_bytes
        if self.warned or self.warn_fraction <= 0 or not limit or used_bytes < self.warn_fraction * limit:
            return None
        self.warned = True
        text = (
            f"GPU memory is high: peak reserved {gib(used_bytes):.2f} GiB is {used_bytes / limit:.0%} of {self.limit_what} "
            f"{gib(limit):.2f} GiB (monitor.memory_warn_fraction = {self.warn_fraction:g}); a longer batch or sequence "
            "may run out of memory: lower batch.micro or set memory.checkpointing"
        )
        log.warning(text)
        return text


# ----------------------------------------------------------------------------- FLOPs and MFU


def _cpu_sdpa_flop(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_sdpa_backward_flop(
    grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any
) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# torch's flop counter knows the CUDA attention kernels but not the CPU one SDPA dispatches to.
_EXTRA_FLOP_FORMULAS: dict[Any, Any] = {}
for _name, _fn in (
    ("_scaled_dot_product_flash_attention_for_cpu", _cpu_sdpa_flop),
    ("_scaled_dot_product_flash_attention_for_cpu_backward", _cpu_sdpa_backward_flop),
):
    _op = getattr(torch.ops.aten, _name, None)
    if _op is not None:
        _EXTRA_FLOP_FORMULAS[_op] = _fn


def count_flops_per_sample(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    autocast: Callable[[], Any] = contextlib.nullcontext,
) -> float:
    """Training FLOPs (forward + backward) per sample, counted with ``torch.utils.flop_counter``
    on one real micro-batch. Run it once, before training: it costs one eager forward/backward.

    Side-effect free: gradients come from ``torch.autograd.grad`` (nothing accumulates in
    ``.grad``), buffers (e.g. BatchNorm statistics) and the RNG are restored, and compiled
    modules run eagerly. Counts matrix products, convolutions and attention, like the PaLM
    formula (element-wise ops are not counted; attention counts the full T x T square).
    """
    loss_fn = loss_fn or default_loss
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices), eager():
        with FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOP_FORMULAS) as counter:
            with autocast():
                loss = as_loss(loss_fn(model, batch))
            torch.autograd.grad(loss, params, allow_unused=True)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    return counter.get_total_flops() / batch_size(batch)


def estimate_flops_per_sample(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    autocast: Callable[[], Any] = contextlib.nullcontext,
) -> tuple[float, str]:
    """Training FLOPs per sample and how they were obtained: the model's own exact
    ``flops_per_token(seq_len)`` when it has one and the batch holds token ids, otherwise counted
    once with :func:`count_flops_per_sample`."""
    tokens = token_count(batch) // batch_size(batch)  # per sample
    own = getattr(model, "flops_per_token", None)
    if callable(own) and tokens:
        return float(own(tokens)) * tokens, "model.flops_per_token (6N + 12·L·H·Q·T)"
    return count_flops_per_sample(model, batch, loss_fn, autocast), "torch.utils.flop_counter"


class MfuProbe:
    """Achieved model TFLOP/s and MFU over each logging window, from the Monitor's tokens/s
    (samples/s for data without tokens).

    ``flops_per_sample`` is counted once (see :func:`estimate_flops_per_sample`) on an example of
    ``tokens_per_sample`` tokens (padding counted, as in ``tokens_per_s``); with tokens the rate is
    FLOPs per token x tokens/s, so token-budget batches (rows per batch vary, tokens do not) give
    a steady figure, and fixed windows the same as samples/s x FLOPs per sample. The peak comes
    from ``spec`` (a datasheet entry) and the record's ``precision`` (the one in use, so a
    precision fallback mid-run is accounted for), through :mod:`turbotrain.parts.hardware`. Without a spec (CPU, unknown GPU) only ``tflops`` is
    recorded and MFU is left out.
    """

    def __init__(
        self,
        flops_per_sample: float,
        spec: DeviceSpec | None,
        precision: str = "fp32",
        source: str = "",
        devices: int = 1,
        tokens_per_sample: float = 0.0,
    ) -> None:
        self.flops_per_sample = flops_per_sample
        self.tokens_per_sample = tokens_per_sample  # of the example the FLOPs were counted on; 0: no tokens
        self.spec = spec
        self.precision = precision
        self.source = source
        self.devices = devices  # data parallel: the record's samples/s are the world's, so is the peak

    def peak_tflops(self, precision: str | None = None) -> float | None:
        """Dense datasheet TFLOP/s for ``precision`` (default: the one given at construction) of
        all ``devices`` together; fp32 counts at the TF32 peak while TF32 matmuls are on."""
        if not self.spec:
            return None
        peak = self.spec.peak_tflops(precision_key(precision or self.precision, tf32=tf32_enabled()))
        return peak * self.devices if peak else peak

    def __call__(self, record: dict[str, Any]) -> dict[str, Any]:
        tokens = record.get("tokens_per_s")
        rate = (
            tokens / self.tokens_per_sample
            if tokens and self.tokens_per_sample
            else record.get("samples_per_s")
        )
        if not rate:
            return {}
        flops_per_s = rate * self.flops_per_sample  # with tokens: tokens/s x FLOPs per token
        out: dict[str, Any] = {"tflops": flops_per_s / 1e12}
        peak = self.peak_tflops(record.get("mfu_peak") or record.get("precision"))
        if peak:
            out["mfu"] = estimate_mfu(flops_per_s, peak)
        return out


def build_mfu_probe(
    model: nn.Module,
    example_batch: Any,
    device: torch.device,
    precision: str = "fp32",
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    devices: int = 1,
) -> MfuProbe:
    """An :class:`MfuProbe` for ``model``: FLOPs per sample (and per token) from ``example_batch`` (moved to
    ``device`` here), the peak from the device name (x ``devices``, the data-parallel world).
    An unknown device is logged, not an error."""
    flops, source = estimate_flops_per_sample(model, move_to(example_batch, device), loss_fn, autocast)
    # padding counted, as tokens_per_s
    tokens_per_sample = token_count(example_batch) / batch_size(example_batch)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec = lookup_peak(name) if device.type == "cuda" else None
    if spec is None:
        log.info("MFU left out: no datasheet peak for %s (achieved TFLOP/s is still recorded)", name)
    return MfuProbe(flops, spec, precision, source, devices, tokens_per_sample)


# ----------------------------------------------------------------------------- NVML


class NvmlSampler:
    """GPU utilisation (%), power (W), temperature (C) and SM/memory clocks (MHz) read from NVML
    every ``period_s`` on a daemon thread; each call returns the means (temperature: max) over
    the samples since the previous call. The training thread never calls the driver.

    Without NVML (no package, no driver, no GPU) it records nothing: ``available`` is False.
    """

    FIELDS = {
        "util_pct": "gpu_util_pct",
        "mem_util_pct": "gpu_mem_util_pct",
        "power_w": "gpu_power_w",
        "temp_c": "gpu_temp_c",
        "sm_clock_mhz": "gpu_sm_clock_mhz",
        "mem_clock_mhz": "gpu_mem_clock_mhz",
    }

    def __init__(self, cuda_index: int = 0, period_s: float = 0.5) -> None:
        self.period_s = period_s
        self.handle = nvml_handle(cuda_index) if torch.cuda.is_available() else None
        self.available = self.handle is not None
        self._samples: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> dict[str, Any]:
        """One reading of the fields NVML answers."""
        raw = collect_nvml_device(self.handle)
        return {key: raw[src] for src, key in self.FIELDS.items() if raw.get(src) is not None}

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            reading = self.sample()
            with self._lock:
                self._samples.append(reading)

    def start(self) -> None:
        if self.available and self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="turbotrain-nvml", daemon=True)
            self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.period_s + 1)
            self._thread = None

    def __call__(self, record: dict[str, Any] | None = None) -> dict[str, Any]:
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples and self.available:
            samples = [self.sample()]  # window shorter than the period: read once now
        out: dict[str, Any] = {}
        for key in self.FIELDS.values():
            values = [s[key] for s in samples if key in s]
            if values:
                out[key] = max(values) if key == "gpu_temp_c" else round(statistics.fmean(values), 2)
        return out


# ----------------------------------------------------------------------------- TensorBoard


class TensorBoardSink:
    """Every numeric record value as a TensorBoard scalar (``train/<key>``) at its step."""

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TurbotrainError(
                "monitor.tensorboard = true needs the tensorboard package: pip install tensorboard "
                "(or pip install 'turbotrain[tensorboard]'), or drop --monitor.tensorboard"
            ) from None
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"train/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


# ----------------------------------------------------------------------------- assembly


def build_probes(
    device: torch.device,
    *,
    model: nn.Module | None = None,
    example_batch: Any = None,
    precision: str = "fp32",
    nvml_enabled: bool = True,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    devices: int = 1,
    memory_every: int = -1,
    memory_warn_fraction: float = 0.9,
    memory_cap_fraction: float = 0.0,
) -> list[Probe]:
    """The standard probes for ``device``: memory and NVML on CUDA (none on CPU), MFU when a
    model and an example batch are given (over ``devices``, the data-parallel world).
    ``memory_every``, ``memory_warn_fraction``: ``monitor.memory_every`` (-1 = with each record)
    and ``monitor.memory_warn_fraction``; ``memory_cap_fraction``: ``memory.max_fraction``."""
    probes: list[Probe] = []
    if device.type == "cuda":
        probes.append(
            MemoryProbe(
                device,
                every=None if memory_every < 0 else memory_every,
                warn_fraction=memory_warn_fraction,
                cap_fraction=memory_cap_fraction,
            )
        )
        if nvml_enabled:
            sampler = NvmlSampler(device.index if device.index is not None else torch.cuda.current_device())
            if sampler.available:
                probes.append(sampler)
            else:
                log.info("GPU utilisation not sampled: %s", nvml()[1])
    if model is not None and example_batch is not None:
        try:
            probes.append(
                build_mfu_probe(model, example_batch, device, precision, loss_fn, autocast, devices)
            )
        except Exception as exc:  # an optional measurement: training goes on without FLOPs
            log.warning(
                "FLOPs not counted, so no TFLOP/s or MFU (%s: %s); pass a loss_fn(model, batch) "
                "that returns the loss for the example batch",
                type(exc).__name__,
                exc,
            )
    return probes
