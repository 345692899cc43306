"""Where a training step's memory goes: parameters, gradients, optimizer state, activations, and
the peak of each phase (forward, backward, optimizer step). On CUDA the caching allocator's
host-side counters (no device sync); elsewhere :class:`TensorMemoryTracker` counts tensor storages
(not the allocator's cache, fragmentation, library workspaces or the CUDA context: the finder's
headroom is for those). "Activations" are the live bytes after forward minus before.

:func:`estimate_memory` runs the same measurement on the meta device (about a second for
gpt2-medium, nothing allocated), :class:`MetaEmulation` standing in for autocast and fused
attention; its foreach AdamW makes the optimizer-phase peak an upper bound for fused AdamW.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, ContextManager

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ...base.batch import batch_size, move_to, tensors_of
from ...base.config import RunConfig
from ...base.errors import TurbotrainError
from ...base.units import gib
from ...core.device import resolve_device
from ...core.meter.trial import train_step
from ...core.optim import build_optimizer
from ...core.precision import DeviceCaps, MixedPrecision, precision_class, resolve_precision
from ...core.transforms import apply_activation_checkpointing, recompute_context
from ...parts.data.tokenizer import BYTE_VOCAB, GPT2_VOCAB
from ...parts.hardware import device_total_bytes
from ...parts.models.registry import spec_for


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied weights and views count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


class TensorMemoryTracker(TorchDispatchMode):
    """Live tensor bytes and their peak, on any device: each op's outputs with a new storage (not
    an input's) count until a weak reference sees the storage freed; tensors that existed before
    count once registered with :meth:`add`. Microseconds per op: for measurement steps only."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}
        self._refs: dict[int, Any] = {}

    def add(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count already-existing tensors (parameters, gradients, optimizer state, the batch)."""
        for t in tensors:
            self._track(t.untyped_storage())

    def reset_peak(self) -> None:
        self.peak = self.current

    def _track(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        if key in self._live:
            return
        nbytes = st.nbytes()
        self._live[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)

        def freed(_ref: Any, key: int = key, nbytes: int = nbytes) -> None:
            if self._live.pop(key, None) is not None:
                self.current -= nbytes
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(st, freed)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tensors_of((args, kwargs))}
        for t in tensors_of(out):
            st = t.untyped_storage()
            if st._cdata not in inputs:
                self._track(st)
        return out


_TO_LOW = {
    getattr(torch, n) for n in ("matmul", "mm", "bmm", "addmm", "baddbmm", "conv1d", "conv2d", "conv3d")
}
_TO_LOW |= {torch._C._nn.linear, torch.Tensor.__matmul__, torch._C._nn.scaled_dot_product_attention}
_FP32_OPS = ("layer_norm", "group_norm", "softmax", "log_softmax", "cross_entropy", "nll_loss", "mse_loss")
_TO_FP32 = {getattr(torch.nn.functional, n) for n in _FP32_OPS}
_TO_FP32 |= {torch.softmax, torch.log_softmax, torch.layer_norm}


class MetaEmulation(TorchFunctionMode):
    """What a real device does that the meta device does not, at the function level: autocast's
    casts when ``dtype`` is given (matmul-like ops in ``dtype``, norms/softmax/losses in fp32, made
    above autograd so backward saves their results), and fused attention (meta's SDPA falls back to
    the math path that saves the T x T weights; it is routed to the CPU flash kernel's meta
    implementation, which keeps only the output and the log-sum-exp, as real kernels do)."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.dtype is not None and func in _TO_LOW:
            args, kwargs = _cast(args, kwargs, torch.float32, self.dtype)
        elif self.dtype is not None and func in _TO_FP32:
            args, kwargs = _cast(args, kwargs, self.dtype, torch.float32)
        if func is torch._C._nn.scaled_dot_product_attention:
            return _fused_attention(*args, **kwargs)
        return func(*args, **kwargs)


def _cast(
    args: Any, kwargs: dict[str, Any], src: torch.dtype, dst: torch.dtype
) -> tuple[Any, dict[str, Any]]:
    def cast(x: Any) -> Any:
        return x.to(dst) if isinstance(x, torch.Tensor) and x.dtype == src else x

    return [cast(a) for a in args], {k: cast(v) for k, v in kwargs.items()}


def _fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    **_: Any,
) -> torch.Tensor:
    if attn_mask is not None and attn_mask.dtype != query.dtype:
        attn_mask = attn_mask.to(query.dtype)
    out, _lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out


