"""The random generators a training step may draw from, in one place: seeding all of them
(torch's on every device, Python's ``random``, numpy's), reading and restoring their state (what a
checkpoint saves, what the batch finder puts back after its trials), and deriving independent seeds
from a run's seed and a position (a data-loader worker's micro-batch)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from, in weights_only-loadable types."""
    np_state = np.random.get_state()  # legacy=True (the default): a tuple
    assert isinstance(np_state, tuple)
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


def seed_all(seed: int) -> None:
    """Seed every generator a user's code may draw from: torch's (every device's too), Python's
    ``random`` and numpy's. A run seeds all three at its start (``run.seed``), so a model or loss
    that draws from ``random`` or numpy trains the same in every run, as a resumed run does."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def derive_seed(seed: int, *position: int) -> int:
    """A 32-bit seed for ``position`` (e.g. step and global micro-batch slot) of a run seeded
    ``seed``: numpy's SeedSequence hashes them, so nearby positions give unrelated streams and no
    position's stream is another's (unlike ``seed * c + k``, where two formulas can collide)."""
    return int(np.random.SeedSequence([seed % 2**63, *position]).generate_state(1)[0])
