"""``batch.micro = 'auto'`` for a run (:func:`resolve_batch_size`: the search on the run's engine,
model and optimizer, cached in the run directory) and for Python users (:func:`get_optimal_batch_size`:
one call on a model and an example batch or a loader)."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...base.atomic import atomic_write
from ...base.batch import batch_size, map_tensors, move_to
from ...base.config import RunConfig
from ...base.rundir import BATCH_CACHE
from ...core.engine import Engine
from ...core.process_group import rank_world
from ...parts.data.sources import BYTE_VOCAB
from .finder import (
    CPU_MAX_STEP_S,
    DEFAULT_MAX_MICRO,
    BatchSearch,
    _agree_across_ranks,
    find_batch_size,
    plan_accumulation,
    usable_memory_bytes,
    world_size,
)
from .stats import storage_bytes
from .step_trial import StepTrial, token_batches

log = logging.getLogger(__name__)


def cache_key(
    config: RunConfig,
    engine: Engine,
    world: int,
    max_micro: int,
    slowdown_stop: float = 0.0,
    max_step_s: float = 0.0,
) -> tuple[str, dict[str, Any]]:
    """The cache entry's key: a hash of (model, precision, compile, sequence length, device,
    checkpointing, the search's own settings, world size), and the readable parts."""
    device = engine.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    b = config.batch
    parts = {
        "model": asdict(config.model),
        "precision": engine.precision.name,
        "compile": f"{engine.options.compile_scope}/{config.compile.mode}",
        "seq_len": config.model.block_size,
        "device": name,
        "checkpointing": config.memory.checkpointing,
        "pick": b.pick,
        "headroom": b.headroom,
        "max_memory_gib": b.max_memory_gib,
        "max_memory_fraction": b.max_memory_fraction,
        # old keys stay valid
        **({"memory_max_fraction": config.memory.max_fraction} if config.memory.max_fraction else {}),
        "max_micro": max_micro,
        "slowdown_stop": slowdown_stop,
        **({"max_step_s": max_step_s} if max_step_s else {}),  # CUDA's keys stay as they were
        "world": world,
        "torch": torch.__version__,
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return digest, parts


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_cache(path: Path, key: str, parts: dict[str, Any], search: BatchSearch) -> None:
    data = _read_cache(path)
    data[key] = {"key": parts, "search": search.to_dict()}
    atomic_write(path, json.dumps(data, indent=2, default=str) + "\n")


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
    slowdown_stop: float = 0.0,
    max_step_s: float | None = None,
) -> tuple[RunConfig, BatchSearch | None]:
    """Turn ``batch.micro = 'auto'`` into a number: search (or read the cache in ``run_dir``),
    fit the global batch, set ``engine.accumulation``, and return the config with concrete
    ``batch.micro`` and ``batch.accumulation`` plus the search (None when micro was a number).

    Call after ``engine.setup(model, optimizer)`` (so precision, compile and checkpointing are
    the run's) and before loading a checkpoint or training. ``make_batch(micro)`` builds a batch
    on the device (default: random tokens of ``model.block_size`` for the GPT); ``max_micro``
    bounds the search (default 1024, and the per-rank global batch when one is set).
    ``slowdown_stop`` (0 = off, the default on every device) stops growth once samples/s fall
    under that fraction of the best: a timing rule, so its answer can change with machine load.
    ``max_step_s`` bounds a step's measured time (None: :data:`CPU_MAX_STEP_S` on CPU, none on CUDA).
    """
    b = config.batch
    if isinstance(b.micro, int):
        return config, None
    world = world_size()
    global_size = b.global_size
    ceiling = min(max_micro or DEFAULT_MAX_MICRO, DEFAULT_MAX_MICRO)
    if global_size > 0:
        ceiling = min(ceiling, max(1, -(-global_size // world)))
    if max_step_s is None:
        max_step_s = CPU_MAX_STEP_S if engine.device.type == "cpu" else 0.0
    key, parts = cache_key(config, engine, world, ceiling, slowdown_stop, max_step_s)
    cache = Path(run_dir) / BATCH_CACHE if run_dir is not None else None
    entry = _read_cache(cache).get(key) if cache is not None else None
    search: BatchSearch | None = None
    if _agree_across_ranks(int(entry is not None)) and entry is not None:
        search = BatchSearch.from_dict(entry["search"])
        search.cached = True
    if search is None:
        if make_batch is None:
            vocab = (
                getattr(getattr(model, "cfg", None), "vocab_size", None)
                or config.model.vocab_size
                or BYTE_VOCAB
            )
            make_batch = token_batches(vocab, config.model.block_size, engine.device, seed=config.run.seed)
        # training's allocator cap: search under it
        cap = config.memory.max_fraction if engine.device.type == "cuda" else 0.0
        fraction = min((f for f in (b.max_memory_fraction, cap) if f > 0), default=0.0)
        budget = usable_memory_bytes(engine.device, b.max_memory_gib, fraction)
        if engine.device.type == "cpu" and budget is not None:  # the weights already sit in RAM
            budget += storage_bytes(list(model.parameters()) + list(model.buffers()))
        # timing rules decide on medians of 3
        timed = 3 if b.pick == "fastest" or slowdown_stop or max_step_s else 1
        with StepTrial(engine, model, optimizer, make_batch, loss_fn, timed_steps=timed) as trial:
            search = find_batch_size(
                trial,
                max_micro=ceiling,
                headroom=b.headroom,
                pick=b.pick,
                budget_bytes=budget,
                predict=engine.device.type != "cuda",  # on CPU a real OOM kills the process
                slowdown_stop=slowdown_stop,
                max_step_s=max_step_s,
            )
        search.found = search.micro = _agree_across_ranks(search.found)
        if cache is not None and rank_world()[0] == 0:
            _write_cache(cache, key, parts, search)
    micro, accumulation, total, note = plan_accumulation(search.found, global_size, b.accumulation, world)
    search.micro, search.accumulation, search.global_batch, search.world_size, search.note = (
        micro,
        accumulation,
        total,
        world,
        note,
    )
    log.info(search.describe())
    if note:
        log.warning("batch finder: %s", note)
    resolved = config.replace(batch={"micro": micro, "accumulation": accumulation})
    engine.set_accumulation(accumulation)
    return resolved, search


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
    if not isinstance(example, (torch.Tensor, tuple, list, dict)) and isinstance(example, Iterable):
        example = next(iter(example))
    engine = Engine(dict(config or {}))
    net = copy.deepcopy(model)
    opt = (
        type(optimizer)(net.parameters(), **optimizer.defaults)
        if optimizer is not None
        else torch.optim.AdamW(net.parameters())
    )
    net, opt, _ = engine.setup(net, opt)
    assert opt is not None
    rows = batch_size(example)
    base = move_to(example, engine.device)

    def make_batch(micro: int) -> Any:
        reps = -(-micro // rows)
        return map_tensors(
            base,
            lambda t: t.repeat(reps, *([1] * (t.dim() - 1)))[:micro] if t.dim() and len(t) == rows else t,
        )

    device = engine.device
    budget = usable_memory_bytes(device, max_memory_gib)
    if device.type == "cpu" and budget is not None:  # the weights already sit in RAM
        budget += storage_bytes(list(net.parameters()) + list(net.buffers()))
    max_step_s = CPU_MAX_STEP_S if device.type == "cpu" else 0.0
    timed = 3 if pick == "fastest" or max_step_s else 1
    with StepTrial(engine, net, opt, make_batch, loss_fn, timed_steps=timed) as trial:
        search = find_batch_size(
            trial,
            max_micro=max_micro,
            headroom=headroom,
            pick=pick,
            budget_bytes=budget,
            predict=device.type != "cuda",
            max_step_s=max_step_s,
        )
    search.micro = search.global_batch = search.found
    return search