@dataclass
class MemoryStats:
    """One training step's memory, in bytes. Peaks include everything live in that phase."""

    micro_batch: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    optimizer_peak_bytes: int
    method: str  # "cuda-allocator" | "tensor-tracking" | "meta-estimate"
    device: str
    precision: str = ""
    checkpointing: str = ""
    device_total_bytes: int | None = None

    @property
    def peak_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes, self.optimizer_peak_bytes)

    def to_dict(self) -> dict[str, Any]:
        """Bytes plus the same figures in GiB (``*_gib``), for JSON summaries."""
        out: dict[str, Any] = asdict(self)
        out["peak_bytes"] = self.peak_bytes
        for key in [k for k in out if k.endswith("_bytes")]:
            out[key[: -len("_bytes")] + "_gib"] = gib(out[key])
        return out


def measure_step_memory(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    *,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    autocast: Callable[[], ContextManager[Any]] | None = None,
    precision: str = "",
    checkpointing: str = "",
) -> MemoryStats:
    """Run one real training step (forward, backward, ``optimizer.step()``, zero_grad) on
    ``batch`` and return its memory per phase. It changes the weights: use it on a model whose
    training has not started, or a copy. Gradients are set to None first."""
    autocast = autocast or contextlib.nullcontext
    params = list(model.parameters()) + list(model.buffers())
    device = params[0].device if params else torch.device("cpu")
    optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        gc.collect()
    meter = step_meter(device, model, optimizer, batch)
    method = {"cuda": "cuda-allocator", "meta": "meta-estimate"}.get(device.type, "tensor-tracking")
    phases: dict[str, int] = {}

    def read(phase: str) -> None:  # the peak of each phase; after the forward, the activations kept
        phases[phase], phases[phase + "_kept"] = meter.peak, meter.current
        meter.reset_peak()

    with meter:
        before = meter.current
        train_step(
            model, optimizer, batch, loss_fn=loss_fn, autocast=autocast, on_phase=read, zero_grad=False
        )
    stats = MemoryStats(
        micro_batch=batch_size(batch),
        params_bytes=storage_bytes(model.parameters()),
        grads_bytes=storage_bytes(p.grad for p in model.parameters() if p.grad is not None),
        optimizer_bytes=storage_bytes(optimizer_tensors(optimizer)),
        activations_bytes=phases["forward_kept"] - before,
        forward_peak_bytes=phases["forward"],
        backward_peak_bytes=phases["backward"],
        optimizer_peak_bytes=phases["optimizer"],
        method=method,
        device=str(device),
        precision=precision,
        checkpointing=checkpointing,
        device_total_bytes=device_total_bytes(device),
    )
    optimizer.zero_grad(set_to_none=True)
    return stats


def step_meter(device: torch.device, model: nn.Module, optimizer: Any, batch: Any) -> Any:
    """What reads a step's memory on ``device`` (CUDA's counters, else tracked tensors), peak reset."""
    if device.type == "cuda":
        meter: Any = _CudaMeter(device)
    else:
        meter = TensorMemoryTracker()
        meter.add([*model.parameters(), *model.buffers(), *optimizer_tensors(optimizer), *tensors_of(batch)])
    meter.reset_peak()
    return meter


