"""``batch.micro = 'auto'`` for a run (:func:`resolve_batch_size`: the search on the run's engine,
model and optimizer, cached in the run directory) and for Python users (:func:`get_optimal_batch_size`:
one call on a model and an example batch or a loader)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...base.batch import batch_size, map_tensors, move_to
from ...base.config import RunConfig
from ...base.errors import TurbotrainError
from ...base.failure import EMPTY_LOADER, one_line
from ...base.rundir import BATCH_CACHE
from ...core.engine import Engine
from ...core.meter import cache as meter_cache
from ...core.meter.trial import copy_on
from ...core.oom import is_oom
from ...core.process_group import rank_world
from ...parts.data.sources import BYTE_VOCAB
from ...parts.models.registry import spec_for
from .finder import (
    CPU_MAX_STEP_S,
    DEFAULT_MAX_MICRO,
    BatchSearch,
    _agree_across_ranks,
    find_batch_size,
    plan_accumulation,
    usable_memory_bytes,
)
from .stats import storage_bytes
from .step_trial import StepTrial

log = logging.getLogger(__name__)


WHAT = "batch finder"


@dataclass(frozen=True)
class SearchRules:
    """A search's settings, all part of the cache key (timing rules: 0 = off)."""

    max_micro: int
    headroom: float
    pick: str
    slowdown_stop: float = 0.0
    max_step_s: float = 0.0


def cache_material(config: RunConfig, engine: Engine, world: int, rules: SearchRules) -> dict[str, Any]:
    """The decision cache's key material: the model section, the device and what changes the answer."""
    b = config.batch
    settings = {
        "precision": engine.precision.name,
        "compile": f"{engine.options.compile_scope}/{config.compile.mode}",
        "seq_len": spec_for(config).seq_len(config),
        "checkpointing": config.memory.checkpointing,
        "pick": rules.pick,
        "headroom": rules.headroom,
        "max_memory_gib": b.max_memory_gib,
        "max_memory_fraction": b.max_memory_fraction,
        "memory_max_fraction": config.memory.max_fraction,
        "max_micro": rules.max_micro,
        "slowdown_stop": rules.slowdown_stop,
        "max_step_s": rules.max_step_s,
        "world": world,
    }
    return meter_cache.material(settings, asdict(config.model), engine.device)


def _search(value: Any) -> BatchSearch:
    search = BatchSearch.from_dict(value)
    if not isinstance(search.found, int) or search.found < 1:
        raise ValueError(f"its micro-batch is {search.found!r}, not a positive integer")
    search.cached = True
    return search


