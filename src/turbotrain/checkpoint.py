"""Checkpoints that survive crashes and never execute code on load.

Save: ``torch.save`` through :func:`turbotrain.atomic.atomic_write`, then a ``.sha256`` sidecar
written the same way. Load: newest first, verify the checksum, load with ``weights_only=True``
(no arbitrary unpickling); a corrupt, foreign or incomplete file falls back to the previous.
Pruning (:func:`prune`) counts only checkpoints that verify, so ``keep_last`` never deletes the
last usable one. What a checkpoint holds is one :class:`RunState` registry, saved by the
:class:`Checkpointer` and loaded by :func:`restore_latest`.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .atomic import atomic_write, clean_stale_temps
from .engine import Engine
from .errors import TurbotrainError
from .hooks import FitContext, Hook, every

log = logging.getLogger(__name__)

FORMAT = 1
_NAME = re.compile(r"^step_(\d{8,})\.pt$")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from, in weights_only-loadable types."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def checkpoint_path(folder: Path, step: int) -> Path:
    return folder / f"step_{step:08d}.pt"


def checkpoint_step(path: Path) -> int:
    """The optimizer step a checkpoint file was saved at (from its name)."""
    m = _NAME.match(path.name)
    if m is None:
        raise ValueError(f"{path.name} is not a checkpoint file name")
    return int(m[1])


def sidecar(path: Path) -> Path:
    """The checksum file next to a checkpoint."""
    return path.with_name(path.name + ".sha256")


def list_checkpoints(folder: Path) -> list[Path]:
    """Checkpoint files in ``folder``, oldest (lowest step) first."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if _NAME.match(p.name)), key=checkpoint_step)


def finished_checkpoints(folder: Path) -> list[Path]:
    """Checkpoints whose save finished (their checksum file exists), oldest first. A file without
    one is a save killed between the rename and the checksum: it does not count as a checkpoint."""
    return [p for p in list_checkpoints(folder) if sidecar(p).is_file()]


def _stamp(path: Path) -> tuple[str, int, int, int] | None:
    try:
        st, side = path.stat(), sidecar(path).stat()
    except OSError:
        return None
    return str(path), st.st_size, st.st_mtime_ns, side.st_mtime_ns


_VERIFIED: dict[tuple[str, int, int, int], bool] = {}  # (path, size, mtimes) -> checksum matched


def _check_digest(path: Path) -> str:
    """'' when ``path`` matches its sidecar, else why not. The sidecar's bytes are read as they
    are: a damaged one (not even ASCII) is a mismatch, not a crash."""
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
    (:func:`prune`). Lack of space raises :class:`turbotrain.atomic.DiskFullError`; the older
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
        detail = " ".join(str(exc).split())[:200]
        raise TurbotrainError(f"{path.name} cannot be read: {detail}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise TurbotrainError(f"{path.name} is not a turbotrain checkpoint (format {FORMAT})")
    missing = [key for key in required if key not in payload]
    if missing:
        raise TurbotrainError(f"{path.name} holds no {', '.join(missing)} state")
    return payload


def load_latest(folder: Path, required: tuple[str, ...] = ()) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint that verifies and holds every key in ``required``; corrupt,
    foreign or incomplete ones are skipped with a warning."""
    candidates = list_checkpoints(folder)
    if not candidates:
        raise TurbotrainError(f"no checkpoint in {folder}; start without --resume")
    problems = []
    for path in reversed(candidates):
        try:
            return path, _verified_load(path, required)
        except TurbotrainError as exc:
            log.warning("skipping checkpoint: %s", exc)
            problems.append(str(exc))
    raise TurbotrainError(
        f"no usable checkpoint in {folder} ({'; '.join(problems)}); move them away and resume to restart "
        "this run from step 0, or start a new run without --resume"
    )


Stateful = tuple[Callable[[], Any], Callable[[Any], None]]  # (state_dict, load_state_dict)


class RunState(dict[str, Stateful]):
    """The registry of a run's stateful objects, in load order: name -> (state_dict,
    load_state_dict). Entries may be given as objects with those two methods."""

    def __init__(self, **entries: Any) -> None:
        super().__init__({k: v if isinstance(v, tuple) else (v.state_dict, v.load_state_dict) for k, v in entries.items()})

    def state_dict(self) -> dict[str, Any]:
        return {name: save() for name, (save, _) in self.items()}

    def load_state_dict(self, payload: dict[str, Any], source: str = "checkpoint") -> None:
        missing = [name for name in self if name not in payload]
        if missing:  # checked before anything loads: never half a state
            raise TurbotrainError(f"{source} holds no {', '.join(missing)} state; it was not saved by this kind of run")
        for name, (_, load) in self.items():
            try:
                load(payload[name])
            except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as exc:  # shapes or groups changed by overrides
                detail = " ".join(str(exc).split())[:300]
                raise TurbotrainError(f"{source}: its {name} state does not fit the {name} this config builds "
                                      f"({detail}); resume without overrides that change --model.* settings") from None


def run_state(engine: Engine, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None,
              **extra: Any) -> RunState:
    """What a training run saves and resumes: the engine first (its state holds the data position,
    ``state.batches``, and a precision fallback it restores recasts the weights, so they must load
    after it), then model, optimizer, scheduler (when there is one), every RNG, and ``extra``."""
    entries: dict[str, Any] = {"engine": (engine.state_dict, lambda sd: engine.load_state_dict(sd, optimizer)),
                               "model": model, "optimizer": optimizer}
    if scheduler is not None:
        entries["scheduler"] = scheduler
    return RunState(**entries, rng=(rng_state, set_rng_state), **extra)


def restore_latest(folder: Path, state: RunState) -> Path:
    """Load the newest checkpoint in ``folder`` that verifies and holds every entry of ``state``
    into ``state``; returns its path."""
    path, payload = load_latest(folder, required=tuple(state))
    state.load_state_dict(payload, source=path.name)
    return path


class Checkpointer(Hook):
    """Saves ``state`` every ``interval`` steps and when the fit ends (also after a signal or
    stop_after). ``state.state_dict()`` is called only when saving: other steps cost nothing.
    At the start it removes the temporary files of writes killed mid-way (kill -9 during a save).
    """

    def __init__(self, folder: Path, interval: int, keep_last: int, state: RunState,
                 before_save: Callable[[], None] | None = None) -> None:
        self.folder, self.interval, self.keep_last, self.state = folder, interval, keep_last, state
        self.before_save = before_save  # e.g. flush the metrics: a resume starts after the checkpoint, so records up to it must be on disk
        self.saved_step = -1

    def save(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        if step == self.saved_step or step == 0:
            return
        start = time.perf_counter()
        if self.before_save is not None:
            self.before_save()
        path = save_checkpoint(self.folder, step, self.state.state_dict(), self.keep_last)
        ctx.side_s += time.perf_counter() - start
        self.saved_step = step
        ctx.metrics["checkpoint"] = str(path)

    def on_fit_start(self, ctx: FitContext) -> None:
        for path in clean_stale_temps(self.folder):
            log.info("removed %s, left by a checkpoint write that was killed", path)

    def on_step_end(self, ctx: FitContext) -> None:
        if every(ctx.engine.state.step, self.interval):
            self.save(ctx)

    def on_fit_end(self, ctx: FitContext) -> None:
        self.save(ctx)
