"""Checkpoints that survive crashes and never execute code on load.

Save: ``torch.save`` through :func:`turbotrain.base.atomic.atomic_write`, then a ``.sha256`` sidecar
written the same way. Load: newest first, verify the checksum, load with ``weights_only=True``
(no arbitrary unpickling); a corrupt, foreign or incomplete file falls back to the previous.
Pruning (:func:`prune`) counts only checkpoints that verify, so ``keep_last`` never deletes the
last usable one. What a checkpoint holds is one :class:`RunState` registry, saved by the
:class:`Checkpointer` and loaded by :func:`restore_latest`.

Two formats, chosen by the run's strategy: one process writes the ``step_XXXXXXXX.pt`` file above;
ddp and fsdp runs write a ``step_XXXXXXXX/`` folder through torch.distributed.checkpoint
(:mod:`turbotrain.loop.sharded`: every rank its shards, a finished marker with checksums). Listing,
verification, pruning (keep-last counts both) and resume treat both alike: a resume loads the newest
verified checkpoint of either kind into any world size, and :func:`load_latest_weights` reads the
model of either in one plain process (``turbotrain sample``).
"""

from __future__ import annotations

import collections
import copy
import hashlib
import logging
import pickle
import re
import shutil
import threading
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ..base.atomic import atomic_write, clean_stale_temps
from ..base.config import MODEL_SECTIONS, TrainConfig, migrate
from ..base.errors import TurbotrainError
from ..base.seeds import rng_state, seed_all, set_rng_state
from ..core.distributed import ReportedByMainRank, Strategy, in_group, new_gloo_group, rank_world
from ..core.engine import Engine
from . import sharded
from .hooks import FitContext, Hook, every

log = logging.getLogger(__name__)

FORMAT = 1
_NAME = re.compile(r"^step_(\d{8,})(\.pt)?$")  # a .pt file (one process) or a folder (sharded)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checkpoint_path(folder: Path, step: int) -> Path:
    return folder / f"step_{step:08d}.pt"


def checkpoint_step(path: Path) -> int:
    """The optimizer step a checkpoint (file or sharded folder) was saved at (from its name)."""
    m = _NAME.match(path.name)
    if m is None:
        raise ValueError(f"{path.name} is not a checkpoint file name")
    return int(m[1])


def sidecar(path: Path) -> Path:
    """The checksum file next to a checkpoint."""
    return path.with_name(path.name + ".sha256")


def _is_checkpoint(path: Path) -> bool:
    m = _NAME.match(path.name)
    return m is not None and (path.is_file() if m[2] else path.is_dir())


def list_checkpoints(folder: Path) -> list[Path]:
    """Checkpoints in ``folder``, ``.pt`` files and sharded folders, oldest (lowest step) first."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if _is_checkpoint(p)), key=checkpoint_step)


def finished_checkpoints(folder: Path) -> list[Path]:
    """Checkpoints whose save finished (a file's checksum file, a folder's finished marker
    exists), oldest first. A file without one is a save killed between the rename and the
    checksum; a folder without one a sharded save killed mid-way: neither counts as a checkpoint."""
    return [
        p
        for p in list_checkpoints(folder)
        if (sharded.is_finished(p) if p.is_dir() else sidecar(p).is_file())
    ]


def _stamp(path: Path) -> tuple[str, int, int, int] | None:
    """What a remembered verification is tied to: sizes and modification times (of a folder, of
    every file in it)."""
    try:
        if path.is_dir():
            stats = [p.stat() for p in path.iterdir()]
            return (
                str(path),
                sum(st.st_size for st in stats),
                max((st.st_mtime_ns for st in stats), default=0),
                (path / sharded.MARKER).stat().st_mtime_ns,
            )
        st, side = path.stat(), sidecar(path).stat()
    except OSError:
        return None
    return str(path), st.st_size, st.st_mtime_ns, side.st_mtime_ns


_VERIFIED: dict[tuple[str, int, int, int], bool] = {}  # (path, size, mtimes) -> checksum matched


def _check_digest(path: Path) -> str:
    """'' when ``path`` matches its sidecar (a folder: its finished marker), else why not. The
    sidecar's bytes are read as they are: a damaged one (not even ASCII) is a mismatch, not a crash."""
    if path.is_dir():
        return sharded.check(path)
    try:
        raw = sidecar(path).read_bytes()
    except FileNotFoundError:
        return f"{path.name} has no checksum file"
    except OSError as exc:
        return f"{path.name}'s checksum file cannot be read ({exc.strerror})"
    words = raw.split()
    expected = words[0].decode("ascii", "replace") if words else ""
    try:
        actual = sha256_of(path)
    except OSError as exc:
        return f"{path.name} cannot be read ({exc.strerror})"
    return "" if actual == expected else f"{path.name} does not match its checksum (truncated or corrupt)"