class _CudaMeter(contextlib.nullcontext):
    """The CUDA caching allocator's counters with the tracker's interface (bytes)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    @property
    def current(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    @property
    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


def default_vocab_size(config: RunConfig) -> int:
    """The vocabulary without opening the data: the model's, else GPT-2's for a .bin, else 256 (bytes)."""
    return spec_for(config).vocab_size(config) or (
        GPT2_VOCAB if config.data.path.endswith(".bin") else BYTE_VOCAB
    )


def resolve_precision_name(config: RunConfig, device: torch.device | None = None) -> str:
    """The concrete precision ``config`` gets on ``device`` (default: its own), whole section checked."""
    device = device or resolve_device(config.run.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return resolve_precision(config.precision.mode, DeviceCaps.of(device), config.precision)


def estimate_memory(
    config: RunConfig,
    *,
    micro: int | None = None,
    checkpointing: str | None = None,
    precision: str | None = None,
    vocab_size: int | None = None,
    spec: Any = None,
) -> MemoryStats:
    """Memory of one training step of ``config``'s model at ``micro`` samples (default: the
    config's micro-batch, 8 when 'auto'), measured on the meta device (see the module doc).
    ``spec``: the run's model spec, which builds it and its random batch (None: the config's).

    ``precision`` defaults to what the config resolves to on its device; pass e.g.
    'bf16-mixed' to estimate for a GPU from a CPU machine.
    """
    spec = spec or spec_for(config)
    micro = micro or (config.batch.micro if isinstance(config.batch.micro, int) else 8)
    meta = torch.device("meta")
    vocab = vocab_size or default_vocab_size(config)
    with meta:
        model = spec.build_model(config, vocab)
    batch = spec.random_batch(config, vocab, meta)(micro)
    return estimate_step_memory(model, batch, config=config, checkpointing=checkpointing, precision=precision)


def estimate_step_memory(
    model: nn.Module,
    batch: Any,
    *,
    config: RunConfig,
    loss_fn: Callable[[nn.Module, Any], Any] | None = None,
    checkpointing: str | None = None,
    precision: str | None = None,
) -> MemoryStats:
    """Memory of one training step of any ``model`` on ``batch`` (a workload's own, with its
    ``loss_fn``), measured on the meta device: both are moved there (the model's weights are
    lost: pass one built for this, or a copy), with ``config``'s precision (default: what it
    resolves to on its device), checkpointing mode and AdamW."""
    mode = checkpointing or config.memory.checkpointing
    prec = precision or resolve_precision_name(config)
    meta = torch.device("meta")
    swap = torch.__future__.get_swap_module_params_on_conversion()
    # the same Parameter objects: tied weights stay tied
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(meta)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    batch = move_to(batch, meta)
    plugin = precision_class(prec)
    if plugin.param_dtype != torch.float32:  # bf16-true
        model.to(plugin.param_dtype)
    apply_activation_checkpointing(model, mode)
    optimizer = build_optimizer(
        model, meta, lr=config.optim.lr, weight_decay=config.optim.weight_decay, implementation="foreach"
    )
    # the autocast dtype (fp8: bf16 autocast)
    low = plugin.dtype if issubclass(plugin, MixedPrecision) else None
    model.train()
    try:
        with MetaEmulation(low), recompute_context(lambda: MetaEmulation(low)):
            stats = measure_step_memory(
                model, optimizer, batch, loss_fn=loss_fn, precision=prec, checkpointing=mode
            )
    except (RuntimeError, NotImplementedError) as exc:
        if "meta" not in str(exc).lower():
            raise
        raise NotEstimable(
            f"{type(model).__name__} cannot be estimated on the meta device: its forward reads tensor values "
            f"(a dropless mixture of experts counts its tokens per expert)"
        ) from None
    stats.method = "meta-estimate"
    return stats


class NotEstimable(TurbotrainError):
    """A model whose step depends on its data's values (sizes read with ``.item()``), which the
    meta device does not have: only a real step (``turbotrain memory --measure``) can tell."""


COMPARED_MODES = ("off", "selective", "full")  # activation checkpointing, least to most recomputation


def compare_checkpointing(config: RunConfig, **kwargs: Any) -> dict[str, MemoryStats]:
    """:func:`estimate_memory` for each checkpointing mode (off, selective, full)."""
    return {mode: estimate_memory(config, checkpointing=mode, **kwargs) for mode in COMPARED_MODES}


def memory_summary(training: Any) -> dict[str, Any]:
    """The ``memory`` entry of a run's summary.json: the estimate for the run's config and
    precision, the measured peak on CUDA (allocator counters since the last reset), and the
    batch-size search if ``batch.micro`` was 'auto'. Never raises: a summary must be written."""
    out: dict[str, Any] = {}
    if not training.spec.memory_estimate:
        out["estimate_error"] = (
            f"no analytic estimate for a {training.spec.name} model (the measured peak is below on CUDA)"
        )
    else:
        try:
            out["estimate"] = estimate_memory(
                training.config,
                precision=training.engine.precision.name,
                vocab_size=training.resolved.get("vocab_size"),
                spec=training.spec,  # the run's: made once
            ).to_dict()
        except Exception as exc:  # a report must not fail the run
            out["estimate_error"] = f"{type(exc).__name__}: {exc}"
    device = training.engine.device
    if device.type == "cuda":
        out["measured"] = {
            "peak_allocated_gib": gib(torch.cuda.max_memory_allocated(device)),
            "peak_reserved_gib": gib(torch.cuda.max_memory_reserved(device)),
            "device_total_gib": gib(device_total_bytes(device)),
        }
    search = getattr(training, "resolved", {}).get("batch_search")
    if search:
        out["batch_search"] = search
    return out
