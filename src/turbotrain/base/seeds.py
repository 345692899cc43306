"""The random generators a training step may draw from (torch's, Python's, numpy's), in one place:
seeding, saving and restoring them, and deriving independent seeds."""

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
    """Seed torch's (every device's), Python's and numpy's generators."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def derive_seed(seed: int, *position: int) -> int:
    """A 32-bit seed for ``position`` of a run seeded ``seed`` (SeedSequence: unrelated streams)."""
    return int(np.random.SeedSequence([seed % 2**63, *position]).generate_state(1)[0])