def is_verified(path: Path) -> bool:
    """Whether ``path`` matches its checksum file. Remembered per (size, modification times),
    so pruning after every save hashes each checkpoint once, not every time."""
    stamp = _stamp(path)
    if stamp is None:
        return False
    if stamp not in _VERIFIED:
        _VERIFIED[stamp] = not _check_digest(path)
    return _VERIFIED[stamp]


def latest_verified(folder: Path) -> Path | None:
    """The newest checkpoint in ``folder`` that matches its checksum, or None."""
    return next((p for p in reversed(list_checkpoints(folder)) if is_verified(p)), None)


def prune(folder: Path, keep_last: int) -> list[Path]:
    """The one pruning rule: keep the newest ``keep_last`` checkpoints that verify against their
    checksums and delete every checkpoint older than the oldest of them. Files that do not verify
    never count as kept, so they cannot push a usable checkpoint out; one newer than the kept ones
    stays (a resume skips it; a save at its step replaces it). Checksum files whose checkpoint is
    gone go too. Returns the deleted checkpoints."""
    candidates = list_checkpoints(folder)
    kept: list[Path] = []
    for path in reversed(candidates):  # newest first; stops hashing once enough are found
        if len(kept) == keep_last:
            break
        if is_verified(path):
            kept.append(path)
    if not kept:
        return []
    oldest = checkpoint_step(kept[-1])
    deleted = [p for p in candidates if checkpoint_step(p) < oldest]
    for old in deleted:
        if old.is_dir():  # the marker first: a half-deleted folder is then an unfinished save
            (old / sharded.MARKER).unlink(missing_ok=True)
            shutil.rmtree(old, ignore_errors=True)
            continue
        old.unlink(missing_ok=True)  # the checkpoint first: an orphaned checksum file is harmless
        sidecar(old).unlink(missing_ok=True)
    for orphan in folder.glob("step_*.pt.sha256"):
        if not orphan.with_name(orphan.name[: -len(".sha256")]).exists():
            orphan.unlink(missing_ok=True)
    live = {str(p) for p in candidates} - {str(p) for p in deleted}
    for stamp in [k for k in _VERIFIED if k[0] not in live and Path(k[0]).parent == folder]:
        del _VERIFIED[stamp]  # forget deleted files: the memory stays flat over long runs
    return deleted


def save_checkpoint(folder: Path, step: int, payload: dict[str, Any], keep_last: int = 3) -> Path:
    """Write ``payload`` atomically as ``step_XXXXXXXX.pt`` with its checksum; prune old ones
    (:func:`prune`). Lack of space raises :class:`turbotrain.base.atomic.DiskFullError`; the older
    checkpoints are untouched then."""
    folder.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(folder, step)
    atomic_write(path, lambda f: torch.save({"format": FORMAT, **payload}, f))
    digest = sha256_of(path)  # read back from the disk: what the sidecar vouches for is what is there
    atomic_write(sidecar(path), f"{digest}  {path.name}\n")
    stamp = _stamp(path)
    if stamp is not None:
        _VERIFIED[stamp] = True
    prune(folder, keep_last)
    return path


def _verified_load(path: Path, required: tuple[str, ...] = ()) -> dict[str, Any]:
    problem = _check_digest(path)
    if problem:
        raise TurbotrainError(problem)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means an unusable file
        raise TurbotrainError(unreadable(path.name, exc)) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise TurbotrainError(f"{path.name} is not a turbotrain checkpoint (format {FORMAT})")
    missing = [key for key in required if key not in payload]
    if missing:
        raise TurbotrainError(f"{path.name} holds no {', '.join(missing)} state")
    return payload


_REFUSED_GLOBAL = re.compile(r"Unsupported (?:global|class): (?:GLOBAL )?([\w.]+)")


def unreadable(name: str, exc: BaseException) -> str:
    """Why ``torch.load(..., weights_only=True)`` refused file ``name``, in one line. A file
    that holds objects other than tensors and plain types (a pickle that would run code) says
    so, and that it was not loaded: torch's own text reads as advice to load it anyway."""
    text = " ".join(str(exc).split())
    if isinstance(exc, pickle.UnpicklingError) or "weights_only" in text or "WeightsUnpickler" in text:
        found = _REFUSED_GLOBAL.search(text)
        what = f" ({found[1]})" if found else ""
        return (
            f"{name} holds objects that are refused{what}: it was not loaded (a checkpoint holds tensors and "
            "plain types only; anything else could run code when read)"
        )
    return f"{name} cannot be read: {text[:200]}"