def resolve_batch_size(
    config: RunConfig,
    engine: Engine,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    run_dir: Path | str | None = None,
    max_micro: int | None = None,
    make_batch: Callable[[int], Any] | None = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
) -> tuple[RunConfig, BatchSearch | None]:
    """Turn ``batch.micro = 'auto'`` into a number: search (or read the cache in ``run_dir``), fit
    the global batch, set ``engine.accumulation``; returns the config with concrete ``batch.micro``
    and ``batch.accumulation``, and the search (None when micro was a number). Call after
    ``engine.setup``, before loading a checkpoint. ``make_batch(micro)``: a batch on the device
    (default: the spec's random batch); ``max_micro``: the ceiling (default 1024, at most the
    per-rank global batch). A step over :data:`CPU_MAX_STEP_S` does not fit on CPU; none on CUDA."""
    b = config.batch
    if isinstance(b.micro, int):
        return config, None
    world = rank_world()[1]
    ceiling = min(max_micro or DEFAULT_MAX_MICRO, DEFAULT_MAX_MICRO)
    if b.global_size > 0:
        ceiling = min(ceiling, max(1, -(-b.global_size // world)))
    max_step_s = CPU_MAX_STEP_S if engine.device.type == "cpu" else 0.0
    rules = SearchRules(ceiling, b.headroom, b.pick, max_step_s=max_step_s)
    material = cache_material(config, engine, world, rules)
    key, cache = meter_cache.key_of(material), Path(run_dir) / BATCH_CACHE if run_dir is not None else None
    search = _read_cache(cache, material, key)
    if search is None:
        make_batch = make_batch or _random_batches(config, model, engine.device)
        budget = _run_budget(config, engine.device)
        search = _search_with(StepTrial(engine, model, optimizer, make_batch, loss_fn), rules, budget)
        search.found = search.micro = _agree_across_ranks(search.found)
        if cache is not None and rank_world()[0] == 0:
            meter_cache.write(cache, WHAT, material, search.to_dict(), key=key)
    micro, accumulation, search.global_batch, note = plan_accumulation(
        search.found, b.global_size, b.accumulation, world
    )
    search.micro, search.accumulation, search.world_size, search.note = micro, accumulation, world, note
    log.info(search.describe())
    if note:
        log.warning("batch finder: %s", note)
    engine.set_accumulation(accumulation)
    return config.replace(batch={"micro": micro, "accumulation": accumulation}), search


def _read_cache(cache: Path | None, material: dict[str, Any], key: str) -> BatchSearch | None:
    """The cached search, when every rank has one (else every rank searches)."""
    search = meter_cache.read(cache, WHAT, material, _search, key=key) if cache is not None else None
    return search if _agree_across_ranks(int(search is not None)) else None


def _run_budget(config: RunConfig, device: torch.device) -> int | None:
    """The memory a run's search may fill: under ``batch.max_memory_*`` and training's allocator cap."""
    cap = config.memory.max_fraction if device.type == "cuda" else 0.0
    fraction = min((f for f in (config.batch.max_memory_fraction, cap) if f > 0), default=0.0)
    return usable_memory_bytes(device, config.batch.max_memory_gib, fraction)


def _random_batches(config: RunConfig, model: nn.Module, device: torch.device) -> Callable[[int], Any]:
    """The model spec's random batches (tokens of its sequence length for a language model)."""
    spec = spec_for(config)
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None) or spec.vocab_size(config) or BYTE_VOCAB
    return spec.random_batch(config, vocab, device, seed=config.run.seed)


def _search_with(trial: StepTrial, rules: SearchRules, budget: int | None) -> BatchSearch:
    """The search on ``trial``'s engine and model (timing rules decide on medians of 3 steps)."""
    device = trial.engine.device
    if device.type == "cpu" and budget is not None:  # the weights already sit in RAM
        budget += storage_bytes(list(trial.model.parameters()) + list(trial.model.buffers()))
    timing = rules.pick == "fastest" or rules.slowdown_stop or rules.max_step_s
    trial.timed_steps = 3 if timing else 1  # timing rules: medians of 3
    with trial:
        return find_batch_size(
            trial,
            max_micro=rules.max_micro,
            headroom=rules.headroom,
            pick=rules.pick,
            budget_bytes=budget,
            predict=device.type != "cuda",  # on CPU a real OOM kills the process
            slowdown_stop=rules.slowdown_stop,
            max_step_s=rules.max_step_s,
        )


def _check_finder_call(model: Any, example: Any, config: Any, max_micro: Any) -> Any:
    """get_optimal_batch_size's arguments, a wrong one one line; returns the example batch."""
    name = "get_optimal_batch_size"
    if not isinstance(model, nn.Module):
        raise TurbotrainError(
            f"{name}: model = {model!r:.60} is not a torch.nn.Module; pass the model to size"
        )
    if config is not None and not isinstance(config, Mapping):
        raise TurbotrainError(
            f"{name}: config = {config!r:.60} is not a dict of config sections, e.g. {{'run': {{'device': 'cuda'}}}}"
        )
    if isinstance(max_micro, bool) or not isinstance(max_micro, int) or max_micro < 1:
        raise TurbotrainError(f"{name}: max_micro = {max_micro!r:.60} is not a whole number >= 1")
    if not isinstance(example, (torch.Tensor, tuple, list, dict)) and isinstance(example, Iterable):
        first = next(iter(example), None)
        if first is None:
            raise TurbotrainError(f"{name}: example: {EMPTY_LOADER.replace('train_loader', 'loader')}")
        example = first
    if batch_size(example) < 1:
        raise TurbotrainError(f"{name}: example has 0 rows; give a batch (or a loader) of at least one row")
    return example


def get_optimal_batch_size(
    model: nn.Module,
    example: Any,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    config: dict[str, dict[str, Any]] | None = None,
    pick: str = "largest",
    headroom: float = 0.10,
    max_micro: int = DEFAULT_MAX_MICRO,
    max_memory_gib: float = 0.0,
) -> BatchSearch:
    """The micro-batch that fits your model, in one call: ``search = get_optimal_batch_size(model,
    batch)`` (``search.found``: the size; ``search.trials``: each size tried with its peak bytes and
    step seconds; ``search.describe()``: one line).

    ``example`` is one batch (tensors, tuples, dicts: rows along dim 0) or a loader (its first batch
    is taken); a size of ``micro`` rows is made by repeating its rows. Each trial is a real training
    step of a copy of ``model`` (yours is untouched) with ``optimizer``'s type and settings (default
    AdamW) on the device and precision of ``config`` (``{"run": {"device": "cuda"}, "precision":
    {"mode": "bf16-mixed"}}``; default: turbotrain's defaults here), ``loss_fn(model, batch)``
    (default: ``model(*batch)`` returns the loss). ``pick``, ``headroom``, ``max_micro`` and
    ``max_memory_gib`` are ``batch.pick``, ``batch.headroom``, the search's ceiling and
    ``batch.max_memory_gib`` (0: the device's free memory; on CPU the available RAM, and steps
    longer than 1 s count as too large)."""
    example = _check_finder_call(model, example, config, max_micro)
    engine = Engine(dict(config or {}))
    net, opt = copy_on(engine, model, optimizer or torch.optim.AdamW)
    assert opt is not None
    max_step_s = CPU_MAX_STEP_S if engine.device.type == "cpu" else 0.0
    trial = StepTrial(engine, net, opt, _repeated_rows(move_to(example, engine.device)), loss_fn)
    budget = usable_memory_bytes(engine.device, max_memory_gib)
    try:
        search = _search_with(trial, SearchRules(max_micro, headroom, pick, 0.0, max_step_s), budget)
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:  # not out-of-memory: the step itself
        if isinstance(exc, TurbotrainError) or is_oom(exc):
            raise
        raise TurbotrainError(
            f"get_optimal_batch_size: a training step of the search failed: {one_line(exc)}"
        ) from None
    search.micro = search.global_batch = search.found
    return search


def _repeated_rows(base: Any) -> Callable[[int], Any]:
    """``micro -> a batch of micro rows``: ``base``'s rows repeated (tensors without its rows kept)."""
    rows = batch_size(base)

    def make_batch(micro: int) -> Any:
        reps = -(-micro // rows)
        return map_tensors(
            base,
            lambda t: t.repeat(reps, *([1] * (t.dim() - 1)))[:micro] if t.dim() and len(t) == rows else t,
        )

    return make_batch
