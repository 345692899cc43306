"""Checkpoints that survive crashes and never execute code on load.

Save: ``torch.save`` through :func:`turbotrain.atomic.atomic_write`, then a ``.sha256`` sidecar
written the same way. Load: newest first, verify the checksum, load with ``weights_only=True``
(no arbitrary unpickling); a corrupt file falls back to the previous. What a checkpoint holds is
one :class:`RunState` registry, saved by the :class:`Checkpointer` and loaded by :func:`restore_latest`.
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

from .atomic import atomic_write
from .engine import Engine
from .errors import TurbotrainError
from .hooks import FitContext, Hook, every

log = logging.getLogger(__name__)

FORMAT = 1
_NAME = re.compile(r"^step_(\d{8})\.pt$")


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


def list_checkpoints(folder: Path) -> list[Path]:
    """Checkpoint files in ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _NAME.match(p.name))


def save_checkpoint(folder: Path, step: int, payload: dict[str, Any], keep_last: int = 3) -> Path:
    """Write ``payload`` atomically as ``step_XXXXXXXX.pt`` with its checksum; prune old ones."""
    folder.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(folder, step)
    atomic_write(path, lambda f: torch.save({"format": FORMAT, **payload}, f))
    digest = sha256_of(path)
    atomic_write(path.with_name(path.name + ".sha256"), f"{digest}  {path.name}\n")
    for old in list_checkpoints(folder)[:-keep_last]:
        old.unlink(missing_ok=True)
        old.with_name(old.name + ".sha256").unlink(missing_ok=True)
    return path


def _verified_load(path: Path) -> dict[str, Any]:
    sidecar = path.with_name(path.name + ".sha256")
    if not sidecar.is_file():
        raise TurbotrainError(f"{path.name} has no checksum file")
    expected = sidecar.read_text().split()[0] if sidecar.read_text().strip() else ""
    if sha256_of(path) != expected:
        raise TurbotrainError(f"{path.name} does not match its checksum (truncated or corrupt)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means an unusable file
        raise TurbotrainError(f"{path.name} cannot be read: {exc}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise TurbotrainError(f"{path.name} is not a turbotrain checkpoint (format {FORMAT})")
    return payload


def load_latest(folder: Path) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint that verifies; corrupt ones are skipped with a warning."""
    candidates = list_checkpoints(folder)
    if not candidates:
        raise TurbotrainError(f"no checkpoint in {folder}; start without --resume")
    problems = []
    for path in reversed(candidates):
        try:
            return path, _verified_load(path)
        except TurbotrainError as exc:
            log.warning("skipping checkpoint: %s", exc)
            problems.append(str(exc))
    raise TurbotrainError(
        f"no usable checkpoint in {folder} ({'; '.join(problems)}); start a new run without --resume"
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
        for name, (_, load) in self.items():
            try:
                load(payload[name])
            except (RuntimeError, ValueError) as exc:  # shapes or parameter groups changed by overrides
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
    """Load the newest checkpoint in ``folder`` that verifies into ``state``; returns its path."""
    path, payload = load_latest(folder)
    state.load_state_dict(payload, source=path.name)
    return path


class Checkpointer(Hook):
    """Saves ``state`` every ``interval`` steps and when the fit ends (also after a signal or
    stop_after). ``state.state_dict()`` is called only when saving: other steps cost nothing.
    """

    def __init__(self, folder: Path, interval: int, keep_last: int, state: RunState) -> None:
        self.folder, self.interval, self.keep_last, self.state = folder, interval, keep_last, state
        self.saved_step = -1

    def save(self, ctx: FitContext) -> None:
        step = ctx.engine.state.step
        if step == self.saved_step or step == 0:
            return
        start = time.perf_counter()
        path = save_checkpoint(self.folder, step, self.state.state_dict(), self.keep_last)
        ctx.side_s += time.perf_counter() - start
        self.saved_step = step
        ctx.metrics["checkpoint"] = str(path)

    def on_step_end(self, ctx: FitContext) -> None:
        if every(ctx.engine.state.step, self.interval):
            self.save(ctx)

    def on_fit_end(self, ctx: FitContext) -> None:
        self.save(ctx)