def _plain_name(name: str) -> str:
    """A state-dict key without the wrappers' parts (DDP's ``module.``, torch.compile's ``_orig_mod.``)."""
    return ".".join(part for part in name.split(".") if part not in ("module", "_orig_mod"))


def model_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor ``model``'s state dict holds (persistent buffers included; a
    sharded parameter's full shape), keyed by plain names. Read from the modules themselves, not
    ``state_dict()``: no state-dict hook runs (expert parallelism's gathers every rank's
    experts, a collective). Modules with load-time hooks (MoE layers grow or slice their experts
    while loading) are left out: what fits them is theirs to decide."""
    shapes: dict[str, tuple[int, ...]] = {}
    hooked: list[str] = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        if module._load_state_dict_pre_hooks:
            hooked.append(prefix + ".")
        if any((prefix + ".").startswith(h) for h in hooked):
            continue
        tensors = list(module._parameters.items()) + [
            (n, b) for n, b in module._buffers.items() if n not in module._non_persistent_buffers_set
        ]
        for name, tensor in tensors:
            if tensor is not None:
                shapes[_plain_name(f"{prefix}.{name}" if prefix else name)] = tuple(tensor.shape)
    return shapes


def model_settings_changed(saved_toml: Any, current_toml: Any) -> str:
    """The model settings (:data:`MODEL_SECTIONS`) that differ between the config a checkpoint was
    saved with and this run's (both as ``to_toml`` text; an old one's moved settings read in their
    new place), as flags that give back the saved values; '' when either is unknown or none differs."""
    try:
        saved, current = (migrate(tomllib.loads(t)) for t in (saved_toml, current_toml))
    except (TypeError, ValueError, AttributeError):
        return ""
    changed = [
        (s, k)
        for s in MODEL_SECTIONS
        for k in saved.get(s, {})
        if k in current.get(s, {}) and saved[s][k] != current[s][k]
    ]
    return " ".join(f"--{s}.{k}={saved[s][k]}" for s, k in changed)


def shape_problem(
    name: str, saved: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], settings: str = ""
) -> str:
    """'' when the model tensors of checkpoint ``name`` (``saved``: plain name -> shape) fit a
    model of ``expected`` shapes, else one line naming the first that does not, and the
    ``settings`` (flags, from :func:`model_settings_changed`) that would build the saved model."""
    saved = {_plain_name(k): tuple(v) for k, v in saved.items()}
    missing = [k for k in expected if k not in saved]
    differ = [k for k in expected if k in saved and saved[k] != expected[k]]
    if not missing and not differ:
        return ""
    parts = []
    if differ:
        k = differ[0]
        parts.append(
            f"{len(differ)} tensor(s) of another shape, e.g. {k}: saved {list(saved[k])}, this config builds "
            f"{list(expected[k])}"
        )
    if missing:
        parts.append(f"{len(missing)} tensor(s) this config builds missing, e.g. {missing[0]}")
    again = f"; it was saved with {settings}" if settings else ""
    return f"{name} does not fit the model this config builds: it was saved by a model of another shape ({'; '.join(parts)}){again}"


def _sharded_model_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The model tensors' full shapes in sharded checkpoint ``path``, from its ``.metadata`` read
    by :func:`turbotrain.loop.sharded.read_metadata` (a ``.metadata`` holding anything else is refused:
    a one-line TurbotrainError)."""
    return {name: tuple(meta.size) for name, meta in sharded.saved_model_tensors(path).items()}


class ShapeMismatch(TurbotrainError):
    """A checkpoint that verifies, but whose model has another shape than the one built here."""


T = TypeVar("T")

RESUME_ADVICE = (
    "move them away and resume to restart this run from step 0, or start a new run without --resume"
)
SHAPE_ADVICE = (
    "resume with the model settings the run was saved with (its config.toml), or start a new run "
    "without --resume"
)


