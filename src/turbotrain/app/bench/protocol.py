"""The measurement every contender process applies, so all figures mean the same thing.

- :class:`StepClock`: time to first step (setup + compilation + step 1, one synchronize), then
  warm-up steps (not timed), then the timed steps: on CUDA with events recorded on the stream (no
  host-device sync per step; the events are read once at the end), on CPU with the host clock
  (CPU kernels have finished when they return). The median timed step is the protocol's figure.
- The per-step losses stay on the device until the end (one read), for the parity check. Each is
  a copy made on the device when the step is marked: under CUDA graphs (compile mode
  reduce-overhead / max-autotune) the loss is a graph output that the next replay overwrites.
- :func:`init_digest`: a SHA-256 of the initial weights, to prove every contender starts equal.
- :func:`recipe_param_groups` and :func:`warmup_factor`: the training recipe in plain PyTorch,
  shared by the plain, hand-tuned, Accelerate and Lightning contenders (turbotrain uses its own
  ``build_optimizer``/``build_scheduler``; the math is the same).
- :class:`Job`: what every contender process trains, identical for all of them.
"""

from __future__ import annotations

import hashlib
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ...base.batch import move_to
from ...base.errors import TurbotrainError
from ...base.units import GIB
from ...core.engine import as_loss, default_loss
from ...parts.hardware import precision_key, tf32_enabled
from ...parts.models.moe import MoE, moe_layers


class StepClock:
    """Times optimizer steps by the benchmark protocol. ``start()`` before the framework's setup,
    ``mark(loss)`` after every optimizer step, ``finish()`` once after the last step."""

    def __init__(self, device: torch.device, warmup_steps: int, timed_steps: int) -> None:
        if warmup_steps < 1 or timed_steps < 1:
            raise ValueError("StepClock needs at least one warm-up and one timed step")
        self.device, self.warmup, self.timed = device, warmup_steps, timed_steps
        self.cuda = device.type == "cuda"
        self.steps = 0
        self.losses: list[torch.Tensor] = []
        self.t0 = 0.0
        self.first_step_s: float | None = None
        self.t_warm = 0.0  # host clock at the end of the warm-up
        self.host_marks: list[float] = []  # CPU: host clock after each step from the end of warm-up
        self.events: list[Any] = []  # CUDA: events after each step from the end of warm-up
        self.figures: dict[str, Any] | None = None

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.t0 = time.perf_counter()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)  # host-device sync point: only before reading clocks

    def mark(self, loss: torch.Tensor | None) -> None:
        """After an optimizer step: keep a copy of its loss (on the device: a copy kernel queued
        behind the step, no host sync) and time it. A copy, not the tensor itself, because a CUDA
        graph's replay (or any in-place reuse of the buffer) overwrites the passed tensor."""
        self.steps += 1
        if loss is not None:
            self.losses.append(loss.detach().clone())
        n = self.steps
        if n == 1:
            self._sync()
            self.first_step_s = time.perf_counter() - self.t0
        if n == self.warmup:
            self._sync()
            self.t_warm = time.perf_counter()
            self._stamp()
        elif n > self.warmup:
            self._stamp()

    def _stamp(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
        else:
            self.host_marks.append(time.perf_counter())

    def finish(self) -> dict[str, Any]:
        """The figures (one synchronize, one loss read). Raises if the step count is wrong.
        May be called right after the last timed step (then later calls return the same)."""
        if self.figures is not None:
            return self.figures
        expected = self.warmup + self.timed
        if self.steps != expected:
            raise TurbotrainError(f"contender ran {self.steps} optimizer steps, expected {expected}")
        self._sync()
        timed_s = time.perf_counter() - self.t_warm
        if self.cuda:
            step_ms = [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]
        else:
            step_ms = [1000 * (b - a) for a, b in zip(self.host_marks, self.host_marks[1:])]
        losses = torch.stack([x.float().reshape(()) for x in self.losses]).tolist() if self.losses else []
        if len(losses) != expected:
            raise TurbotrainError(f"contender reported {len(losses)} losses for {expected} steps")
        self.figures = {
            "steps": self.steps,
            "time_to_first_step_s": self.first_step_s,
            "timed_s": timed_s,
            "step_ms": step_ms,
            "step_ms_median": statistics.median(step_ms),
            "losses": losses,
            "first_loss": losses[0],
            "final_loss": losses[-1],
            **peak_memory(self.device),
        }
        return self.figures


def peak_memory(device: torch.device) -> dict[str, float]:
    """CUDA: the caching allocator's peak allocated/reserved bytes since ``start`` (GiB).
    CPU: the process's peak resident set size (GiB; includes the Python runtime and libraries,
    so it is not comparable to a GPU's allocated bytes)."""
    if device.type == "cuda":
        return {
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
        }
    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}  # Linux: KiB


