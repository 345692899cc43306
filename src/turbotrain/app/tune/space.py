"""The search space of ``turbotrain tune``: which settings, which values, on this device and model.

One :class:`Dim` per setting (a config key), with the values worth trying here and the base
config's resolved value (the baseline trial). A setting you fix with ``--section.key=value`` is
not searched. The micro-batch is searched as powers of two that divide the global batch
(micro x accumulation of the base config), accumulation following so the global batch, and so the
math, stays the same; its range comes from the batch finder (up to twice what fits at the base
settings: leaner settings, bf16 or activation checkpointing, may fit more).

Left out on purpose: the for-loop AdamW (never faster than foreach), compile modes other than
"default" on CPU (reduce-overhead and max-autotune target CUDA), fp16 on CPU (no GradScaler there),
the SDPA backend on CPU (one kernel there) and its "math" backend on CUDA (never the fastest).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ...base.config import (
    CHECKPOINTING_MODES,
    COMPILE_MODES,
    COMPILE_SCOPES,
    OPTIM_IMPLEMENTATIONS,
    RunConfig,
)
from ...core.optim import resolve_implementation
from ...core.precision import PRECISIONS, DeviceCaps, resolve_precision
from ...core.transforms import resolve_scope
from ...parts.data import default_num_workers
from ...parts.models.registry import spec_for

MICRO = "batch.micro"
COMPILE_MODE = "compile.mode"
SDPA_BACKEND = "model.sdpa_backend"
# unused when that is set so
CONDITIONAL = {COMPILE_MODE: ("compile.scope", "off"), SDPA_BACKEND: ("model.attention", "masked")}


@dataclass(frozen=True)
class Dim:
    """One searched setting: ``key`` (section.key), the values tried, the baseline's value."""

    key: str
    choices: tuple[Any, ...]
    base: Any

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ModelFacts:
    """What the target's model and data allow: a family of the registry (``gpt``: its spec's speed
    choices, e.g. the GPT's attention), repeated blocks (activation checkpointing, per-block
    compile), an own optimizer (no implementation choice), a DataLoader (workers can change)."""

    gpt: bool
    blocks: bool
    own_optimizer: bool
    dataloader: bool
    loader_workers: int | None = None  # a workload's DataLoader's own num_workers


def precision_choices(device: torch.device) -> tuple[str, ...]:
    """Every registered precision this device runs as it is, by its own check
    (:meth:`Precision.unavailable`: fp8 only on a GPU with float8 tensor cores and torchao
    installed, emulation is never searched) and not slower than fp32 by its own word
    (:meth:`Precision.slow_on`, what ``train`` warns with: bf16 on a CPU), so a tuned preset never
    holds a choice ``train`` warns against; in registry order."""
    caps = DeviceCaps.of(device)
    return tuple(
        name for name, cls in PRECISIONS.items() if not cls.slow_on(caps) and not cls.unavailable(caps)
    )


def micro_choices(global_batch: int, fits: int | None) -> tuple[int, ...]:
    """Powers of two dividing ``global_batch``, from an eighth of ``fits`` to twice it (all of
    them up to the global batch when the finder did not run)."""
    powers = [p for p in (2**i for i in range(16)) if p <= global_batch and global_batch % p == 0]
    if fits is None:
        return tuple(powers)
    chosen = [p for p in powers if max(1, fits // 8) <= p <= 2 * fits]
    return tuple(chosen or powers[:1])


def build_space(
    base: RunConfig, device: torch.device, facts: ModelFacts, fixed: set[str], micros: tuple[int, ...] | None
) -> list[Dim]:
    """The dimensions to search (see the module docstring)."""
    cuda = device.type == "cuda"
    cores = os.cpu_count() or 1
    dims: list[Dim] = []

    def add(key: str, choices: tuple[Any, ...], base_value: Any) -> None:
        if key in fixed or len(set(choices) | {base_value}) < 2:
            return
        values = tuple(dict.fromkeys((*choices, base_value)))  # the baseline's value is always a choice
        dims.append(Dim(key, values, base_value))

    add(
        "precision.mode",
        precision_choices(device),
        resolve_precision(base.precision.mode, DeviceCaps.of(device), base.precision),
    )
    scope = resolve_scope(base.compile.scope, device)
    add("compile.scope", tuple(s for s in COMPILE_SCOPES if facts.blocks or s != "blocks"), scope)
    if cuda:
        add(COMPILE_MODE, COMPILE_MODES, base.compile.mode)
    if micros and MICRO not in fixed and "batch.accumulation" not in fixed:
        base_micro = int(base.batch.micro) if isinstance(base.batch.micro, int) else micros[-1]
        below = max(m for m in micros if m <= max(base_micro, micros[0]))  # the nearest choice not above it
        add(MICRO, micros, base_micro if base_micro in micros else below)
    if facts.dataloader:
        workers = sorted({w for w in (0, 1, 2, 4, 8) if w <= max(2, cores)})
        add("data.num_workers", tuple(workers), _base_workers(base, device, facts))
    if facts.blocks:
        add("memory.checkpointing", CHECKPOINTING_MODES, base.memory.checkpointing)
    if not facts.own_optimizer:
        add(
            "optim.implementation",
            tuple(i for i in OPTIM_IMPLEMENTATIONS if i != "for-loop"),  # never faster than foreach
            resolve_implementation(base.optim.implementation, device),
        )
    if facts.gpt:  # the family's own speed settings, as its spec declares them
        for key, choices in spec_for(base).speed_choices(cuda).items():
            section, _, name = key.partition(".")
            add(key, choices, getattr(getattr(base, section), name))
    return dims


def _base_workers(base: RunConfig, device: torch.device, facts: ModelFacts) -> int:
    """The baseline's DataLoader workers: the config's, else the workload loader's, else the default."""
    if base.data.num_workers >= 0:
        return base.data.num_workers
    return facts.loader_workers if facts.loader_workers is not None else default_num_workers(device)


def applies(key: str, params: dict[str, Any]) -> bool:
    """Whether ``key`` means anything given the others: compile mode only when compiling, the
    SDPA backend only with SDPA attention."""
    parent = CONDITIONAL.get(key)
    return parent is None or params.get(parent[0]) != parent[1]


def base_params(space: list[Dim], value: Callable[[Dim], Any] = lambda d: d.base) -> dict[str, Any]:
    """The baseline trial: every dimension at the base config's value, or at ``value(d)`` (a trial's
    proposal); in order, as a conditional setting comes after the one that makes it apply or not."""
    params: dict[str, Any] = {}
    for d in space:
        if applies(d.key, params):
            params[d.key] = value(d)
    return params


def to_changes(params: Mapping[str, Any], global_batch: int) -> dict[str, dict[str, Any]]:
    """A trial's parameters as config overrides: the micro-batch brings its accumulation (the
    global batch stays), and a trial is measured as it asked (no halving on out-of-memory)."""
    out: dict[str, dict[str, Any]] = {"memory": {"on_oom": "stop"}}
    for key, value in params.items():
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name] = value
    if MICRO in params:
        out["batch"]["accumulation"] = global_batch // int(params[MICRO])
    return out