def newest_usable(
    candidates: list[Path],
    folder: Path,
    read: Callable[[Path], T],
    advice: str = RESUME_ADVICE,
    none: str = "start without --resume",
) -> tuple[Path, T]:
    """The newest of ``candidates`` that ``read`` accepts, with what it returned; each one it
    refuses (a TurbotrainError: corrupt, unfinished, foreign, incomplete) is skipped with a
    warning, and when none is left the error lists why each was refused."""
    if not candidates:
        raise TurbotrainError(f"no checkpoint in {folder}; {none}")
    problems, shapes = [], 0
    for path in reversed(candidates):
        try:
            return path, read(path)
        except TurbotrainError as exc:
            log.warning("skipping checkpoint: %s", exc)
            problems.append(str(exc))
            shapes += isinstance(exc, ShapeMismatch)
    if advice and shapes == len(problems):  # every one is another model's: moving them away is not the answer
        advice = SHAPE_ADVICE
    raise TurbotrainError(
        f"no usable checkpoint in {folder} ({'; '.join(problems)})" + (f"; {advice}" if advice else "")
    )


def _verified_folder(path: Path) -> None:
    """Raise, saying why, unless the sharded checkpoint folder ``path`` matches its marker."""
    if not is_verified(path):
        raise TurbotrainError(_check_digest(path) or f"{path.name} does not verify")


def load_latest(folder: Path, required: tuple[str, ...] = ()) -> tuple[Path, dict[str, Any]]:
    """The newest one-process (``.pt``) checkpoint that verifies and holds every key in
    ``required``; corrupt, foreign or incomplete ones are skipped with a warning. Sharded folders
    are not read here: :func:`restore_latest` and :func:`load_latest_weights` read both kinds."""
    candidates = [p for p in list_checkpoints(folder) if not p.is_dir()]
    return newest_usable(candidates, folder, lambda path: _verified_load(path, required))


Stateful = tuple[Callable[[], Any], Callable[[Any], None]]  # (state_dict, load_state_dict)


class RunState(dict[str, Stateful]):
    """The registry of a run's stateful objects, in load order: name -> (state_dict,
    load_state_dict). Entries may be given as objects with those two methods.

    For sharded checkpoints it also remembers which entry is the model (an ``nn.Module``) and which
    the optimizer (a ``torch.optim.Optimizer``): those two go through torch.distributed.checkpoint,
    by parameter name, so they reshard. Entries in ``per_rank`` (the RNG) differ from rank to rank:
    saved per rank, restored when the world size matches, otherwise re-seeded (:func:`reseed`).
    ``strategy`` (set by :func:`run_state`) picks the format a :class:`Checkpointer` writes."""

    def __init__(self, **entries: Any) -> None:
        super().__init__(
            {k: v if isinstance(v, tuple) else (v.state_dict, v.load_state_dict) for k, v in entries.items()}
        )
        self.model_key = next((k for k, v in entries.items() if isinstance(v, nn.Module)), None)
        self.optimizer_key = next(
            (k for k, v in entries.items() if isinstance(v, torch.optim.Optimizer)), None
        )
        self.model: nn.Module | None = entries[self.model_key] if self.model_key else None
        self.optimizer: torch.optim.Optimizer | None = (
            entries[self.optimizer_key] if self.optimizer_key else None
        )
        self.per_rank: frozenset[str] = frozenset({"rng"} & set(entries))
        self.strategy: Strategy | None = None

    def state_dict(self) -> dict[str, Any]:
        return {name: save() for name, (save, _) in self.items()}

    def load_state_dict(self, payload: dict[str, Any], source: str = "checkpoint") -> None:
        missing = [name for name in self if name not in payload]
        if missing:  # checked before anything loads: never half a state
            raise TurbotrainError(
                f"{source} holds no {', '.join(missing)} state; it was not saved by this kind of run"
            )
        for name, (_, load) in self.items():
            _load_entry(name, load, payload[name], source)

    @property
    def tensor_keys(self) -> tuple[str, ...]:
        """The entries a sharded checkpoint stores through DCP (the model and its optimizer)."""
        return tuple(
            k for k in (self.model_key, self.optimizer_key) if k is not None and self.model is not None
        )

    @property
    def replicated_keys(self) -> tuple[str, ...]:
        """The entries every rank holds alike (the engine, scheduler, config, ...)."""
        return tuple(k for k in self if k not in self.tensor_keys and k not in self.per_rank)


def _load_entry(name: str, load: Callable[[Any], None], value: Any, source: str) -> None:
    try:
        load(value)
    # shapes or groups changed by overrides
    except (
        RuntimeError,
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
    ) as exc:
        detail = " ".join(str(exc).split())[:300]
        raise TurbotrainError(
            f"{source}: its {name} state does not fit the {name} this config builds "
            f"({detail}); resume with the settings the run was saved with (its config.toml)"
        ) from None