def init_digest(model: nn.Module) -> str:
    """SHA-256 over the state dict's names and raw bytes (first 16 hex digits)."""
    h = hashlib.sha256()
    for name, value in model.state_dict().items():
        h.update(name.encode())
        h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def recipe_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups of the recipe: weight decay on matrices and convolution kernels, none on
    biases, norms and embeddings (tied heads included) - the same split as turbotrain's."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, rest = [], []
    for p in model.parameters():
        (decay if p.ndim >= 2 and id(p) not in embeddings else rest).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def warmup_factor(warmup_steps: int) -> Callable[[int], float]:
    """LR multiplier at step ``s``: linear warmup over ``warmup_steps``, then constant."""
    return lambda s: min(1.0, (s + 1) / max(1, warmup_steps))


class BatchList(Dataset):
    """Item ``i`` is the whole batch ``i mod pool`` (any structure: a tuple of inputs and targets
    for the built-in workloads, whatever your loader yields for ``--model``): a DataLoader with
    ``batch_size=None`` yields the same batches in the same order to every contender."""

    def __init__(self, batches: list[Any], length: int) -> None:
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        return self.batches[i % len(self.batches)]


def load_batches(spec: dict[str, Any], device: torch.device) -> BatchList:
    """The spec's batches; moved to ``device`` first when the workload keeps its data resident."""
    data = torch.load(spec["data_file"], weights_only=True)
    batches = data["batches"] if "batches" in data else [(x, y) for x, y in zip(data["x"], data["y"])]
    if spec.get("resident") and device.type == "cuda":
        batches = move_to(batches, device)
    return BatchList(batches, spec["warmup_steps"] + spec["timed_steps"] + int(spec.get("profile_steps", 0)))


def make_loader(batches: BatchList, pin_memory: bool = False) -> DataLoader:
    """A DataLoader over whole batches (no collation, no workers: the batches are in memory)."""
    return DataLoader(batches, batch_size=None, shuffle=False, num_workers=0, pin_memory=pin_memory)


def math_precision(
    device: torch.device, autocast_dtype: torch.dtype | None, param_dtype: torch.dtype, has_conv: bool
) -> str:
    """Which datasheet peak the step's matmuls/convolutions run at: 'bf16', 'fp16', 'tf32' or 'fp32'
    (for MFU). fp32 work on CUDA counts as TF32 where PyTorch routes it to TF32 tensor cores."""
    return precision_key(
        autocast_dtype or param_dtype, tf32=device.type == "cuda" and tf32_enabled(conv=has_conv)
    )


@dataclass
class Job:
    """What a contender process trains: identical for every contender of a comparison (the
    model already built from the seed on the host, the same batches, recipe and clock)."""

    spec: dict[str, Any]
    device: torch.device
    model: nn.Module  # built from the seed on the host, not yet moved
    batches: BatchList
    clock: StepClock
    # (model, batch) -> loss; a --model workload's own
    loss_fn: Callable[[nn.Module, Any], Any] = default_loss
    moe: list[MoE] = field(init=False)  # the model's MoE layers, found once

    def __post_init__(self) -> None:
        self.moe = [layer for _, layer in moe_layers(self.model)]

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The scalar loss of ``batch`` (already on the device) under ``model``, plus the
        load-balancing losses of its MoE layers (``turbotrain.MoE``), as a plain loop adds them by
        hand; the turbotrain row's engine adds them itself, so every row trains the same objective."""
        loss = as_loss(self.loss_fn(model, batch))
        for layer in self.moe:
            aux = layer.take_aux_loss()
            loss = loss if aux is None else loss + aux
        return loss

    @property
    def optim(self) -> dict[str, Any]:
        return self.spec["optim"]

    @property
    def total_steps(self) -> int:
        return self.spec["warmup_steps"] + self.spec["timed_steps"]

    @property
    def has_conv(self) -> bool:
        return any(isinstance(m, nn.Conv2d) for m in self.model.modules())

    def plain_optimizer(
        self, model: nn.Module, **impl: bool
    ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
        """The recipe's AdamW (``impl``: fused=True, foreach=...) and its warmup schedule."""
        o = self.optim
        opt = torch.optim.AdamW(
            recipe_param_groups(model, o["weight_decay"]),
            lr=o["lr"],
            betas=tuple(o["betas"]),
            eps=o["eps"],
            **impl,
        )
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_factor(o["lr_warmup_steps"]))

    def plain_result(self, autocast_dtype: torch.dtype | None, **extra: Any) -> dict[str, Any]:
        """What a plain-PyTorch contender (fp32 weights, optional autocast) reports of its arithmetic."""
        return {
            "precision": "bf16-mixed" if autocast_dtype == torch.bfloat16 else "fp32",
            "compiled": False,
            "math_precision": math_precision(self.device, autocast_dtype, torch.float32, self.has_conv),
            **extra,
        }
