"""Out-of-memory policy, through one guarded path (:func:`run_guarded`, own loop and ``fit`` alike).

``memory.on_oom = 'halve'`` re-runs the step from its first batch with each loader batch in twice as
many parts and accumulation doubled: data order, ``engine.state.batches`` (exact resume), the summed
gradient and the logged loss stay the whole batch's, and the split is saved with the engine's state.
``'stop'`` raises :class:`OutOfMemoryStop`. Data parallel: every policy stops at once naming the rank
(halving one rank alone would leave the others waiting). The tests inject a real error (tests/faults/oom.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import nn

from ..base.batch import batch_size
from ..base.config import OOM_POLICIES, choice_error, setting
from ..base.errors import TurbotrainError
from ..base.failure import first_line

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)

T = TypeVar("T")  # what a re-run step returns


class OutOfMemoryStop(TurbotrainError, torch.OutOfMemoryError):
    """Out of device memory with no retry allowed; still a ``torch.OutOfMemoryError``."""


def is_oom(exc: BaseException) -> bool:
    """True for torch's out-of-memory error and the RuntimeErrors CUDA libraries raise instead."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text)


class StopOnOOM:
    """``memory.on_oom = 'stop'``: an out-of-memory error becomes :class:`OutOfMemoryStop`."""

    def recover(
        self, engine: Engine, model: nn.Module, batches: Sequence[Any], reason: str, rerun: Callable[[], T]
    ) -> T:
        """After an out-of-memory error: make the step fit and return ``rerun()``, or raise."""
        raise OutOfMemoryStop(
            f"out of memory in step {engine.state.step + 1} with micro-batch {engine.micro_batch(batches[-1])} "
            f"({reason}; memory.on_oom = 'stop'); use {setting('memory.on_oom', 'halve')}, "
            f"{setting('batch.micro', 'auto')}, a smaller batch.micro or {setting('memory.checkpointing', 'full')}"
        )


class StopOnOOMDistributed(StopOnOOM):
    """Any ``memory.on_oom`` with more than one data-parallel process: stop with the rank named."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def recover(
        self, engine: Engine, model: nn.Module, batches: Sequence[Any], reason: str, rerun: Callable[[], T]
    ) -> T:
        micro = engine.micro_batch(batches[-1])
        raise OutOfMemoryStop(
            f"out of memory on rank {self.rank} of {self.world} in step {engine.state.step + 1} with micro-batch {micro} "
            f"({reason}); with data parallelism the micro-batch is not halved on one rank alone (the others would wait "
            f"for it), so the run stops: lower --batch.micro (e.g. {setting('batch.micro', max(1, micro // 2))}), "
            f"use {setting('batch.micro', 'auto')} or {setting('memory.checkpointing', 'full')}, then --resume"
        )


class HalveOnOOM(StopOnOOM):
    """``memory.on_oom = 'halve'``: double the split and re-run the step; stop when a part would be empty."""

    def recover(
        self, engine: Engine, model: nn.Module, batches: Sequence[Any], reason: str, rerun: Callable[[], T]
    ) -> T:
        while True:
            engine.discard_step(model)
            step = engine.state.step + 1
            if engine.split * 2 > min(batch_size(b) for b in batches):
                raise OutOfMemoryStop(
                    f"out of memory in step {step} even with micro-batch {engine.micro_batch(batches[0])} ({reason}); "
                    f"use {setting('memory.checkpointing', 'full')}, a lower precision, or a smaller model"
                )
            old_micro, old_acc = engine.micro_batch(batches[0]), engine.accumulation
            global_batch = batch_size(batches[0]) * old_acc // engine.split
            engine.set_split(engine.split * 2)
            detail = (
                f"out of memory in step {step} ({reason}); micro-batch {old_micro} -> {engine.micro_batch(batches[0])}, "
                f"accumulation {old_acc} -> {engine.accumulation}, global batch {global_batch} unchanged; "
                f"re-ran the step's {len(batches)} batch(es)"
            )
            log.warning("OOM recovery: %s", detail)
            engine.record_event("oom_recovery", detail, step)
            done, out, reason = _attempt(rerun)
            if done:
                return cast(T, out)


def run_guarded(
    engine: Engine, model: nn.Module, batches: Sequence[Any], run: Callable[[], T], rerun: Callable[[], T]
) -> T:
    """The one out-of-memory path: ``run()``; after an out-of-memory error the engine's OOM policy."""
    done, out, reason = _attempt(run)
    if done:
        return cast(T, out)
    # outside the except clause: the traceback, and the activations its frames held, are gone
    return engine.oom_policy.recover(engine, model, batches, reason, rerun)


def _attempt(call: Callable[[], T]) -> tuple[bool, T | None, str]:
    """(True, ``call()``, "") or, after an out-of-memory error, (False, None, its reason)."""
    try:
        return True, call(), ""
    except RuntimeError as exc:
        if not is_oom(exc):
            raise
        return False, None, first_line(exc, type(exc).__name__)


def run_guarded_batch(
    engine: Engine, model: nn.Module, kept: list[Any], batch: Any, run_one: Callable[[Any], T]
) -> T:
    """An own loop's ``batch`` through :func:`run_guarded`; a re-run runs ``kept`` again."""
    kept.append(batch)

    def rerun() -> T:
        for b in kept:
            out = run_one(b)
        return out

    return run_guarded(engine, model, kept, lambda: run_one(batch), rerun)


def build_oom_policy(on_oom: str, rank: int = 0, world: int = 1) -> StopOnOOM:
    """``memory.on_oom`` -> the policy (``world`` > 1: stop, naming ``rank``)."""
    if on_oom not in OOM_POLICIES:
        raise choice_error("memory.on_oom", on_oom, OOM_POLICIES)
    if world > 1:
        return StopOnOOMDistributed(rank, world)
    return HalveOnOOM() if on_oom == "halve" else StopOnOOM()