def run_state(
    engine: Engine,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    **extra: Any,
) -> RunState:
    """What a training run saves and resumes: the engine first (its state holds the data position,
    ``state.batches``, and a precision fallback it restores recasts the weights, so they must load
    after it), then model, optimizer, scheduler (when there is one), every RNG, and ``extra``.
    The engine's strategy picks the checkpoint format (one process: ``.pt``; ddp/fsdp: sharded)."""
    entries: dict[str, Any] = {
        "engine": (engine.state_dict, lambda sd: engine.load_state_dict(sd, optimizer)),
        "model": model,
        "optimizer": optimizer,
    }
    if scheduler is not None:
        entries["scheduler"] = scheduler
    state = RunState(**entries, rng=(rng_state, set_rng_state), **extra)
    state.strategy = engine.strategy
    return state


def reseed(step: int, rank: int) -> None:
    """Seed every RNG from (step, rank): the deterministic stand-in for per-rank RNG state saved
    by another world size. (The data order does not depend on it: it comes from the seed and the
    batch index.)"""
    seed_all((step * 1_000_003 + rank) % 2**32)


def _pick(folder: Path, state: RunState) -> tuple[Path, dict[str, Any] | None]:
    """The newest checkpoint of either kind that a load will accept (with the payload of a ``.pt``
    one, read already): it verifies, holds what ``state`` needs, its model tensors have the shapes
    of ``state.model``, and a sharded one's ``.metadata`` passes the safe reader. Each one refused
    is skipped with a one-line warning saying why: the choice is made before anything loads."""
    expected = model_shapes(state.model) if state.model is not None else {}
    current = state["config"][0]() if "config" in state else None  # a training run's config, as TOML

    def fits(name: str, saved: dict[str, tuple[int, ...]], saved_config: Any) -> None:
        problem = (
            shape_problem(name, saved, expected, model_settings_changed(saved_config, current))
            if expected
            else ""
        )
        if problem:
            raise ShapeMismatch(problem)

    def read(path: Path) -> dict[str, Any] | None:
        if not path.is_dir():
            payload = _verified_load(path, required=tuple(state))
            weights = payload.get(state.model_key) if state.model_key else None
            if isinstance(weights, dict):
                fits(
                    path.name,
                    {k: tuple(v.shape) for k, v in weights.items() if isinstance(v, torch.Tensor)},
                    payload.get("config"),
                )
            return payload
        _verified_folder(path)
        entries = sharded.read_state(path).get("entries", {})
        missing = [k for k in state.replicated_keys if k not in entries]
        if missing:
            raise TurbotrainError(f"{path.name} holds no {', '.join(missing)} state")
        # .metadata through the safe reader
        fits(path.name, _sharded_model_shapes(path), entries.get("config"))
        return None

    return newest_usable(list_checkpoints(folder), folder, read)


def restore_latest(
    folder: Path, state: RunState, before_load: Callable[[Path, int, dict[str, Any]], None] | None = None
) -> Path:
    """Load the newest checkpoint in ``folder`` that verifies and holds every entry of ``state``
    into ``state``; returns its path. Either kind loads into any world size: a ``.pt`` written by
    one process into ddp/fsdp ranks, a sharded folder written by N processes into M (or into one
    plain process). Under a process group rank 0 chooses (it alone verifies checksums) and every
    rank loads that one: a collective, every rank calls it. ``before_load(path, world, entries)``,
    when given, sees the chosen checkpoint on every rank before anything loads: how many processes
    wrote it and its replicated entries (engine, config, ...); it may refuse it by raising."""
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
    if not path.is_dir() and payload is None:
        payload = _verified_load(path, required=tuple(state))
    if before_load is not None:
        if path.is_dir():
            before_load(path, sharded.saved_world(path), sharded.read_state(path).get("entries", {}))
        else:
            before_load(path, 1, payload or {})
    if path.is_dir():
        _load_sharded(path, state, rank, world)
        return path
    assert payload is not None
    if world == 1 and not in_group():
        state.load_state_dict(payload, source=path.name)  # the one-process format in one process: as always
    else:
        _load_pt_into_ranks(path, payload, state, rank, world)
    return path


