"""Restoring a run from its checkpoint folder, top-down: choose, then load into one process or many."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...base.errors import TurbotrainError
from ...core.main_rank import ReportedByMainRank
from ...core.process_group import in_group, rank_world
from . import dcp
from .choose import ShapeMismatch, model_settings_changed, model_shapes, newest_usable, shape_problem
from .format import (
    checkpoint_step,
    list_checkpoints,
    read_payload,
    read_rank_state,
    read_state,
    require_verified,
    saved_world,
)
from .state import RunState, load_entry, reseed

log = logging.getLogger(__name__)


def restore_latest(
    folder: Path, state: RunState, before_load: Callable[[Path, int, dict[str, Any]], None] | None = None
) -> Path:
    """Load the newest checkpoint in ``folder`` that verifies and holds every entry of ``state``
    (either kind, any world size); returns its path. Under a process group rank 0 chooses and every
    rank loads it (a collective). ``before_load(path, world, entries)`` sees the choice on every rank
    before anything loads, and may refuse it by raising."""
    rank, world = rank_world()
    if not in_group():
        path, payload = _pick(folder, state)
    else:
        box: list[Any] = [None]
        if rank == 0:
            try:
                box = [("", _pick(folder, state)[0].name)]
            except TurbotrainError as exc:
                box = [(str(exc), "")]
        dist.broadcast_object_list(box, src=0)  # every rank loads rank 0's choice (a collective load follows)
        problem, name = box[0]
        if problem:  # said once, by rank 0, which found it; the others end quietly
            raise TurbotrainError(problem) if rank == 0 else ReportedByMainRank(problem)
        path, payload = folder / name, None
    if path.is_dir():
        if before_load is not None:
            before_load(path, saved_world(path), read_state(path).get("entries", {}))
        _load_sharded(path, state, rank, world)
        return path
    payload = payload if payload is not None else read_payload(path, required=state.required)
    if before_load is not None:
        before_load(path, 1, payload)
    if world == 1 and not in_group():
        state.load_state_dict(payload, source=path.name)  # the one-process format in one process: as always
    else:
        _load_pt_into_ranks(path, payload, state, rank, world)
    return path


def _pick(folder: Path, state: RunState) -> tuple[Path, dict[str, Any] | None]:
    """The newest checkpoint a load accepts (it verifies, holds what ``state`` needs and fits
    ``state.model``), with a ``.pt`` one's payload."""
    expected = model_shapes(state.model) if state.model is not None else {}
    current = state["config"][0]() if "config" in state else None  # a training run's config, as TOML

    def fits(name: str, saved: dict[str, tuple[int, ...]], saved_config: Any) -> None:
        if expected and (
            problem := shape_problem(name, saved, expected, model_settings_changed(saved_config, current))
        ):
            raise ShapeMismatch(problem)

    def read(path: Path) -> dict[str, Any] | None:
        if not path.is_dir():
            payload = read_payload(path, required=state.required)
            weights = payload.get(state.model_key) if state.model_key else None
            if isinstance(weights, dict):
                shapes = {k: tuple(v.shape) for k, v in weights.items() if isinstance(v, torch.Tensor)}
                fits(path.name, shapes, payload.get("config"))
            return payload
        require_verified(path)
        entries = read_state(path).get("entries", {})
        missing = state.missing(entries, state.replicated_keys)
        if missing:
            raise TurbotrainError(f"{path.name} holds no {', '.join(missing)} state")
        saved = dcp.saved_model_tensors(path)  # .metadata through the safe reader
        fits(path.name, {name: tuple(meta.size) for name, meta in saved.items()}, entries.get("config"))
        return None

    return newest_usable(list_checkpoints(folder), folder, read)


def _load_sharded(path: Path, state: RunState, rank: int, world: int) -> None:
    """A sharded checkpoint into this process: the model and optimizer through DCP (resharded), the
    replicated entries from ``state.pt``, this rank's own from ``rankR.pt``."""
    replicated = read_state(path)
    entries = replicated.get("entries", {})
    state.check_holds(entries, path.name, state.replicated_keys)
    own = read_rank_state(path, rank, world)
    model = lambda m: dcp.load_into(path, m, state.optimizer, replicated)  # noqa: E731
    _load_entries(path, state, rank, world, entries, own, model)


def _load_pt_into_ranks(path: Path, payload: dict[str, Any], state: RunState, rank: int, world: int) -> None:
    """A one-process checkpoint into the ranks of a ddp/fsdp run: each keeps its part."""
    own = {k: payload[k] for k in state.per_rank} if world == 1 else None
    optim = payload.get(state.optimizer_key) if state.optimizer_key else None
    model = lambda m: dcp.load_full(m, state.optimizer, payload[str(state.model_key)], optim, path.name)  # noqa: E731
    _load_entries(path, state, rank, world, payload, own, model)


def _load_entries(
    path: Path,
    state: RunState,
    rank: int,
    world: int,
    entries: dict[str, Any],
    own: dict[str, Any] | None,
    load_model: Callable[[torch.nn.Module], None],
) -> None:
    """Every entry of ``state`` in load order: the model (and its optimizer) by ``load_model``."""
    for name, (_, load) in state.items():
        if name == state.model_key and state.model is not None:
            load_model(state.model)
        elif name in state.tensor_keys:
            continue  # the optimizer: loaded with the model
        elif name in state.per_rank:
            _load_per_rank(name, load, own, path, rank, world)
        elif name in entries:  # an optional entry the checkpoint lacks starts fresh
            load_entry(name, load, entries[name], path.name)


def _load_per_rank(
    name: str, load: Callable[[Any], None], own: dict[str, Any] | None, path: Path, rank: int, world: int
) -> None:
    """A per-rank entry (the RNG): this rank's own when the world size matches, else re-seeded."""
    if own is not None and name in own:
        load_entry(name, load, own[name], path.name)
    elif name == "rng":
        reseed(checkpoint_step(path), rank)
        if rank == 0:
            log.warning(
                "%s was written by %d process(es), this run has %d: random number generators re-seeded from "
                "(step, rank) (the data order does not depend on them)",
                path.name,
                saved_world(path) if path.is_dir() else 1,
                world,
            )
    else:
        log.warning("%s: no %s state for rank %d of %d; it starts fresh", path.name, name, rank, world)


def load_latest_weights(folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The model weights of the newest verified checkpoint (either kind) as one plain state dict."""

    def read(path: Path) -> dict[str, torch.Tensor]:
        if not path.is_dir():
            return read_payload(path, required=("model",))["model"]
        require_verified(path)
        return dcp.load_model_weights(path)

    return newest_usable(list_checkpoints(folder), folder, read, advice="", none="train first")


def load_latest(folder: Path, required: tuple[str, ...] = ()) -> tuple[Path, dict[str, Any]]:
    """The newest ``.pt`` checkpoint that verifies and holds every key in ``required``."""
    candidates = [p for p in list_checkpoints(folder) if not p.is_dir()]
    return newest_usable(candidates, folder, lambda path: read_payload(path, required))
