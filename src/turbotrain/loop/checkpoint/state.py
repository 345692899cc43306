"""What a run saves: the :class:`RunState` registry of its stateful objects, in load order."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ...base.errors import TurbotrainError
from ...base.seeds import rng_state, seed_all, set_rng_state
from ...core.distributed import Strategy
from ...core.engine import Engine

Stateful = tuple[Callable[[], Any], Callable[[Any], None]]  # (state_dict, load_state_dict)


class RunState(dict[str, Stateful]):
    """The registry of a run's stateful objects, in load order: name -> (state_dict,
    load_state_dict), or objects with those two methods. ``per_rank`` entries (the RNG) are restored
    when the world size matches, else re-seeded; ``optional`` ones may be missing (start fresh)."""

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
        self.optional: frozenset[str] = frozenset()

    def state_dict(self) -> dict[str, Any]:
        return {name: save() for name, (save, _) in self.items()}

    def load_state_dict(self, payload: dict[str, Any], source: str = "checkpoint") -> None:
        self.check_holds(payload, source)
        for name, (_, load) in self.items():
            if name in payload:
                load_entry(name, load, payload[name], source)

    @property
    def required(self) -> tuple[str, ...]:
        """The entries a checkpoint must hold (all but ``optional``)."""
        return tuple(k for k in self if k not in self.optional)

    def missing(self, saved: Any, keys: Iterable[str] | None = None) -> list[str]:
        """The entries of ``keys`` (default: all) that ``saved`` lacks and may not lack."""
        return [k for k in (self if keys is None else keys) if k not in saved and k not in self.optional]

    def check_holds(self, saved: Any, source: str, keys: Iterable[str] | None = None) -> None:
        """Raise (one line) unless ``saved`` holds every entry it may not lack."""
        missing = self.missing(saved, keys)
        if missing:
            raise TurbotrainError(
                f"{source} holds no {', '.join(missing)} state; it was not saved by this kind of run"
            )

    @property
    def tensor_keys(self) -> tuple[str, ...]:
        """The entries a sharded checkpoint stores through DCP (the model and its optimizer)."""
        return tuple(
            k for k in (self.model_key, self.optimizer_key) if k is not None and self.model is not None
        )

    @property
    def replicated_keys(self) -> tuple[str, ...]:
        """The entries every rank holds alike."""
        return tuple(k for k in self if k not in self.tensor_keys and k not in self.per_rank)


def load_entry(name: str, load: Callable[[Any], None], value: Any, source: str) -> None:
    """``load(value)``; a failure (shapes changed by overrides) is one line naming the entry."""
    try:
        load(value)
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as exc:
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
    *,
    optional: dict[str, Any] | None = None,
    **extra: Any,
) -> RunState:
    """What a training run saves and resumes: the engine first (a precision fallback it restores
    recasts the weights), then model, optimizer, scheduler, every RNG, ``extra``, and ``optional``
    (entries an older checkpoint may lack)."""
    entries: dict[str, Any] = {
        "engine": (engine.state_dict, lambda sd: engine.load_state_dict(sd, optimizer)),
        "model": model,
        "optimizer": optimizer,
    }
    if scheduler is not None:
        entries["scheduler"] = scheduler
    state = RunState(**entries, rng=(rng_state, set_rng_state), **extra, **(optional or {}))
    state.strategy, state.optional = engine.strategy, frozenset(optional or ())
    return state


def reseed(step: int, rank: int) -> None:
    """Seed every RNG from (step, rank): the stand-in for per-rank RNG state of another world size."""
    seed_all((step * 1_000_003 + rank) % 2**32)