def _load_sharded(path: Path, state: RunState, rank: int, world: int) -> None:
    replicated = sharded.read_state(path)
    entries = replicated.get("entries", {})
    missing = [k for k in state.replicated_keys if k not in entries]
    if missing:  # checked before anything loads: never half a state
        raise TurbotrainError(
            f"{path.name} holds no {', '.join(missing)} state; it was not saved by this kind of run"
        )
    own = sharded.read_rank_state(path, rank, world)
    for name, (_, load) in state.items():
        if name == state.model_key and state.model is not None:
            sharded.load_into(path, state.model, state.optimizer, replicated)
        elif name in state.tensor_keys:
            continue  # the optimizer: loaded with the model
        elif name in state.per_rank:
            _load_per_rank(name, load, own, path, rank, world)
        else:
            _load_entry(name, load, entries[name], path.name)


def _load_pt_into_ranks(path: Path, payload: dict[str, Any], state: RunState, rank: int, world: int) -> None:
    """A one-process checkpoint into the ranks of a ddp/fsdp run: every rank reads the whole file
    and keeps its part of the model and optimizer."""
    own = {k: payload[k] for k in state.per_rank} if world == 1 else None
    for name, (_, load) in state.items():
        if name == state.model_key and state.model is not None:
            optim = payload.get(state.optimizer_key) if state.optimizer_key else None
            sharded.load_full(state.model, state.optimizer, payload[name], optim, path.name)
        elif name in state.tensor_keys:
            continue
        elif name in state.per_rank:
            _load_per_rank(name, load, own, path, rank, world)
        else:
            _load_entry(name, load, payload[name], path.name)


def _load_per_rank(
    name: str, load: Callable[[Any], None], own: dict[str, Any] | None, path: Path, rank: int, world: int
) -> None:
    if own is not None and name in own:
        _load_entry(name, load, own[name], path.name)
    elif name == "rng":
        reseed(checkpoint_step(path), rank)
        if rank == 0:
            log.warning(
                "%s was written by %d process(es), this run has %d: random number generators re-seeded from "
                "(step, rank) (the data order does not depend on them)",
                path.name,
                sharded.saved_world(path) if path.is_dir() else 1,
                world,
            )
    else:
        log.warning("%s: no %s state for rank %d of %d; it starts fresh", path.name, name, rank, world)


def load_latest_weights(folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The model weights of the newest verified checkpoint of either kind, as one plain state dict
    (full tensors, unwrapped names), read in this process alone (no process group): for
    ``turbotrain sample`` and anything else that only needs the model."""

    def read(path: Path) -> dict[str, torch.Tensor]:
        if not path.is_dir():
            return _verified_load(path, required=("model",))["model"]
        _verified_folder(path)
        return sharded.load_model_weights(path)

    return newest_usable(list_checkpoints(folder), folder, read, advice="", none="train first")


def sharded_parts(state: RunState) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """What a sharded checkpoint of ``state`` holds: (the model's and optimizer's tensors for DCP,
    the replicated entries, this rank's per-rank entries). The tensors are the live ones."""
    if state.model is not None:
        tensors, rest = sharded.split_state(state.model, state.optimizer)
    else:
        tensors, rest = {}, {}
    replicated = {"entries": {name: state[name][0]() for name in state.replicated_keys}, **rest}
    per_rank = {name: state[name][0]() for name in state.per_rank}
    return tensors, replicated, per_rank


def save_sharded(folder: Path, step: int, state: RunState, keep_last: int = 3) -> Path:
    """Write ``state`` as a sharded checkpoint folder (:mod:`turbotrain.loop.sharded`) from every rank
    (a collective); rank 0 then prunes (:func:`prune`, counting both kinds)."""
    return write_sharded(folder, step, sharded_parts(state), keep_last)


def write_sharded(
    folder: Path,
    step: int,
    parts: tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]],
    keep_last: int = 3,
    group: dist.ProcessGroup | None = None,
) -> Path:
    """Write :func:`sharded_parts` (or a copy of them) as a sharded checkpoint folder from every
    rank, its collectives on ``group``; rank 0 then prunes."""
    path = sharded.save(folder, step, *parts, group=group)
    if rank_world()[0] == 0:
        stamp = _stamp(path)
        if stamp is not None:
            _VERIFIED[stamp] = True
        prune(folder, keep_last)
    return path


def stage_to_host(tree: Any, buffers: dict[str, torch.Tensor]) -> Any:
    """A copy of ``tree`` (a checkpoint's payload) in host memory that training cannot change:
    every tensor copied (a CUDA one into pinned memory), dicts (an ``OrderedDict``'s
    ``_metadata`` too), lists and tuples rebuilt, anything else deep-copied; tensors that share
    a storage (tied weights) stay shared, so the file is the one the live state gives. The
    copies go into ``buffers`` (keyed by their place in the tree), kept for the next call: the
    caller reuses them only after whatever read the previous copy is done."""
    copies: dict[tuple[Any, ...], torch.Tensor] = {}
    from_cuda = False

    def copy_tensor(x: torch.Tensor, where: str) -> torch.Tensor:
        nonlocal from_cuda
        t = x.detach()
        key = (
            t.device,
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t.dtype,
        )
        if key not in copies:
            out = buffers.get(where)
            if out is None or out.shape != t.shape or out.dtype != t.dtype:
                out = buffers[where] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            out.copy_(t, non_blocking=t.is_cuda)
            from_cuda |= t.is_cuda
            copies[key] = out
        return copies[key]

    def copy_tree(x: Any, where: str) -> Any:
        if isinstance(x, torch.Tensor):
            return copy_tensor(x, where)
        if isinstance(x, dict):
            out: dict[Any, Any] = collections.OrderedDict() if isinstance(x, collections.OrderedDict) else {}
            for key, value in x.items():
                out[key] = copy_tree(value, f"{where}/{key}")
            if hasattr(x, "_metadata"):  # a module state dict's versions, which load_state_dict reads
                out._metadata = copy.deepcopy(x._metadata)  # type: ignore[attr-defined]
            return out
        if isinstance(x, (list, tuple)):
            items = [copy_tree(value, f"{where}/{i}") for i, value in enumerate(x)]
            if isinstance(x, list):
                return items
            return type(x)(*items) if hasattr(x, "_fields") else tuple(items)  # a namedtuple, or a tuple
        return copy.deepcopy(x)

    staged = copy_tree(tree, "")
    if from_cuda:
        torch.cuda.synchronize()  # host-device sync, once per checkpoint: the copies land before the write reads them
    return staged


class BackgroundWrite:
    """At most one checkpoint write in flight, in a thread of its own: the step that checkpoints
    pays for a copy of the state only (:func:`stage_to_host`), the write (torch.save, fsync,
    checksum, pruning) overlaps the next steps. The write is the synchronous one, unchanged: the
    same temp file, rename and checksum, so a kill -9 mid-write leaves the previous checkpoint as
    it leaves it there. Its failure (a full disk) is kept and raised in the training thread by
    :meth:`wait` or :meth:`poll`. The thread is not a daemon: an interpreter that exits waits for
    the write."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._result: Path | None = None
        self._error: BaseException | None = None

    def start(self, write: Callable[[], Path]) -> None:
        self.wait()  # one write at a time: the next waits for the previous (and raises its failure)

        def run() -> None:
            try:
                self._result = write()
            except BaseException as exc:  # noqa: BLE001 - kept for the training thread, raised there
                self._error = exc

        self._thread = threading.Thread(target=run, name="turbotrain-checkpoint-write", daemon=False)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> Path | None:
        """Block until the write in flight (if any) ends; its checkpoint's path, or its failure
        raised here. None when no write was in flight."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._result

    def poll(self) -> Path | None:
        """:meth:`wait` when the write has ended (its path, or its failure raised), else None: never blocks."""
        return None if self._thread is None or self._thread.is_alive() else self.wait()


class Checkpointer(Hook):
    """Saves ``state`` every ``interval`` steps and when the fit ends (also after a signal or
    stop_after). ``state.state_dict()`` is called only when saving: other steps cost nothing.
    At the start it removes the temporary files of writes killed mid-way (kill -9 during a save)
    and the folders of sharded saves that never finished.

    Format: ``strategy`` (default ``state.strategy``; without either, whether a process group
    exists) decides: single -> one ``.pt`` file from this process; ddp/fsdp -> a sharded folder
    written by every rank, so under a process group every rank must run this hook.

    ``async_write`` (``train.async_checkpoint``): the checkpoints every ``interval`` steps are
    staged (a copy of the state in host memory, reused from one checkpoint to the next) and
    written by a :class:`BackgroundWrite` while training goes on. The next checkpoint waits for
    the previous write; :meth:`save` (a checkpoint now), the final checkpoint, and so a signal's
    (SIGTERM, SIGUSR1), wait for it and write synchronously; an exception waits for it too. A
    failed background write is raised at the next step (one process) or at the next checkpoint
    or the end (ddp/fsdp: every rank at the same point). Sharded writes run their collectives on
    a gloo group of their own, created at the first one.
    """

    def __init__(
        self,
        folder: Path,
        interval: int,
        keep_last: int,
        state: RunState,
        before_save: Callable[[], None] | None = None,
        strategy: Strategy | None = None,
        async_write: bool = TrainConfig.async_checkpoint,
    ) -> None:
        self.folder, self.interval, self.keep_last, self.state = folder, interval, keep_last, state
        self.before_save = before_save  # e.g. flush the metrics: a resume starts after the checkpoint, so records up to it must be on disk
        self.saved_step = -1
        strategy = strategy if strategy is not None else getattr(state, "strategy", None)
        self.sharded = strategy.name != "single" if strategy is not None else in_group()
        self.background = BackgroundWrite() if async_write else None
        self._buffers: dict[str, torch.Tensor] = {}  # host copies of a .pt checkpoint's tensors, reused
        self._stager: Any = None  # a DCP DefaultStager, made at the first background sharded checkpoint
        self._group: dist.ProcessGroup | None = None

    def _finished(self, ctx: FitContext, path: Path | None) -> None:
        if path is not None:
            ctx.metrics["checkpoint"] = str(path)

    def save(self, ctx: FitContext) -> None:
        """A checkpoint now, written before this returns (after the write in flight, if any)."""
        self._save(ctx, background=False)

    def _save(self, ctx: FitContext, background: bool) -> None:
        step = ctx.engine.state.step
        if step == self.saved_step or step == 0:
            return
        start = time.perf_counter()
        if self.background is not None:
            self._finished(ctx, self.background.wait())  # the previous write first (its failure raised here)
        if self.before_save is not None:
            self.before_save()
        if background and self.background is not None:
            self.background.start(self._staged_write(step))
        else:
            if self.sharded:
                path = save_sharded(self.folder, step, self.state, self.keep_last)
            else:
                path = save_checkpoint(self.folder, step, self.state.state_dict(), self.keep_last)
            self._finished(ctx, path)
        ctx.side_s += time.perf_counter() - start
        self.saved_step = step

    def _stage_shards(self, tree: Any) -> Any:
        """:func:`stage_to_host` for a sharded checkpoint's parts (FSDP2's DTensors: their local
        shards are copied), through DCP's stager, which keeps its buffers from one call to the next."""
        if self._stager is None:
            # costly (DCP): when first used
            from torch.distributed.checkpoint.staging import (
                DefaultStager,
                StagingOptions,
            )

            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=cuda,
                )
            )
        return self._stager.stage(tree)

    def _staged_write(self, step: int) -> Callable[[], Path]:
        """Copy the state now (in this thread: training changes it right after); return the
        write of the copy, for the background thread."""
        folder, keep_last = self.folder, self.keep_last
        if not self.sharded:
            payload = stage_to_host(self.state.state_dict(), self._buffers)
            return lambda: save_checkpoint(folder, step, payload, keep_last)
        parts = self._stage_shards(sharded_parts(self.state))
        # every rank saves at the same steps: created at the same point
        if self._group is None and in_group():
            self._group = new_gloo_group()  # left at exit (core.distributed.shutdown)
        group = self._group
        return lambda: write_sharded(folder, step, parts, keep_last, group=group)

    def on_fit_start(self, ctx: FitContext) -> None:
        if self.background is not None and self.sharded and self._group is None and in_group():
            # the background writes' own group, made now on every rank: later (at the first save) the
            # launcher's store may be gone (orphaned ranks still save at their stop)
            self._group = new_gloo_group()  # left at exit (core.distributed.shutdown)
        for path in clean_stale_temps(self.folder):
            log.info("removed %s, left by a checkpoint write that was killed", path)
        if rank_world()[0] == 0:  # one process cleans; no save runs before every rank reaches it
            for path in sharded.clean_unfinished(self.folder):
                log.info("removed %s, a sharded checkpoint whose save did not finish", path)

    def on_step_end(self, ctx: FitContext) -> None:
        if self.background is not None and not self.sharded:
            self._finished(ctx, self.background.poll())  # a failed write stops the run at the next step
        if every(ctx.engine.state.step, self.interval):
            self._save(ctx, background=True)

    def on_fit_end(self, ctx: FitContext) -> None:
        self.save(ctx)
        if self.background is not None:  # the final step was saved already: the write in flight
            self._finished(ctx, self.background.wait())

    def on_exception(self, ctx: FitContext, exc: BaseException) -> None:
        """The write in flight ends before the exception goes on (it is the newest checkpoint a
        resume finds); its own failure is logged, the exception that stopped training propagates."""
        if self.background is None:
            return
        try:
            self.background.wait()
        except Exception as failure:  # noqa: BLE001 - the training's exception is the one to raise
            log.warning("the checkpoint write in flight failed too: %s", failure)
